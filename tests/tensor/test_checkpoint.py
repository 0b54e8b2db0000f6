"""Distributed checkpoints (torch.distributed.checkpoint) of ShardTensors, bit-exact.

Every check compares what was loaded with the tensor that was saved (``torch.equal``), on
every rank and every replica: the loaded local block against the block that
``shardlab.distribute`` (or torch's ``distribute_tensor``) cuts from the saved tensor.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import Partial, Replicate, Shard

from shardlab import ShardTensor, distribute, this_rank
from shardlab.layout import ShardLayout
from shardlab.tensor.checkpoint import held_boxes, written_boxes
from tests.tensor._cases import random_sizes, sizes_for

MESHES = {1: [(1,)], 2: [(2,), (2, 1), (1, 2)], 3: [(3,), (1, 3)], 4: [(4,), (2, 2)]}
DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.int64]


def _mesh(shape):
    from shardlab import this_rank

    return this_rank().mesh if len(shape) == 1 else this_rank().mesh_for(shape)


def _tensor(shape, seed, dtype=torch.float64):
    g = torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return (g * 1000).to(dtype) if not dtype.is_floating_point else g.to(dtype)


def _layout(rng, shape, mesh_shape):
    places = tuple(
        rng.choice([Shard(d) for d in range(len(shape))] + [Replicate()]) for _ in mesh_shape
    )
    return places, sizes_for(rng, shape, mesh_shape, places)


def _same(loaded, g, ref=None):
    """``loaded`` holds exactly ``g``: a plain tensor equals it; a ShardTensor / DTensor's
    local block equals ``ref``'s (the same layout, cut from ``g`` by its constructor)."""
    if ref is None:
        return torch.equal(loaded, g)
    return torch.equal(loaded.to_local(), ref.to_local()) and loaded.dtype == g.dtype


def _targets(rng, g, meshes):
    """(name, zeros to load into, the same layout cut from g): a ShardTensor with random
    placements and sizes, a plain DTensor (chunk sizes) and a plain tensor."""
    from torch.distributed.tensor import distribute_tensor

    shape = tuple(g.shape)
    mesh_shape = rng.choice(meshes)
    mesh = _mesh(mesh_shape)
    places, sizes = _layout(rng, shape, mesh_shape)
    zero = torch.zeros_like(g)
    yield "shard", distribute(zero, mesh, places, sizes), distribute(g, mesh, places, sizes)
    places, _ = _layout(rng, shape, mesh_shape)
    yield "dtensor", distribute_tensor(zero, mesh, places), distribute_tensor(g, mesh, places)
    yield "plain", zero.clone(), None


# -- the boxes, without ranks -------------------------------------------------------------
def _random_layouts(rng, count):
    for _ in range(count):
        mesh_shape = rng.choice([(1,), (2,), (3,), (4,), (2, 2), (1, 3), (3, 2)])
        shape = [rng.randint(0, 6) for _ in range(rng.randint(0, 3))]
        places, sizes = _layout(rng, shape, mesh_shape)
        yield ShardLayout.build(shape, mesh_shape, places, sizes)
        if len(shape) >= 2 and shape[1] >= 2:  # (a, b) merged, b cut: dim 0 strided
            m = rng.randrange(len(mesh_shape))
            mesh_dims = range(len(mesh_shape))
            places = tuple(Shard(0) if i == m else Replicate() for i in mesh_dims)
            cut = (tuple(random_sizes(rng, shape[1], mesh_shape[m])),)
            sizes = tuple(cut if i == m else None for i in mesh_dims)
            atoms = ((shape[0], shape[1]),) + (None,) * (len(shape) - 2)
            cuts = tuple(1 if i == m else None for i in mesh_dims)
            merged = (shape[0] * shape[1], *shape[2:])
            yield ShardLayout(merged, mesh_shape, places, sizes, atoms, cuts)


