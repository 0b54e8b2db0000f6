"""Every door to a window family reaches the family's entry (``shardlab/ops/doors.py``):
torch's builtins and the F functions F dispatches to send the same messages as
``F.<name>`` (the halo rows, no whole-tensor gather) and compute torch's values and
gradients (float64); an unbatched convolution cut along its channels is a Partial sum;
``F.local_response_norm`` exchanges channels only when they are cut."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Shard

SIZES = {2: [8, 0, 3], 3: [5, 0, 2, 4], 4: [3, 4, 0, 2, 2]}  # (the last: the rest)


def _sizes(length, world):
    """Uneven shard sizes of ``length`` rows on ``world`` ranks, an empty one among them."""
    out, left = [], length
    for h in SIZES[world][: world - 1]:
        out.append(min(h, left))
        left -= out[-1]
    return [*out, left]


def _doors():
    """(door, F function it must equal, its F-level arguments, input shape, cut dim)."""
    nn = torch._C._nn
    w2, w1 = torch.randn(4, 3, 3, 3, dtype=torch.float64), torch.randn(4, 3, 3, dtype=torch.float64)
    return {
        "torch.convolution": (
            lambda t: torch.convolution(t, w2, None, [2, 1], [1, 1], [1, 1], False, [0, 0], 1),
            lambda t: F.conv2d(t, w2, None, [2, 1], [1, 1]), (2, 3, 15, 6), 2),
        "torch._convolution transposed": (
            lambda t: torch._convolution(t, w2, None, [2, 2], [1, 1], [1, 1],
                                         True, [1, 0], 1, False, False, True, True),
            lambda t: F.conv_transpose2d(t, w2, None, 2, 1, (1, 0)),
            (2, 4, 6, 15), 3),
        "torch.max_pool2d": (
            lambda t: torch.max_pool2d(t, 3, 2, 1), lambda t: F.max_pool2d(t, 3, 2, 1),
            (2, 3, 15, 5), 2),
        "F.max_pool1d(return_indices)": (
            lambda t: F.max_pool1d(t, 3, 2, 1, return_indices=True)[0],
            lambda t: F.max_pool1d(t, 3, 2, 1), (2, 3, 15), 2),
        "_C._nn.max_pool3d_with_indices": (
            lambda t: nn.max_pool3d_with_indices(t, 2, 2, 0, 1, True)[0],
            lambda t: F.max_pool3d(t, 2, 2, 0, 1, True), (1, 2, 4, 15, 3), 3),
        "torch.adaptive_max_pool1d": (
            lambda t: torch.adaptive_max_pool1d(t, 4)[0],
            lambda t: F.adaptive_max_pool1d(t, 4), (2, 3, 15), 2),
        "_C._nn.adaptive_avg_pool2d": (
            lambda t: nn.adaptive_avg_pool2d(t, (5, 3)),
            lambda t: F.adaptive_avg_pool2d(t, (5, 3)), (2, 3, 15, 6), 2),
        "_C._nn.upsample_bilinear2d": (
            lambda t: nn.upsample_bilinear2d(t, None, False, [2.0, 1.5]),
            lambda t: F.interpolate(t, scale_factor=(2.0, 1.5), mode="bilinear"),
            (2, 3, 4, 15), 3),
        "_C._nn._upsample_bicubic2d_aa": (
            lambda t: nn._upsample_bicubic2d_aa(t, [6, 4], False, None),
            lambda t: F.interpolate(t, (6, 4), mode="bicubic", antialias=True),
            (1, 2, 15, 5), 2),
        "_C._nn.im2col": (
            lambda t: nn.im2col(t, [3, 2], [1, 1], [1, 0], [1, 1]),
            lambda t: F.unfold(t, (3, 2), 1, (1, 0), 1), (2, 3, 15, 4), 2),
        "torch.group_norm": (
            lambda t: torch.group_norm(t, 3, None, None, 1e-5, True),
            lambda t: F.group_norm(t, 3), (2, 6, 15), 2),
        "torch.conv1d unbound": (  # an F function bound at import: F.conv1d is it
            lambda t: torch.conv1d(t, w1, None, 1, 1), lambda t: F.conv1d(t, w1, None, 1, 1),
            (2, 3, 15), 2),
    }  # fmt: skip


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.more_worlds), 4])
def test_every_door_sends_what_the_f_entry_sends(ranks_for, world):
    """Each door (unpatched) against the same call through the patched ``F.<name>``: the
    same messages (op, label, bytes, peer), halo rows or statistics only, no gather
    (``gathers("raise")``); values and input gradients as torch's on one device."""

    def body():
        import shardlab

        mesh, out = shardlab.this_rank().mesh, {}
        torch.manual_seed(0)
        for name, (door, f, shape, dim) in _doors().items():
            g = torch.randn(shape, dtype=torch.float64)
            ref = g.clone().requires_grad_(True)
            want = door(ref)
            gy = torch.randn(want.shape, dtype=torch.float64)
            want.backward(gy)
            runs = []
            for call, patched in ((door, False), (f, True)):
                x = shardlab.distribute(g, mesh, [Shard(dim)], [_sizes(shape[dim], world)])
                x.requires_grad_(True)
                with shardlab.gathers("raise"), shardlab.trace() as t:
                    if patched:
                        with shardlab.patched():
                            y = call(x)
                    else:
                        y = call(x)
                    (y.full_tensor() * gy).sum().backward()
                ok = torch.allclose(y.full_tensor(), want, rtol=1e-12, atol=1e-12)
                ok = ok and torch.allclose(x.grad.full_tensor(), ref.grad, rtol=1e-12, atol=1e-12)
                msgs = [(e.op, e.label, e.bytes, e.peer) for e in t.events]
                runs.append((ok, msgs))
            (ok, msgs), (f_ok, f_msgs) = runs
            labels = {m[1].rsplit(" ", 1)[0] for m in msgs}
            out[name] = (ok and f_ok, msgs == f_msgs, sorted(labels))
        return out

    for out in ranks_for(world).run(body):
        for name, (ok, same, labels) in out.items():
            assert ok and same, (name, ok, same, labels)
            # the halo rows (or group_norm's statistics), and full_tensor's gathers of the
            # result and of the input's gradient, read here ("redistribute"): nothing else
            assert all(lab.endswith((".halo", ".stats")) or lab == "redistribute"
                       for lab in labels), (name, labels)  # fmt: skip


