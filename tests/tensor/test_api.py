"""ShardTensor constructors and redistribute against single-device torch, fwd and bwd."""

import random

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Partial, Replicate, Shard

import shardlab
from shardlab import ShardTensor, distribute, scatter_tensor, this_rank
from shardlab.layout import ShardLayout, moved_elements, redistribute_plan
from tests.tensor._cases import block, placements_1d, random_sizes, sizes_for


def _mesh(shape):
    from shardlab import this_rank

    if len(shape) == 1:
        return this_rank().mesh
    return this_rank().mesh_for(shape)


def _partials(g, layout, seed):
    """Per-coordinate random parts that sum to g (the same on every rank)."""
    gen = torch.Generator().manual_seed(seed)
    coords = layout.coords()
    parts = {c: torch.randn(g.shape, generator=gen, dtype=g.dtype) for c in coords[1:]}
    parts[coords[0]] = g - sum(parts.values()) if parts else g.clone()
    return parts


def _src_local(g, layout, coord, seed):
    """This coordinate's local tensor for ``layout`` (Partial mesh dims: random parts)."""
    local = block(g, layout, coord)
    for m, p in enumerate(layout.placements):
        if isinstance(p, Partial):
            # parts along mesh dim m (other coordinates hold the same value)
            n = layout.mesh_shape[m]
            gen = torch.Generator().manual_seed(seed + m)
            noise = [torch.randn(local.shape, generator=gen, dtype=g.dtype) for _ in range(n)]
            total = sum(noise)
            local = local / n + noise[coord[m]] - total / n
    return local


def _sweep(mesh_shape, cases, seed):
    def body():
        mesh = _mesh(mesh_shape)
        coord = tuple(mesh.get_coordinate())
        rng = random.Random(seed)
        checked = 0
        for _ in range(cases):
            ndim = rng.randint(1, 3)
            shape = [rng.randint(0, 7) for _ in range(ndim)]
            shape[rng.randrange(ndim)] = rng.randint(0, 9)
            choices = placements_1d(ndim)
            src_p = tuple(rng.choice(choices) for _ in mesh_shape)
            dst_p = tuple(rng.choice(choices) for _ in mesh_shape)
            src = ShardLayout.build(
                shape, mesh_shape, src_p, sizes_for(rng, shape, mesh_shape, src_p)
            )
            dst_sizes = sizes_for(rng, shape, mesh_shape, dst_p)
            dst = ShardLayout.build(shape, mesh_shape, dst_p, dst_sizes)
            g = torch.randn(
                shape,
                generator=torch.Generator().manual_seed(rng.randrange(10**6)),
                dtype=torch.float64,
            )
            w = torch.randn(
                shape,
                dtype=torch.float64,
                generator=torch.Generator().manual_seed(rng.randrange(10**6)),
            )
            local = _src_local(g, src, coord, seed=checked).requires_grad_()
            explicit = rng.random() < 0.5
            if explicit:  # sizes given: checked locally, no communication
                st = ShardTensor.from_local(local, mesh, src_p, _user_sizes(src), shape=shape)
            else:  # sizes gathered from the local shapes
                st = ShardTensor.from_local(local, mesh, src_p, shape=shape)
            assert st.sharding == src, (st.sharding, src)
            assert tuple(st.shape) == tuple(shape)
            out = st.redistribute(mesh, dst_p, sizes=dst_sizes)
            assert out.sharding == dst
            want_local = block(g, dst, coord)
            if not any(isinstance(p, Partial) for p in dst_p):
                assert torch.allclose(out.to_local(), want_local), (src, dst)
            full = out.full_tensor()
            assert torch.allclose(full, g), (src, dst)
            (full * w).sum().backward()
            # d/d local: the weight's block (for a Partial part, the block of its value)
            assert torch.allclose(local.grad, block(w, src, coord)), (src, dst)
            checked += 1
        return checked

    return body


def _user_sizes(layout):
    """ShardLayout sizes back to the user form of ShardLayout.build."""
    out = []
    for entry in layout.sizes:
        if entry is None:
            out.append(None)
        elif len(entry) == 1:
            out.append(list(entry[0]))
        else:
            out.append([list(e) for e in entry])
    return out


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_from_local_redistribute_full_tensor_1d(ranks_for, world):
    assert ranks_for(world).run(_sweep((world,), 60, seed=world)) == [60] * world