def test_boxes_write_every_element_once_and_read_every_held_element():
    rng = random.Random(0)
    strided = 0
    for layout in _random_layouts(rng, 300):
        strided += not layout.is_block()
        g = torch.arange(max(1, torch.Size(layout.global_shape).numel())).double()
        g = g[: torch.Size(layout.global_shape).numel()].view(layout.global_shape)
        written = torch.zeros(layout.global_shape, dtype=torch.int64)
        salt = rng.randrange(100)
        for coord in layout.coords():
            idx = [layout.dim_indices(d, coord) for d in range(g.ndim)]
            mine = (
                g[torch.meshgrid(*(torch.as_tensor(i) for i in idx), indexing="ij")]
                if g.ndim
                else g
            )
            local = torch.full_like(mine, -1.0)
            for box in held_boxes(layout, coord):
                assert 0 not in box.sizes
                src = tuple(slice(o, o + n) for o, n in zip(box.offsets, box.sizes))
                local[tuple(slice(a, b) for a, b in box.local)] = g[src]
            assert torch.equal(local, mine), (layout, coord)
            for box in written_boxes(layout, coord, salt):
                written[tuple(slice(o, o + n) for o, n in zip(box.offsets, box.sizes))] += 1
        assert (written == 1).all(), layout
    assert strided > 20


def test_an_empty_tensor_is_written_once_as_one_empty_chunk():
    layout = ShardLayout.build((4, 0), (2, 2), [Shard(0), Replicate()], [[3, 1], None])
    boxes = {c: written_boxes(layout, c, salt=5) for c in layout.coords()}
    assert boxes[(0, 0)] == (((0, 0), (4, 0), ((0, 4), (0, 0))),)
    assert all(b == () for c, b in boxes.items() if c != (0, 0))


# -- save and load on the ranks -------------------------------------------------------
def _sweep(path, world, seed, cases):
    rng = random.Random(seed)
    checked = []
    for i in range(cases):
        shape = [rng.randint(0, 7) for _ in range(rng.randint(1, 3))]
        shape[rng.randrange(len(shape))] = rng.randint(3, 11)
        g = _tensor(shape, rng.randrange(10**6), rng.choice(DTYPES))
        mesh_shape = rng.choice(MESHES[world])
        places, sizes = _layout(rng, shape, mesh_shape)
        st = distribute(g, _mesh(mesh_shape), places, sizes)
        before = st._local_tensor.clone()
        where = f"{path}/{i}"
        dcp.save({"x": st, "step": torch.tensor(i)}, checkpoint_id=where)
        assert torch.equal(st._local_tensor, before)
        for name, target, ref in _targets(rng, g, MESHES[world]):
            step = torch.tensor(-1)
            dcp.load({"x": target, "step": step}, checkpoint_id=where)
            checked.append((i, name, _same(target, g, ref) and step.item() == i))
    return checked


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_save_then_load_into_any_layout_is_exact(ranks_for, tmp_path, world):
    """Random shapes, dtypes, placements, uneven sizes (empty shards too), 1-D and 2-D
    meshes: loaded into other sizes, a plain DTensor and a plain tensor."""
    for res in ranks_for(world).run(_sweep, str(tmp_path), world, 10 + world, 6):
        assert len(res) == 18 and all(ok for *_, ok in res), [r for r in res if not r[-1]]


def _strided(path):
    """(B, S, C) cut along S, flattened to (B*S, C): dim 0 strided (a rank holds B runs)."""
    mesh = this_rank().mesh
    g = _tensor((3, 7, 2), 1)
    sizes = {1: [7], 2: [5, 2], 3: [4, 0, 3], 4: [1, 3, 0, 3]}[mesh.size()]
    st = distribute(g, mesh, [Shard(1)], sizes).flatten(0, 1)
    assert not st.sharding.is_block(0)
    dcp.save({"x": st}, checkpoint_id=path + "/s")
    other = {1: [21], 2: [20, 1], 3: [0, 10, 11], 4: [6, 6, 0, 9]}[mesh.size()]
    block = distribute(torch.zeros(21, 2, dtype=g.dtype), mesh, [Shard(0)], other)
    dcp.load({"x": block}, checkpoint_id=path + "/s")
    flat = g.flatten(0, 1)
    dcp.save({"y": distribute(flat, mesh, [Shard(0)], other[::-1])}, checkpoint_id=path + "/b")
    into = distribute(torch.zeros_like(g), mesh, [Shard(1)], sizes).flatten(0, 1)
    dcp.load({"y": into}, checkpoint_id=path + "/b")  # a strided target
    return torch.equal(block.full_tensor(), flat), torch.equal(into.full_tensor(), flat)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_strided_dims_save_and_load_exactly(ranks_for, tmp_path, world):
    assert ranks_for(world).run(_strided, str(tmp_path)) == [(True, True)] * world