@pytest.mark.parametrize("world", [2, 3])
def test_unbatched_conv_cut_along_channels_is_a_partial_sum(ranks_for, world):
    """``torch.conv2d`` / ``conv_transpose1d`` of a (C, *spatial) input cut along C (an empty
    shard included): a Partial result, no message forward; the input, weight and bias
    gradients as one device's, the parameters' summed by one all-reduce."""

    def body():
        import shardlab

        mesh, out = shardlab.this_rank().mesh, []
        torch.manual_seed(1)
        for op, shape, wshape, kw in (
            (torch.conv2d, (5, 7, 6), (2, 5, 3, 3), {"stride": 2, "padding": 2}),
            (torch.conv_transpose1d, (5, 6), (5, 3, 3), {"stride": 2, "output_padding": 1}),
        ):
            g = torch.randn(shape, dtype=torch.float64)
            w0 = torch.randn(wshape, dtype=torch.float64)
            b0 = torch.randn(wshape[1] if op is torch.conv_transpose1d else wshape[0],
                             dtype=torch.float64)  # fmt: skip
            ref = [t.clone().requires_grad_(True) for t in (g, w0, b0)]
            want = op(*ref, **kw)
            gy = torch.randn(want.shape, dtype=torch.float64)
            want.backward(gy)
            x = shardlab.distribute(g, mesh, [Shard(0)], [_sizes(5, world)]).requires_grad_(True)
            w, b = w0.clone().requires_grad_(True), b0.clone().requires_grad_(True)
            with shardlab.gathers("raise"), shardlab.trace() as fwd:
                y = op(x, w, b, **kw)
            with shardlab.trace() as bwd:
                (y.full_tensor() * gy).sum().backward()
            grads = [x.grad.full_tensor(), w.grad, b.grad]
            out.append((
                str(y.placements), fwd.events == [],
                torch.allclose(y.full_tensor(), want, rtol=1e-12, atol=1e-12),
                all(torch.allclose(a, r.grad, rtol=1e-12, atol=1e-12) for a, r in zip(grads, ref)),
                [(e.op, e.bytes) for e in bwd.events if "params" in e.label],
            ))  # fmt: skip
        return out

    for out in ranks_for(world).run(body):
        for (placements, silent, ok, grads_ok, params), nw, nb in zip(out, (90, 45), (2, 3)):
            assert placements == "(Partial(sum),)" and silent and ok and grads_ok, out
            assert params == [("c10d.allreduce", (nw + nb) * 8)], params