@pytest.mark.parametrize("mesh_shape", [(2, 2), (1, 4), (4, 1), (1, 2), (1, 3), (3, 1)])
def test_from_local_redistribute_full_tensor_2d(ranks_for, mesh_shape):
    n = mesh_shape[0] * mesh_shape[1]
    assert ranks_for(n).run(_sweep(mesh_shape, 40, seed=7 + n)) == [40] * n


@pytest.mark.parametrize("world", [2, 3, 4])
def test_redistribute_moves_exactly_the_lower_bound(ranks_for, world):
    def body():
        mesh = this_rank().mesh
        rng = random.Random(world)
        results = []
        for src_p, dst_p in [
            (Shard(0), Replicate()),
            (Shard(0), Shard(1)),
            (Replicate(), Shard(1)),
            (Shard(1), Shard(1)),
        ]:
            shape = (rng.randint(3, 9), rng.randint(2, 7))
            src = ShardLayout.build(
                shape, (world,), [src_p], sizes_for(rng, shape, (world,), [src_p])
            )
            dst = ShardLayout.build(
                shape, (world,), [dst_p], sizes_for(rng, shape, (world,), [dst_p])
            )
            g = torch.randn(shape)
            st = ShardTensor.from_local(
                block(g, src, mesh.get_coordinate()), mesh, [src_p], _user_sizes(src), shape=shape
            )
            with shardlab.trace() as t:
                st.redistribute(mesh, [dst_p], sizes=_user_sizes(dst))
            plan = redistribute_plan(src, dst)
            me = tuple(mesh.get_coordinate())
            sent = sum(m.numel for m in plan if m.src == me and not m.local) * 4
            recv = sum(m.numel for m in plan if m.dst == me and not m.local and m.src != me) * 4
            results.append(
                (
                    t.bytes(kind="send"),
                    sent,
                    t.bytes(kind="recv"),
                    recv,
                    sorted(set(t.counts())),
                    moved_elements(plan),
                )
            )
        return results

    for rank_results in ranks_for(world).run(body):
        for got_sent, sent, got_recv, recv, kinds, _ in rank_results:
            assert got_sent == sent and got_recv == recv
            assert set(kinds) <= {"send", "recv"}


