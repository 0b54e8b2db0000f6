"""Domain-parallel pooling: ``F.{max,avg}_pool{1,2,3}d`` and ``F.adaptive_{avg,max}_pool{1,2,3}d``.

Who owns what (one sharded spatial dim, max_pool k=3 stride 2 ceil_mode, sizes [4, 1, 0, 4])::

    input    [ r0: 0 1 2 3 | r1: 4 | r2: - | r3: 5 6 7 8 ]       padded end = 9
    outputs  o0=[0,3) o1=[2,5) o2=[4,7) o3=[6,9) o4=[8,9)+OVERHANG
    owner    output o -> owner of its window's first row (anchor): r0 o0 o1, r1 o2, r3 o3 o4
    rank 1 window = rows 4 5 6: receives 5 6 from r3 (multi-hop is fine; r2 owns nothing)

Sliding windows (``max_pool``/``avg_pool``), per rank::

    1. for each sharded spatial dim: halo exchange of exactly the rows the local windows
       read (:func:`shardlab.layout.conv_plan` with ``ceil_mode``, point to point); pad
       and OVERHANG positions hold -inf (max) or 0 (avg)     -> window (N, C, *W_local)
    2. the plain torch op on the window: padding 0 and the rank's exact output count on
       sharded dims (the user's padding / ceil_mode on the others)
    3. avg: the local op divided each window by k along a sharded dim; torch divides by
       the count of (non-OVERHANG / in-input) positions: multiply by k / count(o)
       max + return_indices: window positions -> global flat spatial indices (as torch)

Adaptive pools to one element per spatial dim (global pooling): a local mean / max and a
``Partial`` result, summed by one all-reduce when it is read. Otherwise output i along
a dim of length L reads rows [floor(iL/O), ceil((i+1)L/O)).
Its anchor is the first row. Step 1 fetches the needed rows with a :class:`RowPlan`;
step 2 reduces each spatial dim separately, innermost first (max: torch's row-major
first maximum; avg: the mean of means of equal-length rows = the box mean).

Messages: forward only point-to-point halo rows (labels ``max_pool2d.halo`` ...);
backward the same messages reversed (the rows' gradients go back to their owners).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shardlab.comm.halo import Halo, peers_along
from shardlab.layout import conv_plan
from shardlab.ops._cnn_common import (
    RowPlan,
    check_input,
    empty_like_output,
    meta_call,
    my_offset,
    owners,
    rewrap,
    spatial_mesh_dims,
)
from shardlab.ops.conv import _tuple
from shardlab.ops.registry import register


def _halos(input, name, n, k, s, d, pads, ceil_mode, fill):
    """Step 1: ``(window, {dim: (plan, me, mesh_dim)})``; spatial dims are the last n."""
    x, mesh, layout = input.to_local(), input.device_mesh, input.sharding
    plans, first = {}, input.ndim - n
    for dim, m in sorted(spatial_mesh_dims(layout, first).items()):
        i = dim - first
        plan = conv_plan(
            layout.sizes_along(dim), k[i], s[i], d[i], (pads[i], pads[i]), ceil_mode=ceil_mode
        )
        peers, me = peers_along(mesh, m)
        x = Halo.apply(x, plan, dim, peers, me, my_offset(input, dim), fill, f"{name}.halo")
        plans[dim] = (plan, me, m)
    return x, plans


def _local_shape(x, plans, shape, first):
    return list(x.shape[:first]) + [
        plans[dm][0].out_sizes[plans[dm][1]] if dm in plans else shape[dm]
        for dm in range(first, len(shape))
    ]


def _args(n, kernel_size, stride, padding, dilation=1):
    k = _tuple("kernel_size", kernel_size, n)
    empty = stride is None or (isinstance(stride, (list, tuple)) and len(stride) == 0)
    s = k if empty else _tuple("stride", stride, n)
    return k, s, _tuple("padding", padding, n), _tuple("dilation", dilation, n)


def _max_pool(name: str, n: int):
    op = getattr(F, name)

    def handler(
        input, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False,
        return_indices=False,
    ):  # fmt: skip
        input = check_input(name, input)
        ref = meta_call(
            op, input, kernel_size, stride, padding, dilation, ceil_mode=ceil_mode,
            return_indices=return_indices,
        )  # fmt: skip
        shape = tuple((ref[0] if return_indices else ref).shape)
        k, s, p, d = _args(n, kernel_size, stride, padding, dilation)
        first = input.ndim - n  # (N, C, *spatial) or unbatched (C, *spatial)
        x, plans = _halos(input, name, n, k, s, d, p, ceil_mode, float("-inf"))  # (N, C, *W)
        local_shape = _local_shape(x, plans, shape, first)
        if 0 in local_shape:  # no output here (or an empty batch / channel shard)
            y = empty_like_output(x, local_shape)
            idx = torch.zeros(local_shape, dtype=torch.long, device=y.device)
        else:
            pad = [0 if first + i in plans else p[i] for i in range(n)]
            y = op(x, k, s, pad, d, ceil_mode=ceil_mode, return_indices=return_indices)
            if return_indices:
                y, idx = y
                idx = _global_indices(idx, x.shape[first:], plans, input.shape[first:], first)
        sizes = {m: list(plan.out_sizes) for plan, _, m in plans.values()}
        out = rewrap(y, input, sizes, shape)
        return (out, rewrap(idx, input, sizes, shape)) if return_indices else out

    handler.__name__ = name
    return handler


def _global_indices(idx, window, plans, spatial, first):
    """Flat indices into the local window -> torch's flat indices into the global plane."""
    coords, rem = [], idx
    for w in reversed(window):  # unravel, innermost dim first
        coords.append(rem % w)
        rem = rem // w
    flat = torch.zeros_like(idx)
    for i, c in enumerate(reversed(coords)):
        if first + i in plans:  # window position -> global input row
            plan, me, _ = plans[first + i]
            c = torch.tensor(plan.index_map(me), dtype=torch.long, device=c.device)[c]
        flat = flat * spatial[i] + c
    return flat


