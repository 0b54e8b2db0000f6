"""Domain-parallel ``F.local_response_norm``: a window along the channels.

torch's definition, for an input (N, C, *spatial) and a window of ``size`` channels::

    div[c] = mean(x[c - size//2 .. c + (size-1)//2] ** 2)     (zeros past either end)
    y[c]   = x[c] / (k + alpha * div[c]) ** beta

Every (n, position) is alone, so a cut of the batch or of a spatial dim is local: torch's
own op on the block, no message. A cut of the channels is a convolution of ``size`` rows
with padding ``(size//2, (size-1)//2)`` along dim 1 (output c belongs to the owner of
input c, so the output keeps the input's sizes)::

    1. halo exchange along C: exactly the size//2 channels before the rank's first and
       the (size-1)//2 after its last (point to point, label
       ``local_response_norm.halo``; zeros past the global ends)  -> window
    2. torch's own steps on the window (square, avg_pool over ``size`` channels with
       stride 1, no padding: the rank's channels), then x / (k + alpha div) ** beta

Backward: autograd through the window; the halo channels' gradients go back to their
owners (the same messages, reversed). No collective.
"""

from __future__ import annotations

import torch.nn.functional as F

from shardlab.comm.halo import Halo, peers_along
from shardlab.layout import conv_plan
from shardlab.ops._cnn_common import check_input, empty_like_output, meta_call, my_offset, rewrap
from shardlab.ops.registry import register


@register("local_response_norm", at_function=True)
def local_response_norm(input, size, alpha=1e-4, beta=0.75, k=1.0):
    input = check_input("local_response_norm", input)
    meta_call(F.local_response_norm, input, size, alpha=alpha, beta=beta, k=k)  # its checks
    x, layout = input.to_local(), input.sharding
    cut = layout.cut_by(1)
    if not cut or input.numel() == 0:  # whole channel windows on every rank: local
        y = F.local_response_norm(x, size, alpha, beta, k) if x.numel() else x * 1
        return rewrap(y, input, {}, input.shape)
    m, mesh = cut[0], input.device_mesh
    plan = conv_plan(layout.sizes_along(1), size, 1, 1, (size // 2, (size - 1) // 2))
    peers, me = peers_along(mesh, m)
    window = Halo.apply(
        x * x, plan, 1, peers, me, my_offset(input, 1), 0.0, "local_response_norm.halo"
    )  # (N, size - 1 + C_local, *spatial)
    if x.shape[1] == 0:  # no channel here: an empty block, tied for the exchanges
        return rewrap(empty_like_output(window, x.shape), input, {}, input.shape)
    if x.ndim == 3:  # torch's own steps, on the window
        div = F.avg_pool2d(window.unsqueeze(1), (size, 1), stride=1).squeeze(1)
    else:
        n, cw = window.shape[:2]
        div = window.view(n, 1, cw, window.shape[2], -1)
        div = F.avg_pool3d(div, (size, 1, 1), stride=1).squeeze(1).view(x.shape)
    y = x / div.mul(alpha).add(k).pow(beta)
    return rewrap(y, input, {}, input.shape)