def test_scatter_tensor_on_a_2d_mesh_and_on_sub_meshes(ranks_for):
    """The shape is broadcast along the mesh's groups only: each row of a 2x2 mesh can
    scatter its own tensor from its own source at the same time; any source on the 2-D mesh."""

    def body():
        from shardlab import this_rank

        mesh = this_rank().mesh_for((2, 2), names=("dp", "domain"))
        me = dist.get_rank()
        row = mesh["domain"]  # ranks [0, 1] or [2, 3]
        src = int(row.mesh[1])  # the row's second rank holds the data
        g = torch.arange(30.0).reshape(10, 3) + 100 * (me // 2)  # different per row
        x = g if me == src else None
        st = scatter_tensor(x, src, row, [Shard(0)], sizes=[7, 3])
        ok = torch.equal(st.full_tensor(), g)
        for src in range(4):
            x = g if me == src else None
            st = scatter_tensor(x, src, mesh, [Shard(0), Shard(1)], sizes=[[6, 4], [3, 0]])
            want = torch.arange(30.0).reshape(10, 3) + 100 * (src // 2)
            ok &= torch.equal(st.full_tensor(), want)
        return ok

    assert ranks_for(4).run(body) == [True] * 4


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_scatter_tensor_each_rank_receives_only_its_shard(ranks_for, world):
    def body():
        mesh = this_rank().mesh
        me = dist.get_rank()
        rng = random.Random(3 * world)
        out = []
        for case in range(8):
            shape = (rng.randint(0, 9), rng.randint(1, 4))
            src = rng.randrange(world)
            sizes = random_sizes(rng, shape[0], world)
            g = torch.randn(
                shape, generator=torch.Generator().manual_seed(case), dtype=torch.float64
            )
            x = g.clone().requires_grad_() if me == src else None
            with shardlab.trace() as t:
                st = scatter_tensor(x, src, mesh, [Shard(0)], sizes=sizes)
            layout = st.sharding
            assert torch.equal(st.to_local(), block(g, layout, (me,)))
            data = t.filter(label="scatter_tensor", kind=("send", "recv"))
            mine = layout.numel((me,)) * 8
            if me == src:
                assert data.bytes(kind="send") == g.numel() * 8 - mine
                assert data.bytes(kind="recv") == 0
            else:
                assert data.bytes(kind="recv") == mine and data.bytes(kind="send") == 0
            w = torch.arange(g.numel(), dtype=torch.float64).reshape(shape)
            (st.full_tensor() * w).sum().backward()
            if me == src:
                assert torch.equal(x.grad, w)
            out.append(True)
        return len(out)

    assert ranks_for(world).run(body) == [8] * world


@pytest.mark.parametrize("world", [1, 3, 4])
def test_distribute_needs_no_communication(ranks_for, world):
    def body():
        mesh = this_rank().mesh
        g = torch.randn(
            7, 5, generator=torch.Generator().manual_seed(1), dtype=torch.float64
        ).requires_grad_()
        sizes = random_sizes(random.Random(world), 5, world)
        with shardlab.trace() as t:
            st = distribute(g, mesh, [Shard(1)], sizes=sizes)
        assert len(t) == 0
        assert torch.equal(st.to_local(), block(g.detach(), st.sharding, (dist.get_rank(),)))
        (st * st).sum().full_tensor().backward()
        return torch.allclose(g.grad, 2 * g.detach())

    assert ranks_for(world).run(body) == [True] * world


def test_bad_input_errors_on_every_rank(ranks_for):
    def body():
        from shardlab import this_rank

        mesh = this_rank().mesh
        x = torch.ones(4, 2)
        errors = {}
        cases = {
            "sum": lambda: ShardTensor.from_local(x, mesh, [Shard(0)], [4, 4, 1], shape=(12, 2)),
            "negative": lambda: distribute(torch.ones(8), mesh, [Shard(0)], [9, -1, 0]),
            "placements": lambda: ShardTensor.from_local(x, mesh, [Shard(0), Shard(1)]),
            "placement type": lambda: ShardTensor.from_local(x, mesh, ["row"]),
            "device": lambda: distribute(torch.ones(3, device="meta"), mesh, [Shard(0)]),
            "mesh": lambda: ShardTensor.from_local(x, "mesh", [Shard(0)]),
            "other mesh": lambda: distribute(x, mesh, [Shard(0)]).redistribute(
                this_rank().mesh_for((1, 3)), [Replicate(), Replicate()]
            ),
        }
        try:  # only rank 2's block (3 rows) disagrees with its 4-row local tensor
            ShardTensor.from_local(x, mesh, [Shard(0)], [4, 4, 3])
            errors_local = None
        except ValueError as exc:  # ... and every rank says so (one tiny all-gather)
            errors_local = str(exc)
        try:  # validate=False: only the rank that disagrees can tell
            ShardTensor.from_local(x, mesh, [Shard(0)], [4, 4, 3], validate=False)
            unchecked = None
        except ValueError as exc:
            unchecked = str(exc)
        try:  # different dtypes: a clear error on every rank, not an abort inside gloo
            y = x.double() if this_rank().rank == 1 else x
            ShardTensor.from_local(y, mesh, [Shard(0)])
            dtypes = None
        except ValueError as exc:
            dtypes = str(exc)
        for name, fn in cases.items():
            try:
                fn()
                errors[name] = None
            except (ValueError, TypeError) as exc:
                errors[name] = (type(exc).__name__, str(exc))
        return errors, errors_local, unchecked, dtypes

    for rank, (errors, errors_local, unchecked, dtypes) in enumerate(ranks_for(3).run(body)):
        assert errors_local and "(2,)" in errors_local and "(3, 2)" in errors_local
        assert (unchecked is not None) == (rank == 2)
        assert dtypes and "dtypes" in dtypes and "torch.float64" in dtypes
        assert all(errors.values()), errors
        assert "12" in errors["sum"][1] and "9" in errors["sum"][1]
        assert "negative" in errors["negative"][1]
        assert "one entry per mesh dim" in errors["placements"][1]
        assert "meta" in errors["device"][1]
        assert "DeviceMesh" in errors["mesh"][1]
        assert "own mesh" in errors["other mesh"][1]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_partial_to_shard_is_a_reduce_scatter_v(ranks_for, world):
    """Partial -> Shard(d) with uneven sizes: each rank receives only the other ranks'
    parts of its own block, and the result equals the sum of the parts."""

    def body():
        mesh = this_rank().mesh
        me = dist.get_rank()
        sizes = random_sizes(random.Random(world), 9, world)
        parts = [
            torch.randn(9, 3, generator=torch.Generator().manual_seed(r), dtype=torch.float64)
            for r in range(world)
        ]
        st = ShardTensor.from_local(parts[me].clone().requires_grad_(), mesh, [Partial()])
        with shardlab.trace() as t:
            out = st.redistribute(mesh, [Shard(0)], sizes=sizes)
        mine = sizes[me] * 3 * 8
        want = {
            "send": sum(1 for r, s in enumerate(sizes) if r != me and s),
            "recv": world - 1 if sizes[me] else 0,
        }
        assert t.counts() == {k: v for k, v in want.items() if v}
        assert t.bytes(kind="recv") == (world - 1) * mine
        assert t.bytes(kind="send") == sum(s * 3 * 8 for r, s in enumerate(sizes) if r != me)
        return torch.allclose(out.full_tensor(), sum(parts))

    assert ranks_for(world).run(body) == [True] * world


def test_compile_cache_key_holds_the_block(ranks_for):
    """AOTAutograd's on-disk cache key of a ShardTensor (``_stable_hash_for_caching``)
    differs between ranks holding different blocks and between shard sizes: a rank never
    loads a graph compiled for another rank's block."""

    def body():
        from torch.distributed.tensor import Shard

        import shardlab

        mesh = shardlab.this_rank().mesh
        x = torch.randn(10, 6)
        keys = [
            shardlab.distribute(x, mesh, [Shard(0)], [s])._stable_hash_for_caching()
            for s in ([7, 3], [5, 5], [7, 3])
        ]
        return keys

    r0, r1 = ranks_for(2).run(body)
    assert r0[0] == r0[2] and r0[0] != r0[1]  # the same layout, the same key
    assert len({r0[0], r1[0], r0[1], r1[1]}) == 4  # [5, 5]: equal blocks, other ranks


def test_torch_save_and_load_keep_the_layout(ranks_for, tmp_path):
    """``torch.save`` of a state dict holding ShardTensors (a tensor, a parameter), then
    ``torch.load`` with its default ``weights_only=True``, as DTensor's loads: each rank gets
    its block back, in the layout it had (uneven sizes, 2-D mesh)."""
    path = str(tmp_path)

    def body():
        from shardlab import distribute, this_rank

        mesh = this_rank().mesh_for((2, 2))
        g = torch.arange(7.0 * 5).reshape(7, 5)
        x = distribute(g, mesh, [Shard(0), Shard(1)], [[5, 2], [1, 4]])
        f = f"{path}/rank{mesh.get_rank()}.pt"
        torch.save({"x": x, "w": torch.nn.Parameter(x.clone())}, f)
        back = torch.load(f)
        same = [
            type(y) is type(x) and y._layout == x._layout and torch.equal(y.full_tensor(), g)
            for y in (back["x"], back["w"])
        ]
        return same + [isinstance(back["w"], torch.nn.Parameter)]

    assert ranks_for(4).run(body) == [[True, True, True]] * 4


@pytest.mark.parametrize("world", [1, 3])
def test_assigning_data_replaces_block_and_layout(ranks_for, world):
    """``p.data = new`` (``vector_to_parameters``, older training code) on a ShardTensor
    parameter: torch swaps the tensor's metadata only, which left the block and layout as
    they were (silently; DTensor's too). Now ``p`` takes ``new``'s block, layout, dtype and
    shape, keeps its identity (a leaf Parameter), and trains on; a plain ``new`` raises a
    RuntimeError naming the fix, on every rank."""

    def body():
        import torch.nn as nn

        from shardlab import distribute, this_rank

        mesh = this_rank().mesh
        n = mesh.size()
        g = torch.randn(
            2 * n + 1, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(0)
        )
        p = nn.Parameter(distribute(g.float(), mesh, [Shard(0)]))
        before = id(p)
        new = distribute(g * 2, mesh, [Shard(1)], [[5 - (n - 1)] + [1] * (n - 1)])
        p.data = new
        out = [id(p) == before, p.is_leaf, p.dtype == torch.float64, p._layout == new._layout]
        out.append(torch.equal(p.full_tensor(), g * 2))
        p.sum().backward()  # trains on, in its new layout
        out.append(torch.equal(p.grad.full_tensor(), torch.ones_like(g)))
        # vector_to_parameters on cut parameters, against one device (every parameter a
        # ShardTensor: torch asks a plain one alone, and ``plain.data = st`` is torch's)
        m = nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3)).double()
        ref = [q.detach().clone() for q in m.parameters()]
        cuts = [(m[0], "weight", [Shard(0)]), (m[0], "bias", [Replicate()]),
                (m[1], "weight", [Shard(1)]), (m[1], "bias", [Shard(0)])]  # fmt: skip
        for mod, name, how in cuts:
            setattr(mod, name, nn.Parameter(distribute(getattr(mod, name).detach(), mesh, how)))
        vec = torch.nn.utils.parameters_to_vector(m.parameters())
        torch.nn.utils.vector_to_parameters(vec * 3, m.parameters())
        full = [q.full_tensor() if hasattr(q, "full_tensor") else q for q in m.parameters()]
        out.append(all(torch.equal(a, 3 * b) for a, b in zip(full, ref)))
        with pytest.raises(RuntimeError, match=r"p.data = new.*must be a ShardTensor.*distribute"):
            p.data = g
        return out

    assert ranks_for(world).run(body) == [[True] * 7] * world