SAVED = {  # key: (shape, seed) of the tensors _save_on_four saves
    **{"a": ((9, 4), 2), "b": ((5, 7), 3), "c": ((6, 5), 4), "d": ((5, 3), 5)},
    **{"e": ((3, 2), 6), "f": ((), 7), "g": ((4, 0), 8)},
}


def _save_on_four(path):
    """Uneven, empty shards, nested 2-D, replicated, a DTensor, strided, 0-d, no elements."""
    from torch.distributed.tensor import distribute_tensor

    mesh, mesh2 = this_rank().mesh, _mesh((2, 2))
    g = {key: _tensor(*args) for key, args in SAVED.items()}
    state = {
        "a": distribute(g["a"], mesh, [Shard(0)], [0, 6, 0, 3]),
        "b": distribute(g["b"], mesh2, [Shard(1), Shard(0)], [[4, 3], [5, 0]]),
        "c": distribute(g["c"], mesh2, [Replicate(), Shard(1)], [None, [1, 4]]),
        "d": distribute_tensor(g["d"], mesh, [Shard(0)]),  # a DTensor: sizes (2, 2, 1, 0)
        "e": distribute(g["e"], mesh, [Shard(1)], [2, 0, 0, 0]).flatten(),  # strided
        "f": distribute(g["f"], mesh, [Replicate()]),  # 0-d
        "g": distribute(g["g"], mesh, [Shard(0)], [0, 4, 0, 0]),  # no elements
    }
    dcp.save(state, checkpoint_id=path)


def _load_elsewhere(path, seed):
    """Every key of the 4-rank checkpoint into random layouts of this world."""
    rng = random.Random(seed)
    world = this_rank().world_size
    out = []
    for key, args in SAVED.items():
        g = _tensor(*args)
        targets = list(_targets(rng, g.flatten() if key == "e" else g, MESHES[world]))
        if key == "e":  # saved strided; also into a strided ShardTensor of other sizes
            sizes = random_sizes(rng, 2, world)
            st = [distribute(t, this_rank().mesh, [Shard(1)], sizes) for t in (0 * g, g)]
            targets[0] = ("strided", st[0].flatten(), st[1].flatten())
            g = g.flatten()
        for name, target, ref in targets:
            dcp.load({key: target}, checkpoint_id=path)
            out.append((key, name, _same(target, g, ref)))
    return out


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_load_on_another_world_size_and_without_ranks(ranks_for, tmp_path):
    ranks_for(4).run(_save_on_four, str(tmp_path))
    for world in (2, 3):
        for res in ranks_for(world).run(_load_elsewhere, str(tmp_path), world):
            assert len(res) == 21 and all(ok for *_, ok in res), [r for r in res if not r[-1]]
    want = {
        key: _tensor(*args).reshape(-1 if key == "e" else args[0]) for key, args in SAVED.items()
    }
    full = {key: torch.zeros_like(g) for key, g in want.items()}
    dcp.load(full, checkpoint_id=str(tmp_path), no_dist=True)  # this process: no ranks
    assert all(torch.equal(full[key], want[key]) for key in SAVED)


def _metadata_checks(path):
    """Each non-empty box stored once, by a rank that holds it; no empty chunk."""
    from torch.distributed.checkpoint import FileSystemReader

    mesh = _mesh((2, 2))
    st = distribute(_tensor((6, 4), 7), mesh, [Shard(0), Replicate()], [[0, 6], None])
    holders = {}
    for coord in st.sharding.coords():
        rank = int(mesh.mesh[coord])
        holders.setdefault(st.sharding.local_box(coord), set()).add(rank)
    dcp.save({"x": st}, checkpoint_id=path)
    md = FileSystemReader(path).read_metadata()
    stored = []
    chunks = md.state_dict_metadata["x"].chunks
    for index, info in md.storage_data.items():
        (chunk,) = [c for c in chunks if c.offsets == index.offset]
        box = tuple((o, o + n) for o, n in zip(chunk.offsets, chunk.sizes))
        stored.append((box, int(info.relative_path.split("_")[2]) in holders[box]))
    return stored


def test_each_box_is_written_once_by_a_rank_that_holds_it(ranks_for, tmp_path):
    stored = ranks_for(4).run(_metadata_checks, str(tmp_path))[0]
    assert stored == [(((0, 6), (0, 4)), True)]