def _avg_pool(name: str, n: int):
    op = getattr(F, name)

    def handler(
        input, kernel_size, stride=None, padding=0, ceil_mode=False, count_include_pad=True,
        divisor_override=None,
    ):  # fmt: skip
        input = check_input(name, input)
        extra = () if n == 1 else (divisor_override,)
        if n == 1 and divisor_override is not None:
            raise TypeError("avg_pool1d() got an unexpected argument 'divisor_override'")
        ref = meta_call(
            op, input, kernel_size, stride, padding, ceil_mode, count_include_pad, *extra
        )
        shape = tuple(ref.shape)
        k, s, p, d = _args(n, kernel_size, stride, padding)
        first = input.ndim - n
        x, plans = _halos(input, name, n, k, s, d, p, ceil_mode, 0.0)  # (N, C, *W)
        local_shape = _local_shape(x, plans, shape, first)
        if 0 in local_shape:
            y = empty_like_output(x, local_shape)
        else:
            pad = [0 if first + i in plans else p[i] for i in range(n)]
            y = op(x, k, s, pad, ceil_mode, count_include_pad, *extra)
            if divisor_override is None:
                for dim, (plan, me, _) in plans.items():  # step 3: torch's divisor
                    y = y * _divisor_fix(plan, me, dim, y, count_include_pad)
        sizes = {m: list(plan.out_sizes) for plan, _, m in plans.values()}
        return rewrap(y, input, sizes, shape)

    handler.__name__ = name
    return handler


def _divisor_fix(plan, me, dim, y, count_include_pad):
    """k / (torch's per-dim count) for this rank's outputs, shaped to broadcast on dim."""
    lo, hi = plan.out_range(me)
    k, st, (pl, pr), length = plan.kernel_size, plan.stride, plan.padding, sum(plan.in_sizes)
    fix = []
    for o in range(lo, hi):
        start = o * st - pl  # input index of the window's first position
        if count_include_pad:
            count = min(start + k, length + pr) - start
        else:
            count = min(start + k, length) - max(start, 0)
        fix.append(k / count)
    shape = [1] * y.ndim
    shape[dim] = hi - lo
    return torch.tensor(fix, dtype=y.dtype, device=y.device).view(shape)