def test_tolist_gives_the_global_values_on_every_rank(ranks_for):
    """``st.tolist()`` (printing, a metric in a notebook): torch refuses it for every tensor
    subclass (DTensor too); a ShardTensor gives its global tensor's values on every rank,
    uneven, Partial and 0-d ones too."""

    def body():
        from shardlab import distribute, this_rank

        mesh = this_rank().mesh_for((2, 2))
        g = torch.arange(7.0 * 5).reshape(7, 5)
        x = distribute(g, mesh, [Shard(0), Shard(1)], [[5, 2], [1, 4]]).requires_grad_()
        partial = x.sum(0)  # (a reduction over a cut dim: pending sums)
        return [x.tolist() == g.tolist(), partial.tolist() == g.sum(0).tolist(),
                x.sum().tolist() == g.sum().item()]  # fmt: skip

    assert ranks_for(4).run(body) == [[True, True, True]] * 4


def test_a_0d_shard_tensor_formats_its_global_value(ranks_for):
    """``f"loss {loss:.4f}"`` in a training loop: torch formats a 0-d tensor's value (plain
    tensors only; DTensor raises TypeError). A 0-d ShardTensor gives its global value on
    every rank, Replicate or Partial (then a collective, as ``.item()``); a spec on a tensor
    of more dims raises torch's TypeError; ``f"{x}"`` stays the repr."""

    def body():
        from torch.distributed.tensor import Partial

        from shardlab import ShardTensor, distribute, this_rank

        mesh, rank = this_rank().mesh, this_rank().rank
        g = torch.arange(7.0).double() / 3
        x = distribute(g, mesh, [Shard(0)], [[5, 2]])
        loss = x.mean()
        partial = ShardTensor.from_local(torch.tensor(rank + 0.25), mesh, [Partial()])
        try:
            f"{x:.2f}"
            raised = None
        except TypeError as e:
            raised = str(e)
        return [f"{loss:.4f}", f"{partial:>8.3f}", f"{loss:e}", raised, f"{x}" == repr(x)]

    mean = torch.arange(7.0).double().div(3).mean()
    for got in ranks_for(2).run(body):
        assert got[:3] == [f"{mean:.4f}", f"{1.5:>8.3f}", f"{mean.item():e}"], got
        assert got[3] is not None and "unsupported format string" in got[3], got
        assert got[4] is True, got


def test_repr_of_a_strided_dim(ranks_for):
    """A (B, S) tensor cut along S, flattened to (B*S,) (a masked LM's loss input): the
    repr names the sizes and how the flat dim is strided (it raised ValueError before,
    also inside dynamo's error messages)."""

    def body():
        from shardlab import distribute, this_rank

        mesh = this_rank().mesh
        x = distribute(torch.arange(26.0).view(2, 13), mesh, [Shard(1)], [[8, 5]])
        return repr(x.view(-1)), repr(x)

    for rank, (flat, whole) in enumerate(ranks_for(2).run(body)):
        assert flat == (
            "ShardTensor(global (26,), float32, mesh (2,), [Shard(0) sizes [8, 5] on mesh "
            "dim 0 (strided: atoms (2 x 13), atom 1 cut by mesh dim 0)], local "
            f"({2 * [8, 5][rank]},) on rank {rank} at ({rank},))"
        ), flat
        assert "Shard(1) sizes [8, 5] on mesh dim 0" in whole, whole
