"""The fused normalisation kernel behind :mod:`.norm`: one all-reduce forward, one backward.

``SyncNorm.apply(x, w, b, spec)`` on the local block x::

    forward   xv = x viewed as spec.view                  e.g. group_norm (N, G, C/G, *S)
              s  = [sum (xv - K), sum (xv - K)^2] over spec.dims        local, keepdim
              all_reduce(s) over spec.groups                            "<op>.stats forward"
              mean = K + s0/n, var = s1/n - (s0/n)^2, rstd = 1/sqrt(var + eps)
              y = (xv - mean) * rstd (viewed back) * w + b
              saves x (the caller's tensor, no copy), mean, rstd: as torch's own kernels

    backward  xhat recomputed; g = dy * w
              [sum g, sum g * xhat] over spec.dims, and, when spec.fuse_params, the
              parameter sums [sum dy * xhat, sum dy] too, in ONE all_reduce  "<op>.stats backward"
              dx = rstd * (g - sum g / n - xhat * sum(g xhat) / n)

With ``fuse_params`` (the statistics' group is every mesh dim sharding the input, e.g.
batch_norm) the weight and bias gradients come out summed over the ranks, as single
device; otherwise they are this rank's part and the caller sums them (``summed_grads``).
Double backward is not supported.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardlab.ops._cnn_common import _all_reduce
from shardlab.tensor.recompute import fenced, kept


@dataclass(frozen=True)
class NormSpec:
    view: tuple  # local shape x is viewed as for the statistics
    dims: tuple  # dims of that view reduced by the statistics
    count: int  # global number of elements behind each statistic
    groups: list  # process groups of the all-reduce (sequential if more than one)
    cause: str  # trace label, e.g. "batch_norm.stats"
    eps: float
    param_view: tuple | None  # shape w and b are viewed as against x, e.g. (1, C, 1, 1)
    fuse_params: bool  # parameter gradients summed by the same all-reduce


def _work(t):
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


@fenced
class SyncNorm(torch.autograd.Function):
    """``y, mean, var = SyncNorm.apply(x, w, b, spec, shift)`` (mean, var: no gradient)."""

    @staticmethod
    def forward(ctx, x, w, b, spec: NormSpec, shift):
        xv = _work(x).reshape(spec.view)
        xc = xv - shift  # one temporary, squared in place (peak memory as torch's kernels)
        s1 = xc.sum(spec.dims, keepdim=True)
        local = torch.stack([s1, xc.square_().sum(spec.dims, keepdim=True)])
        del xc
        stats = _all_reduce(local, spec.groups, spec.cause, "forward") if spec.groups else local
        m1 = stats[0] / spec.count
        mean = shift + m1
        var = (stats[1] / spec.count - m1 * m1).clamp_min(0)
        rstd = torch.rsqrt(var + spec.eps)
        y = (xv - mean).mul_(rstd).reshape(x.shape).to(x.dtype)
        view = lambda t: t.view(spec.param_view) if spec.param_view else t  # noqa: E731
        if w is not None:
            y = y.mul_(view(w))
        if b is not None:
            y = y.add_(view(b))
        ctx.spec = spec
        ctx.params = [(t.shape, view(t).shape, t.dtype) if t is not None else None for t in (w, b)]
        ctx.save_for_backward(x, w, mean, rstd)
        ctx.mark_non_differentiable(mean, var)
        return y, mean, var

    @staticmethod
    def backward(ctx, dy, _dmean, _dvar):
        x, w, mean, rstd = kept(ctx)
        spec = ctx.spec
        dyw = _work(dy)
        xhat = ((_work(x).reshape(spec.view) - mean) * rstd).reshape(x.shape)
        pw, pb = ctx.params
        params = []  # this rank's parameter sums: weight (sum dy * xhat), bias (sum dy)
        if pw is not None:
            params.append((dyw * xhat).sum_to_size(pw[1]).reshape(-1))
        if pb is not None:
            params.append(dyw.sum_to_size(pb[1]).reshape(-1))
        g = (dyw if w is None else dyw * w.view(pw[1])).reshape(spec.view)
        xv_hat = xhat.reshape(spec.view)
        sums = [g.sum(spec.dims, keepdim=True), (g * xv_hat).sum(spec.dims, keepdim=True)]
        flat = torch.cat([t.reshape(-1) for t in sums] + (params if spec.fuse_params else []))
        if spec.groups:  # the one backward collective
            flat = _all_reduce(flat, spec.groups, spec.cause, "backward")
        n_stat = sums[0].numel()
        s_g = flat[:n_stat].view(sums[0].shape)
        s_gx = flat[n_stat : 2 * n_stat].view(sums[0].shape)
        if spec.fuse_params:
            params = list(flat[2 * n_stat :].split([p.numel() for p in params]))
        # dx = rstd * (g - s_g / n - xhat * s_gx / n), in place on xhat
        dx = xv_hat.mul_(-s_gx / spec.count).add_(g).sub_(s_g / spec.count).mul_(rstd)
        grads = iter(params)
        grad_w, grad_b = (None if p is None else next(grads).view(p[0]).to(p[2]) for p in (pw, pb))
        return dx.reshape(x.shape).to(x.dtype), grad_w, grad_b, None, None
