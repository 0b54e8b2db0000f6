"""Domain-parallel convolution: ``F.conv{1,2,3}d`` and ``F.conv_transpose{1,2,3}d``.

An input ``(N, C, *spatial)`` sharded along spatial dims (any sizes, 1-D or 2-D
mesh) or along the batch::

    0. torch's own argument checks on meta tensors of the global shapes (the same
       error on every rank, before any message; kept per signature)
    1. for each sharded spatial dim, in order: halo exchange (point to point,
       exactly the rows the local windows read; corners on a 2-D mesh travel
       with the second dim's exchange)               -> window (N, C, *W_local)
    2. the plain torch op on the window, padding 0 on sharded dims
       (conv_transpose: then crop to the rank's outputs)
    3. output (N, C_out, *spatial_out) sharded like the input, exact sizes

With one sharded spatial dim (a convolution, not transposed), steps 1 and 2 overlap:
the halo messages travel while the interior outputs are computed on the rank's own
rows (``_conv_overlap.py``; the same messages and results, no window copy;
``with conv.halo_overlap(False):`` exchanges first).

Backward: the halo gradients go back to their owners (same messages,
reversed); the weight and bias gradients are summed over the sharded mesh
dims by one fused all-reduce (plain ``nn.Parameter`` weights, whose gradients
equal single device; a Replicate ShardTensor's: Partial, summed when read).
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from shardlab.comm.halo import Halo, WindowRecipe, peers_along
from shardlab.layout import conv_plan, same_padding
from shardlab.layout._checks import placement_str
from shardlab.ops._cnn_common import cut_once, meta_call, meta_like, summed_grads
from shardlab.ops._conv_channels import channel_cut
from shardlab.ops._conv_overlap import OverlappedConv, interior
from shardlab.ops.registry import register

__all__ = ["halo_overlap"]

_OVERLAP: contextvars.ContextVar[bool] = contextvars.ContextVar("halo_overlap", default=True)


@contextlib.contextmanager
def halo_overlap(enabled: bool = True):
    """Inside: sharded convolutions overlap their halo messages with the interior (on,
    by default) or exchange first and compute after (``False``: for comparison).

    Example::

        with shardlab.patched(), halo_overlap(False):
            y = conv(x)                   # the same messages and values, exchanged first
    """
    token = _OVERLAP.set(bool(enabled))
    try:
        yield
    finally:
        _OVERLAP.reset(token)


def _tuple(name: str, value, n: int) -> tuple[int, ...]:
    if isinstance(value, int):
        return (value,) * n
    value = tuple(value)
    if len(value) == 1:
        return value * n
    if len(value) != n or not all(isinstance(v, int) for v in value):
        raise ValueError(f"{name} must be an int or a tuple of {n} ints, got {value!r}")
    return value


def _paddings(padding, k, s, d, n, name):
    """Per spatial dim (left, right), from an int, a tuple, 'same' or 'valid'."""
    if isinstance(padding, str):
        if padding == "valid":
            return [(0, 0)] * n
        if padding == "same":
            if any(x != 1 for x in s):
                raise ValueError(
                    f"{name}: padding='same' is not supported for strided convolutions"
                )
            return [same_padding(ki, di) for ki, di in zip(k, d)]
        raise ValueError(
            f"{name}: invalid padding string {padding!r}, should be one of {{'valid', 'same'}}"
        )
    return [(p, p) for p in _tuple("padding", padding, n)]


def replicated_param(t, mesh, input_placements):
    """A weight/bias as a local tensor whose gradient is summed over the mesh dims
    that shard the input (Partial), replicated over the others."""
    from shardlab.tensor import ShardTensor, distribute

    if t is None:
        return None
    if not isinstance(t, ShardTensor):
        t = distribute(t, mesh, [Replicate()] * mesh.ndim)
    elif not all(isinstance(p, Replicate) for p in t.placements):
        raise NotImplementedError(
            f"sharded conv needs a replicated weight and bias, got placements {t.placements}"
        )
    grads = [Partial() if isinstance(p, Shard) else Replicate() for p in input_placements]
    return t.to_local(grad_placements=grads)


def _conv(name: str, n: int, transposed: bool):
    torch_op = getattr(torch, name)

    def handler(input, weight, bias=None, stride=1, padding=0, *rest, **kwargs):
        from shardlab.tensor import ShardTensor

        if transposed:
            output_padding, groups, dilation = (list(rest) + [0, 1, 1][len(rest) :])[:3]
            output_padding = kwargs.get("output_padding", output_padding)
        else:
            dilation, groups = (list(rest) + [1, 1][len(rest) :])[:2]
        dilation = kwargs.get("dilation", dilation)
        groups = kwargs.get("groups", groups)
        if not isinstance(input, ShardTensor):
            raise NotImplementedError(f"{name}: only the input may be a sharded ShardTensor")
        if input.ndim == n + 1:  # unbatched (C, *spatial), as torch takes it: a batch of 1
            if any(isinstance(p, Shard) and p.dim == 0 for p in input.placements):
                # its channels cut: each rank's term of the sum over them (a Partial)
                args = (stride, padding, *rest)
                return channel_cut(name, torch_op, transposed, input, weight, bias, args,
                                   kwargs, groups)  # fmt: skip
            y = handler(input.unsqueeze(0), weight, bias, stride, padding, *rest, **kwargs)
            return y.squeeze(0)
        if input.ndim != n + 2:  # torch's error type
            raise RuntimeError(
                f"{name}: expected a {n + 1}-D (C, *{n} spatial dims) or {n + 2}-D input (N, C, "
                f"*{n} spatial dims), got {input.ndim}-D of global shape {list(input.shape)}"
            )
        # torch's own checks (channels, groups, kernel larger than the padded input …) on
        # the global shapes: the same error on every rank, before any message
        try:
            meta_out = meta_call(
                torch_op,
                input,
                meta_like(weight),
                meta_like(bias),
                stride,
                padding,
                *rest,
                **kwargs,
            )
        except RuntimeError as e:
            raise RuntimeError(
                f"{name}: input of global shape {list(input.shape)}, weight "
                f"{list(weight.shape)}: {e}"
            ) from None
        input = cut_once(name, input)  # a spatial dim cut by two mesh dims: by one
        mesh, layout = input.device_mesh, input.sharding
        k = tuple(weight.shape[2:])
        s, d = _tuple("stride", stride, n), _tuple("dilation", dilation, n)
        pads = (
            [(p, p) for p in _tuple("padding", padding, n)]
            if transposed
            else _paddings(padding, k, s, d, n, name)
        )
        out_pad = _tuple("output_padding", output_padding, n) if transposed else (0,) * n
        for m, p in enumerate(layout.placements):
            if isinstance(p, Partial) or (isinstance(p, Shard) and p.dim == 1):
                raise NotImplementedError(
                    f"{name}: input {placement_str(p)} on mesh dim {m} is not supported (shard "
                    "the batch or "
                    f"spatial dims); redistribute it to Replicate() first"
                )
        x = input.to_local()  # (N, C, *local spatial)
        # a leaf input (the image) stays alive anyway: let the conv keep (block, halos) and
        # rebuild its window in backward; a computed input is freed after this layer, so
        # the conv keeps the window itself (rebuilding would add a block at the peak)
        recipe = WindowRecipe(x if (input.is_leaf or not input.requires_grad) else None)
        w, b = summed_grads([weight, bias], input, f"{name}.params")
        local_pad, local_out_pad, crops, out_sizes = [], [], {}, {}
        # cut across ranks; a mesh dim of one rank holds the whole dim (no halo)
        cuts = [m for i in range(n) for m in layout.cut_by(2 + i)]
        sharded = [i for i in range(n) if layout.cut_by(2 + i)]
        overlap = (
            _OVERLAP.get()
            and not transposed
            and len(sharded) == 1
            and all(pads[i][0] == pads[i][1] for i in range(n) if i not in sharded)
        )
        for i in range(n):
            dim = 2 + i
            mesh_dims = [
                m for m, p in enumerate(layout.placements) if isinstance(p, Shard) and p.dim == dim
            ]
            for m in mesh_dims:
                if m not in cuts:  # one rank: the whole output length
                    out_sizes[m] = [meta_out.shape[dim]]
            mesh_dims = [m for m in mesh_dims if m in cuts]
            if not mesh_dims:
                local_pad.append(pads[i])
                local_out_pad.append(out_pad[i])
                continue
            m = mesh_dims[0]
            plan = conv_plan(
                layout.sizes_along(dim),
                k[i],
                s[i],
                d[i],
                pads[i],
                transposed=transposed,
                output_padding=out_pad[i],
            )
            peers, me = peers_along(mesh, m)
            offset = layout.local_offset(tuple(mesh.get_coordinate()))[dim]
            geometry = overlap and interior(plan, me, offset, k[i], s[i], d[i])
            if geometry:  # the exchange overlaps the interior (below)
                overlap = (dim, plan, peers, me, offset, geometry, k[i], s[i], d[i])
            else:
                overlap = False
                x = Halo.apply(x, plan, dim, peers, me, offset, 0.0, f"{name}.halo", recipe.stages)
            local_pad.append((0, 0))
            local_out_pad.append(0)
            crops[dim] = plan.crop(me)
            out_sizes[m] = list(plan.out_sizes)
        if overlap:
            conv_args = (s, [lp[0] for lp in local_pad], d, groups)
            rebuild = recipe.block is not None  # the image stays alive: no window copy kept
            y = OverlappedConv.apply(x, w, b, overlap, conv_args, f"{name}.halo", rebuild)
        elif any(x.shape[dim] == 0 for dim in crops) or any(
            sizes_m[me_m] == 0 for sizes_m, me_m in _mine(out_sizes, mesh)
        ):  # this rank owns no output: torch refuses an empty window, so build the
            # empty result directly, still tied to x, w, b for the backward exchanges
            y = _empty_output(
                input,
                weight,
                x,
                w,
                b,
                s,
                pads,
                d,
                k,
                out_pad,
                out_sizes,
                layout,
                mesh,
                transposed,
                groups,
            )
        elif transposed:
            sym = [lp[0] for lp in local_pad]
            with recipe.hooks(x):
                y = torch_op(x, w, b, s, sym, local_out_pad, groups, d)
            for dim, (a, bnd) in crops.items():
                y = y.narrow(dim, a, bnd - a)
        else:
            if any(lp[0] != lp[1] for lp in local_pad):
                flat = [v for lp in reversed(local_pad) for v in lp]
                x = torch.nn.functional.pad(x, flat)  # a new tensor: saved as it is
                local_pad = [(0, 0)] * n
                recipe.stages.clear()
            with recipe.hooks(x):
                y = torch_op(x, w, b, s, [lp[0] for lp in local_pad], d, groups)
        sizes = []
        for m, p in enumerate(layout.placements):
            if isinstance(p, Shard) and p.dim == 0:
                sizes.append(list(layout.sizes_along(0)))
            else:
                sizes.append(out_sizes.get(m))
        shape = _global_out_shape(input.shape, y, layout, out_sizes)
        return ShardTensor.from_local(
            y, mesh, layout.placements, sizes, shape=shape, validate=False
        )

    handler.__name__ = name
    return handler


def _mine(out_sizes, mesh):
    coord = tuple(mesh.get_coordinate())
    return [(sizes, coord[m]) for m, sizes in out_sizes.items()]


def _empty_output(
    input, weight, x, w, b, s, pads, d, k, out_pad, out_sizes, layout, mesh, transposed, groups
):
    from shardlab.layout import conv_out_length

    coord = tuple(mesh.get_coordinate())
    shape = [x.shape[0], weight.shape[1] * groups if transposed else weight.shape[0]]
    for i in range(len(k)):
        dim = 2 + i
        m = next(
            (m for m, p in enumerate(layout.placements) if isinstance(p, Shard) and p.dim == dim),
            None,
        )
        if m is not None:
            shape.append(out_sizes[m][coord[m]])
        else:
            shape.append(
                conv_out_length(
                    input.shape[dim],
                    k[i],
                    s[i],
                    d[i],
                    *pads[i],
                    transposed=transposed,
                    output_padding=out_pad[i],
                )
            )
    tie = x.sum() * 0 + w.sum() * 0 + (b.sum() * 0 if b is not None else 0)
    return x.new_zeros(shape) + tie


def _global_out_shape(in_shape, y, layout, out_sizes):
    """Global output shape: local dims, the batch and the summed sharded spatial sizes."""
    shape = list(y.shape)
    shape[0] = in_shape[0]
    for m, p in enumerate(layout.placements):
        if isinstance(p, Shard) and p.dim >= 2:
            shape[p.dim] = sum(out_sizes[m])
    return shape


# every door: the patched F.conv2d, and (at __torch_function__) torch.conv2d, which is the
# same function, or an F.conv2d a library bound before shardlab.patched()
for _n in (1, 2, 3):
    register(f"conv{_n}d", at_function=True)(_conv(f"conv{_n}d", _n, transposed=False))
    register(f"conv_transpose{_n}d", at_function=True)(
        _conv(f"conv_transpose{_n}d", _n, transposed=True)
    )
