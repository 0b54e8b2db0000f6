"""The fused normalisation kernel behind :mod:`.norm`: one all-reduce forward, one backward.

``SyncNorm.apply(x, w, b, spec)`` on the local block x::

    forward   xv = x viewed as spec.view                  e.g. group_norm (N, G, C/G, *S)
              this rank's n_r elements per statistic: its mean m_r, and
              M2_r = sum (xv - m_r)^2 over spec.dims (centred: no cancellation)
              s  = [n_r m_r, M2_r, n_r m_r^2] in float64                local, keepdim
              all_reduce(s) over spec.groups                            "<op>.stats forward"
              mean = s0/n, var = (s1 + s2)/n - mean^2  (Chan's combination; float64
              keeps the last difference exact to ~1e-16 mean^2/var, whatever the mean)
              rstd = 1/sqrt(var + eps); y = (xv - mean) * rstd (viewed back) * w + b
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

import math
from dataclasses import dataclass

import torch

from shardlab.comm._once import first_order
from shardlab.comm.recompute import fenced, kept
from shardlab.ops._cnn_common import _all_reduce, summed_together
from shardlab.tensor import grad_sum


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
    """``y, mean, var = SyncNorm.apply(x, w, b, spec)`` (mean, var: no gradient)."""

    @staticmethod
    def forward(ctx, x, w, b, spec: NormSpec):
        xv = _work(x).reshape(spec.view)
        n_r = math.prod(xv.shape[d] for d in spec.dims)  # this rank's elements per statistic
        m_r = xv.sum(spec.dims, keepdim=True) / max(n_r, 1)  # (stat shape); 0 when empty
        xc = xv - m_r  # one temporary, squared in place (peak memory as torch's kernels)
        q_r = xc.square_().sum(spec.dims, keepdim=True)
        del xc
        m64 = m_r.double()
        local = torch.stack([m64 * n_r, q_r.double(), m64 * m64 * n_r])
        stats = _all_reduce(local, spec.groups, spec.cause, "forward") if spec.groups else local
        mean64 = stats[0] / spec.count
        var64 = ((stats[1] + stats[2]) / spec.count - mean64 * mean64).clamp_min(0)
        mean, var = mean64.to(xv.dtype), var64.to(xv.dtype)
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
    @first_order("batch/group/instance norm")
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
        return dx.reshape(x.shape).to(x.dtype), grad_w, grad_b, None


@fenced
class RowsNorm(torch.autograd.Function):
    """``RowsNorm.apply(input, weight, bias, shape, eps, groups)``: layer_norm over whole
    rows of the ShardTensor ``input`` (no mesh dim of more than one rank cuts the last
    ``len(shape)`` dims), plain ``weight`` / ``bias`` (or None), in ONE Function::

        forward   y, mean, rstd = torch's native_layer_norm on this rank's block
        backward  the incoming gradient on the output's blocks; torch's
                  native_layer_norm_backward on the block: dx (this rank's), dw, db
                  (this rank's rows) -> summed over ``groups`` (the mesh dims
                  cutting the other dims): parameters at the end of the backward
                  with all the others ("params backward", ``shardlab.tensor.grad_sum``),
                  else one all_reduce of [dw, db] here  "layer_norm.params backward"

    No forward communication; none at all when ``groups`` is empty (one rank)."""

    @staticmethod
    def forward(ctx, input, weight, bias, shape, eps, groups):
        from shardlab.tensor.api import ShardTensor

        x = input._local_tensor  # (..., *shape), whole rows
        y, mean, rstd = torch.native_layer_norm(x, shape, weight, bias, eps)
        ctx.to_save = (x, weight, bias, mean, rstd)
        ctx.shape, ctx.groups = shape, groups
        ctx.deferrable = [grad_sum.deferrable_input(t) for t in (weight, bias)]
        ctx.mesh, ctx.layout = input.device_mesh, input._layout
        return ShardTensor._wrap(y, ctx.mesh, ctx.layout)

    @staticmethod
    @first_order("layer norm")
    def backward(ctx, grad):
        from shardlab.tensor.api import ShardTensor
        from shardlab.tensor.functions import local_block

        x, w, b, mean, rstd = kept(ctx)
        g = local_block(grad, ctx.layout, ctx.mesh)  # (..., *shape) on this rank's rows
        need = [ctx.needs_input_grad[0], w is not None, b is not None]
        dx, dw, db = torch.ops.aten.native_layer_norm_backward(
            g, x, ctx.shape, mean, rstd, w, b, need
        )
        params = [d for d in (dw, db) if d is not None]  # (asked for: w, b given)
        if ctx.groups and params:  # summed over the ranks holding the other rows
            later = [  # parameters' sums wait for the end of the backward
                d is not None and ctx.deferrable[i] and grad_sum.keep(ctx, edge, d, ctx.groups)
                for i, (d, edge) in enumerate(zip((dw, db), (1, 1 + (w is not None))))
            ]
            dw, db = (None if k else d for d, k in zip((dw, db), later))
            params = [d for d in (dw, db) if d is not None]
            if params:
                it = iter(summed_together(params, ctx.groups, "layer_norm.params"))
                dw, db = (None if d is None else next(it) for d in (dw, db))
        dx = None if dx is None else ShardTensor._wrap(dx, ctx.mesh, ctx.layout)
        return dx, dw, db, None, None, None