def _adaptive(name: str, n: int, kind: str):
    op = getattr(F, name)

    def handler(input, output_size, return_indices=False):
        input = check_input(name, input)
        extra = (return_indices,) if kind == "max" else ()
        if kind == "avg" and return_indices:
            raise TypeError(f"{name}() takes 2 positional arguments but 3 were given")
        ref = meta_call(op, input, output_size, *extra)
        shape = tuple((ref[0] if return_indices else ref).shape)
        mesh, layout = input.device_mesh, input.sharding
        lead = input.ndim - n  # (N, C, *spatial) or unbatched (C, *spatial)
        spatial = list(range(lead, input.ndim))
        if all(shape[d] == 1 for d in spatial) and not return_indices:
            # global pooling (a classifier head): each rank reduces its rows, the result is a
            # Partial sum / max, summed by one all-reduce when read (no row moves)
            return (
                input.mean(spatial, keepdim=True)
                if kind == "avg"
                else input.amax(spatial, keepdim=True)
            )
        x, fill = input.to_local(), float("-inf") if kind == "max" else 0.0
        first, sizes = {}, {}  # first global row of the window; new sizes per mesh dim
        # 1. halo: exactly the rows this rank's output windows read, point to point
        for dim, m in sorted(spatial_mesh_dims(layout, lead).items()):
            starts, ends = _adaptive_windows(input.shape[dim], shape[dim])
            in_sizes = layout.sizes_along(dim)
            own = owners(torch.tensor(starts), in_sizes).tolist()
            needed, out_sizes = [], []
            for r in range(len(in_sizes)):
                mine = [j for j, q in enumerate(own) if q == r]
                out_sizes.append(len(mine))
                needed.append(range(starts[mine[0]], ends[mine[-1]]) if mine else [])
            plan = RowPlan(in_sizes, needed, out_sizes)
            peers, me = peers_along(mesh, m)
            x = Halo.apply(x, plan, dim, peers, me, my_offset(input, dim), fill, f"{name}.halo")
            lo = sum(out_sizes[:me])
            first[dim] = (starts[lo] if out_sizes[me] else 0, lo, lo + out_sizes[me])
            sizes[m] = out_sizes
        gidx = _window_flat_index(x, input, first, lead) if return_indices else None
        # 2. reduce each spatial dim, innermost first (torch's row-major tie-breaking)
        for dim in reversed(range(lead, input.ndim)):
            starts, ends = _adaptive_windows(input.shape[dim], shape[dim])
            a, lo, hi = first.get(dim, (0, 0, shape[dim]))
            x, gidx = _reduce_dim(x, gidx, dim, starts[lo:hi], ends[lo:hi], a, kind, fill)
        out = rewrap(x, input, sizes, shape)
        return (out, rewrap(gidx, input, sizes, shape)) if return_indices else out

    handler.__name__ = name
    return handler


def _adaptive_windows(length: int, out: int):
    starts = [(i * length) // out for i in range(out)]
    ends = [-(-((i + 1) * length) // out) for i in range(out)]
    return starts, ends


def _window_flat_index(x, input, first, lead):
    """Global flat spatial index of every window element (N, C, *W) for return_indices."""
    flat = torch.zeros(x.shape[lead:], dtype=torch.long, device=x.device)
    for i, dim in enumerate(range(lead, input.ndim)):
        rows = torch.arange(x.shape[dim], device=x.device) + first.get(dim, (0,))[0]
        view = [1] * (input.ndim - lead)
        view[i] = -1
        flat = flat * input.shape[dim] + rows.view(view)
    return flat.expand(x.shape)


def _reduce_dim(x, gidx, dim, starts, ends, a, kind, fill):
    """Output j reads window rows [starts[j] - a, ends[j] - a) along dim."""
    lens = [e - b for b, e in zip(starts, ends)]
    kmax = max(lens, default=1)
    pad_row = x.shape[dim]  # index of the fill row appended below
    idx = torch.tensor(
        [[b - a + t if t < n else pad_row for t in range(kmax)] for b, n in zip(starts, lens)],
        dtype=torch.long,
        device=x.device,
    ).view(-1)
    fill_shape = list(x.shape)
    fill_shape[dim] = 1
    g = torch.cat([x, x.new_full(fill_shape, fill)], dim).index_select(dim, idx)
    g = g.unflatten(dim, (len(starts), kmax))  # (..., n_out, kmax, ...)
    if kind == "avg":
        shape = [1] * (g.ndim - 1)
        shape[dim] = len(starts)
        return g.sum(dim + 1) / torch.tensor(lens, dtype=x.dtype, device=x.device).view(shape), None
    values, arg = g.max(dim + 1)
    if gidx is not None:
        gi = torch.cat([gidx, gidx.new_zeros(fill_shape)], dim).index_select(dim, idx)
        gidx = gi.unflatten(dim, (len(starts), kmax)).gather(dim + 1, arg.unsqueeze(dim + 1))
        gidx = gidx.squeeze(dim + 1)
    return values, gidx


for _n in (1, 2, 3):  # also at __torch_function__ (an F function bound before patched())
    register(f"max_pool{_n}d", at_function=True)(_max_pool(f"max_pool{_n}d", _n))
    register(f"avg_pool{_n}d", at_function=True)(_avg_pool(f"avg_pool{_n}d", _n))
    register(f"adaptive_avg_pool{_n}d", at_function=True)(
        _adaptive(f"adaptive_avg_pool{_n}d", _n, "avg")
    )
    register(f"adaptive_max_pool{_n}d", at_function=True)(
        _adaptive(f"adaptive_max_pool{_n}d", _n, "max")
    )
