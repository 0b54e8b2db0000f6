"""Views of ShardTensors (``shardlab/engine/aten/views.py``): what moves, and aliasing.

* merges, splits on piece boundaries, permutes, squeezes, flatten/unflatten, slices:
  no message at all, whatever the sizes;
* views no layout describes move first, exactly the rows that change owner, labelled
  ``auto-redistribute for <op>``;
* a write into a view changes its base, also when the view had to be a copy.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from shardlab import distribute, this_rank

VIEWS = [
    ("flatten(1)", lambda x: x.flatten(1)),  # (B, S*C): block, sizes x C
    ("flatten(0, 1)", lambda x: x.flatten(0, 1)),  # (B*S, C): strided
    ("transpose+flatten", lambda x: x.transpose(1, 2).flatten(1)),  # strided
    ("unflatten C", lambda x: x.unflatten(2, (2, 3))),
    ("permute", lambda x: x.permute(2, 0, 1)),
    ("unsqueeze/squeeze", lambda x: x.unsqueeze(1).unsqueeze(-1).squeeze(-1)),
    ("slice", lambda x: x[:, 1:6:2]),
    ("split", lambda x: x.split(3, dim=1)[1]),
    ("chain back", lambda x: x.flatten(0, 1).view(2, 7, 6).flatten(1).view(2, 7, 6)),
    ("expand", lambda x: x[:, :, :1].expand(2, 7, 4)),
    ("reshape of a view", lambda x: x.transpose(0, 1).reshape(7, 12)),
]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_views_move_nothing_and_equal_torch(ranks_for, world):
    def body():
        import shardlab

        mesh = this_rank().mesh
        g = torch.randn(2, 7, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
        sizes = {2: [5, 2], 3: [4, 0, 3], 4: [1, 3, 0, 3]}[world]
        out = {}
        for name, fn in VIEWS:
            x = g.clone().requires_grad_()
            st = distribute(x, mesh, [Shard(1)], sizes)
            with shardlab.trace() as t:
                y = fn(st)
            same = torch.equal(y.full_tensor(), fn(g))
            (y.full_tensor() * 2).sum().backward()
            ref = g.clone().requires_grad_()
            (fn(ref) * 2).sum().backward()
            out[name] = (same, torch.equal(x.grad, ref.grad), t.counts())
        return out

    for res in ranks_for(world).run(body):
        for name, (same, grad, counts) in res.items():
            assert same and grad and counts == {}, (name, counts)


@pytest.mark.parametrize("world", [1, 2])
def test_views_inside_inference_mode(ranks_for, world):
    """Inside ``torch.inference_mode()``, a view of a ShardTensor made outside it is a
    normal tensor, as torch's view of a normal tensor (DTensor raises "Cannot set
    version_counter for inference tensor" there: GPT-2, BERT and OPT reshape their ids);
    other ops give inference tensors, as torch; the values equal torch's."""

    def body():
        mesh = this_rank().mesh
        g = torch.randn(2, 7, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        sizes = [7] if world == 1 else [5, 2]
        ops = [*VIEWS, ("detach", lambda x: x.detach()), ("unbind", lambda x: x.unbind(0)[1]),
               ("t of a slice", lambda x: x[1].t()), ("add", lambda x: x + 1),
               ("sum", lambda x: x.sum(1))]  # fmt: skip
        bad = []
        for name, fn in ops:
            for inside in (False, True):  # made outside, or inside the mode
                with torch.inference_mode(inside):
                    st = distribute(g, mesh, [Shard(1)], sizes)
                    ref = g.clone()
                with torch.inference_mode():
                    y, want = fn(st), fn(ref)
                    full = y.full_tensor()
                if not torch.allclose(full, want) or y.is_inference() != want.is_inference():
                    bad.append((name, inside))
        return bad

    assert ranks_for(world).run(body) == [[]] * world


def test_blocked_views_move_exactly_the_rows_that_change_owner(ranks_for):
    """(12, 2) cut [5, 7] viewed as (3, 4, 2): pieces must be multiples of 4; the
    cheapest fix moves row 4 to rank 1 (one row of 2 float64 = 16 bytes), no more.
    A size-1 dim held by one rank that must vanish moves nothing: the cut moves to another
    dim, all of it at that rank (it was sent by its owner to the other: 3 floats)."""

    def body():
        import shardlab

        mesh = this_rank().mesh
        g = torch.arange(24.0, dtype=torch.float64).view(12, 2)
        st = distribute(g, mesh, [Shard(0)], [5, 7])
        with shardlab.trace() as t:
            y = st.view(3, 4, 2)
        row = distribute(torch.ones(1, 3), mesh, [Shard(0)], [0, 1])  # (1, 3) on rank 1
        with shardlab.trace() as t2:
            z = row.squeeze(0)
        return (
            torch.equal(y.full_tensor(), g.view(3, 4, 2)),
            y.sharding.sizes_along(0),
            sorted((e.kind, e.bytes, e.label) for e in t.events),
            (z.sharding.placements, z.sharding.sizes_along(0)) == ((Shard(0),), (0, 3)),
            sorted((e.kind, e.bytes) for e in t2.events),
        )

    r0, r1 = ranks_for(2).run(body)
    assert r0[0] and r0[1] == (1, 2) and r0[3]
    assert r0[2] == [("send", 16, "auto-redistribute for view")]
    assert r1[2] == [("recv", 16, "auto-redistribute for view")]
    assert r0[4] == [] and r1[4] == []  # (the row told where it lies: rank 1 holds all 3)


def test_writes_through_views_reach_the_base(ranks_for):
    """On one device ``x[:, 0] = v`` and ``x.diagonal().mul_(2)`` change ``x``; they must on
    a mesh too, also where the view had to be a copy (a row of a cut dim, a view that
    moved, an op computed on the whole tensor)."""

    def body():
        mesh = this_rank().mesh
        g = torch.randn(5, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        out = []
        for name, write in (
            ("select of a cut dim", lambda x: x.__setitem__((slice(None), 2), 7.0)),
            ("row of a cut dim", lambda x: x[3].mul_(-1)),
            ("diagonal", lambda x: x.diagonal().mul_(2)),
            ("blocked view", lambda x: x.view(10, 3)[4:6].zero_()),
            ("slice", lambda x: x[1:4, ::2].add_(1)),
            ("flat view, not linear", lambda x: x.view(-1).add_(1).exp_()),
        ):
            ref = g.clone()
            write(ref)
            for place in (Shard(0), Shard(1), Partial()):
                # a Partial base: an op not linear in it reduces the view's values, and
                # the base (sharing the block) must not sum them again
                sizes = None if not isinstance(place, Shard) else [[2, 0, 3], [1, 4, 1]][place.dim]
                st = distribute(g.clone(), mesh, [place], sizes)
                write(st)
                out.append((name, str(place), torch.allclose(st.full_tensor(), ref, atol=1e-12)))
        return out

    for res in ranks_for(3).run(body):
        assert all(ok for _, _, ok in res), [r for r in res if not r[2]]


def test_view_copy_and_slice_copy_are_copies(ranks_for):
    """``view_copy`` (like ``slice_copy``) returns a new tensor: writing into it leaves the
    input as it was (its local blocks could be viewed, so a reshape would alias them)."""

    def body():
        from torch.distributed.tensor import Shard

        from shardlab import distribute, this_rank

        mesh = this_rank().mesh
        g = torch.arange(12.0).reshape(3, 4)
        st = distribute(g, mesh, [Shard(0)], [[2, 1]])
        y = torch.ops.aten.view_copy.default(st, [12])
        z = torch.ops.aten.slice_copy.Tensor(st, 1, 1, 3)
        y.mul_(0)
        z.mul_(0)
        return torch.equal(st.full_tensor(), g), torch.equal(y.full_tensor(), torch.zeros(12))

    for ok in ranks_for(2).run(body):
        assert all(ok), ok


def test_writes_by_foreach_and_out_reach_the_base_of_a_copied_view(ranks_for):
    """A view of a cut tensor that is a copy (``diagonal``, ``as_strided``) passes what is
    written into it back to its base: also when a foreach op writes it inside a list
    (``torch._foreach_add_``) or an op writes it as ``out=``; the writes were lost."""

    def body():
        from torch.distributed.tensor import Shard

        from shardlab import distribute, this_rank

        mesh = this_rank().mesh
        g = torch.arange(42.0).reshape(6, 7)
        views = {
            "diagonal": lambda t: t.diagonal(),
            "as_strided": lambda t: t.as_strided((3, 7), (14, 1)),
        }
        ok = []
        for name, view in views.items():
            for d, sizes in ((0, [4, 2]), (1, [4, 3])):
                x, want = distribute(g.clone(), mesh, [Shard(d)], [sizes]), g.clone()
                v, w = view(x), view(want)
                torch._foreach_add_([v], [torch.ones(w.shape)])
                torch._foreach_add_([w], [torch.ones(w.shape)])
                first = torch.equal(x.full_tensor(), want)
                torch.mul(v, 2, out=v)
                torch.mul(w, 2, out=w)
                ok.append((name, d, first, torch.equal(x.full_tensor(), want)))
        return ok

    for res in ranks_for(2).run(body):
        assert all(a and b for _, _, a, b in res), res


@pytest.mark.parametrize("world", [2, 3])
def test_the_gradient_of_a_select_comes_back_whole_and_moves_nothing(ranks_for, world):
    """``x[:, 0]`` of a whole dim sends nothing, and neither does its backward: the gradient
    is zeros with the row put back, whole along the new dim like the input. Cut into
    chunks (as before: a dim of 1 became sizes [1, 0]), the view of a linear's output
    ``(B, 1, D)`` back to ``(B, D)`` (SigLIP's pooling head) moved it in the backward."""

    def body():
        import shardlab

        mesh = this_rank().mesh
        g = torch.randn(3, 5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
        cases = {
            "head": (lambda x: x[:, 0].reshape(3, 1, 4)[:, 0] * 2, [Replicate()], None),
            "cls token": (lambda x: x[:, 0] * 2, [Replicate()], None),
            "batch cut": (lambda x: x[:, -1] * 2, [Shard(0)], {2: [2, 1], 3: [2, 0, 1]}[world]),
        }
        out = {}
        for name, (fn, places, sizes) in cases.items():
            x = distribute(g, mesh, places, sizes).detach().requires_grad_()
            y = fn(x)
            with shardlab.trace() as t:
                y.backward(torch.ones_like(y))  # a gradient in y's layout
            ref = g.clone().requires_grad_()
            fn(ref).sum().backward()
            out[name] = (
                torch.equal(y.full_tensor(), fn(g)),
                torch.equal(x.grad.full_tensor(), ref.grad),
                x.grad.sharding.placements == x.sharding.placements,
                t.counts(),
            )
        return out

    for res in ranks_for(world).run(body):
        for name, (same, grad, layout, counts) in res.items():
            assert same and grad and layout and counts == {}, (name, layout, counts)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_a_row_of_a_cut_dim_stays_with_its_owner(ranks_for, world):
    """``x[:, 0]`` (a ViT's class token), ``x[:, -1]`` and ``x[:, :1].reshape(B, D)`` of
    tokens cut along the sequence: the row stays where it lies, its cut moved to the
    batch dim with all of it at its owner (``Shard(0)`` sizes ``[B, 0, ..]``), no
    message forward or backward; equal to torch, gradient too. On a (2, 2) mesh too, the
    sequence cut by one mesh dim and the features by the other."""

    def body():
        import shardlab

        g = torch.randn(3, 9, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
        calls = {
            "x[:, 0]": lambda x: x[:, 0],
            "x[:, -1]": lambda x: x[:, -1],
            "x[:, :1].reshape": lambda x: x[:, :1].reshape(3, 4),
        }
        meshes = [
            (this_rank().mesh, [Shard(1)], [{2: [5, 4], 3: [4, 0, 5], 4: [0, 3, 2, 4]}[world]])
        ]
        if world == 4:
            meshes.append((this_rank().mesh_for((2, 2)), [Shard(1), Shard(2)], [[2, 7], [3, 1]]))
        out = []
        for mesh, places, sizes in meshes:
            for name, fn in calls.items():
                x = distribute(g, mesh, places, sizes).requires_grad_()
                with shardlab.gathers("raise"), shardlab.trace() as t:
                    y = fn(x)
                    (y * 2).sum().backward()
                ref = g.clone().requires_grad_()
                (fn(ref) * 2).sum().backward()
                row = y.sharding.placements[0], y.sharding.sizes_along(0)
                same = torch.equal(y.full_tensor(), fn(g))
                grad = torch.equal(x.grad.full_tensor(), ref.grad)
                held = [q for q, n in enumerate(sizes[0]) if n]  # (who holds the row)
                owner = held[-1] if name == "x[:, -1]" else held[0]
                out.append((name, mesh.ndim, same, grad, row, owner, t.counts()))
        return out

    for res in ranks_for(world).run(body):
        for name, ndim, same, grad, (place, sizes), owner, counts in res:
            assert same and grad and counts == {}, (name, ndim, counts)
            assert place == Shard(0) and sizes[owner] == 3 and sum(sizes) == 3, (name, sizes)