@pytest.mark.parametrize("world", [2, 4])
def test_local_response_norm_exchanges_only_cut_channels(ranks_for, world):
    """``F.local_response_norm`` (unpatched): batch or spatial cuts send nothing; a channel
    cut sends exactly size//2 channels forward and (size-1)//2 back to each neighbour
    holding channels (multi-hop past empty shards), and the same reversed in backward."""

    def body():
        import shardlab

        mesh, out = shardlab.this_rank().mesh, []
        torch.manual_seed(2)
        for shape, dim, size in (((2, 9, 5, 4), 1, 3), ((2, 9, 7), 1, 4), ((2, 9, 5, 3, 2), 1, 5),
                                 ((3, 9, 5), 0, 3), ((2, 9, 9, 4), 2, 2)):  # fmt: skip
            g = torch.randn(shape, dtype=torch.float64)
            ref = g.clone().requires_grad_(True)

            def call(t, size=size):
                return F.local_response_norm(t, size, alpha=0.3, beta=0.7, k=1.5)

            want = call(ref)
            gy = torch.randn(want.shape, dtype=torch.float64)
            want.backward(gy)
            sizes = _sizes(shape[dim], world)
            x = shardlab.distribute(g, mesh, [Shard(dim)], [sizes]).requires_grad_(True)
            with shardlab.gathers("raise"), shardlab.trace() as t:
                y = call(x)
                y.backward(shardlab.distribute(gy, mesh, [Shard(dim)], [sizes]))
            recv = {ph: sum(e.bytes for e in t.events if "recv" in e.op and e.label.endswith(ph))
                    for ph in ("forward", "backward")}  # fmt: skip
            ok = torch.allclose(y.full_tensor(), want, rtol=1e-12, atol=1e-12)
            ok = ok and torch.allclose(x.grad.full_tensor(), ref.grad, rtol=1e-12, atol=1e-12)
            out.append((ok, y.placements == (Shard(dim),), recv, shape, dim, size, sizes))
        return out

    for rank, out in enumerate(ranks_for(world).run(body)):
        for ok, placed, recv, shape, dim, size, sizes in out:
            assert ok and placed, (shape, dim, size)
            plane = 8 * shape[0] * (shape[2] if len(shape) == 3 else shape[2] * shape[3]) * (
                shape[4] if len(shape) == 5 else 1)  # fmt: skip
            want = {"forward": 0, "backward": 0}
            if dim == 1:  # rows q's window reads that r owns (the halo, not r's own rows)
                starts = [sum(sizes[:q]) for q in range(len(sizes) + 1)]

                def read(q, r, sizes=sizes, starts=starts, size=size):
                    if q == r or not sizes[q]:
                        return 0
                    lo, hi = starts[q] - size // 2, starts[q + 1] + (size - 1) // 2
                    return max(0, min(hi, starts[r + 1]) - max(lo, starts[r]))

                others = [q for q in range(len(sizes)) if q != rank]
                want["forward"] = sum(read(rank, q) for q in others) * plane
                want["backward"] = sum(read(q, rank) for q in others) * plane
            assert recv == want, (rank, shape, dim, size, sizes, recv, want)