def _dtensor_into_shard_tensor(path, seed):
    from torch.distributed.tensor import distribute_tensor

    rng = random.Random(seed)
    world = this_rank().world_size
    out = []
    for i in range(4):
        shape = [rng.randint(1, 9), rng.randint(1, 5)]
        g = _tensor(shape, i)
        mesh_shape = rng.choice(MESHES[world])
        places, _ = _layout(rng, shape, mesh_shape)
        dcp.save(
            {"w": distribute_tensor(g, _mesh(mesh_shape), places)}, checkpoint_id=f"{path}/{i}"
        )
        name, target, ref = next(_targets(rng, g, MESHES[world]))
        dcp.load({"w": target}, checkpoint_id=f"{path}/{i}")
        out.append(_same(target, g, ref))
    return out


@pytest.mark.parametrize("world", [3, 4])
def test_a_dtensor_checkpoint_loads_into_a_shard_tensor(ranks_for, tmp_path, world):
    assert (
        ranks_for(world).run(_dtensor_into_shard_tensor, str(tmp_path), world)
        == [[True] * 4] * world
    )


def _bad(path):
    mesh, mesh2 = this_rank().mesh, _mesh((2, 2))
    seen = []
    partial = (
        distribute(torch.ones(4, 3), mesh, [Partial()]),
        distribute(torch.ones(4, 3), mesh2, [Shard(0), Partial()], [[1, 3], None]),
    )
    for i, st in enumerate(partial):
        before = st._local_tensor.clone()
        try:
            dcp.save({"ok": torch.ones(2), "bad": st}, checkpoint_id=f"{path}/{i}")
        except BaseException as e:  # CheckpointException is a BaseException
            seen.append(("save", type(e).__name__, "'bad'" in str(e) and "Partial" in str(e)))
        good = distribute(torch.ones(4, 3), mesh, [Shard(0)], [4, 0, 0, 0])
        dcp.save({"bad": good}, checkpoint_id=f"{path}/good{i}")
        try:
            dcp.load({"bad": st}, checkpoint_id=f"{path}/good{i}")
        except BaseException as e:
            seen.append(("load", type(e).__name__, "Partial" in str(e)))
        seen.append(("untouched", torch.equal(st._local_tensor, before)))
    wrong = distribute(torch.zeros(5, 3), mesh, [Shard(0)], [1, 1, 3, 0])
    try:  # another global shape: torch's own error, on every rank
        dcp.load({"bad": wrong}, checkpoint_id=f"{path}/good0")
    except BaseException as e:
        seen.append(("shape", "Size mismatch" in str(e), not wrong.full_tensor().any().item()))
    return seen


def test_bad_input_raises_on_every_rank_before_anything_is_written(ranks_for, tmp_path):
    want = [
        ("save", "CheckpointException", True),
        ("load", "CheckpointException", True),
        ("untouched", True),
    ] * 2 + [("shape", True, True)]
    assert ranks_for(4).run(_bad, str(tmp_path)) == [want] * 4
    for name in ("0", "1"):  # the refused saves left nothing behind
        assert not (tmp_path / name).exists() or not any((tmp_path / name).iterdir())


def _pickled():
    import io

    st = distribute(_tensor((7, 3), 8), this_rank().mesh, [Shard(0)], [5, 0, 2])
    buf = io.BytesIO()
    torch.save(st, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=False)
    return (
        isinstance(back, ShardTensor),
        back.sharding == st.sharding,
        torch.equal(back._local_tensor, st._local_tensor),
        torch.equal(back.full_tensor(), _tensor((7, 3), 8)),
    )


def test_torch_save_and_load_keep_working(ranks_for):
    assert ranks_for(3).run(_pickled) == [(True,) * 4] * 3


def _async(path):
    g = _tensor((9, 2), 9)
    mesh = this_rank().mesh
    dcp.async_save({"x": distribute(g, mesh, [Shard(0)], [1, 3, 5])}, checkpoint_id=path).result()
    target = distribute(torch.zeros_like(g), mesh, [Shard(0)], [5, 0, 4])
    dcp.load({"x": target}, checkpoint_id=path)
    return _same(target, g, distribute(g, mesh, [Shard(0)], [5, 0, 4]))


def test_async_save_is_exact(ranks_for, tmp_path):
    assert ranks_for(3).run(_async, str(tmp_path)) == [True] * 3
