"""ShardLayout over the space of 1-D / 2-D meshes, placements and uneven sizes."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from shardlab.layout import ShardLayout, chunk_sizes, format_sizes, offsets, owner_of

MESHES = [(n,) for n in range(1, 5)] + list(itertools.product(range(1, 4), repeat=2))


def composition(rng, total, parts):
    """Random sizes >= 0 summing to ``total`` (zeros are common)."""
    cuts = sorted(rng.randint(0, total) for _ in range(parts - 1))
    return [b - a for a, b in zip([0, *cuts], [*cuts, total], strict=True)]


def random_placements(rng, mesh, ndim, partial=True):
    choices = [Shard(d) for d in range(-ndim, ndim)] + [Replicate()] + [Partial()] * partial
    return [rng.choice(choices) for _ in mesh]


def random_sizes(rng, shape, mesh, placements):
    """User-style sizes: None, a flat list (1-D mesh), or per mesh dim None / list / lists."""
    if rng.random() < 0.15:
        return None
    entries, outer = [], None  # outer: mesh dim 0's pieces, if it shards
    for m, p in enumerate(placements):
        if not isinstance(p, Shard):
            entries.append(None)
            continue
        dim = p.dim % len(shape)
        first = placements[0]
        nested = m == 1 and isinstance(first, Shard) and first.dim % len(shape) == dim
        wholes = outer if nested else [shape[dim]]
        if rng.random() < 0.2:
            entry, used = None, chunk_sizes(wholes[0], mesh[m])
        elif nested and len(set(wholes)) == 1 and rng.random() < 0.3:
            entry = used = composition(rng, wholes[0], mesh[m])  # flat: same in every piece
        elif nested:
            entry = [composition(rng, w, mesh[m]) for w in wholes]
        else:
            entry = used = composition(rng, wholes[0], mesh[m])
        if m == 0:
            outer = list(used)
        entries.append(entry)
    if len(mesh) == 1 and entries[0] is not None and rng.random() < 0.5:
        return entries[0]  # flat list on a 1-D mesh
    return entries


def random_layout(rng, partial=True):
    mesh = rng.choice(MESHES)
    shape = tuple(rng.randint(0, 7) for _ in range(rng.randint(1, 3)))
    placements = random_placements(rng, mesh, len(shape), partial)
    return ShardLayout.build(shape, mesh, placements, random_sizes(rng, shape, mesh, placements))


# ---------------------------------------------------------------- 1-D helpers
def test_chunk_sizes_match_torch_chunk_and_dtensor():
    for length in range(0, 25):
        for parts in range(1, 7):
            sizes = chunk_sizes(length, parts)
            chunks = [c.numel() for c in torch.arange(length).chunk(parts)] if length else []
            assert list(sizes) == chunks + [0] * (parts - len(chunks))
            split, _ = Shard(0)._split_tensor(torch.empty(length), parts, with_padding=False)
            assert list(sizes) == [s.numel() for s in split]
            for r in range(parts):
                size, _ = Shard.local_shard_size_and_offset(length, parts, r)
                assert sizes[r] == size
    assert chunk_sizes(5, 4) == (2, 2, 1, 0) and chunk_sizes(0, 3) == (0, 0, 0)


def test_offsets_and_owner_of_brute_force():
    rng = random.Random(0)
    for _ in range(300):
        sizes = composition(rng, rng.randint(0, 12), rng.randint(1, 6))
        owners = [r for r, n in enumerate(sizes) for _ in range(n)]
        assert offsets(sizes) == tuple(owners.index(r) if n else sum(sizes[:r]) for r, n in
                                       enumerate(sizes))  # fmt: skip
        assert [owner_of(i, sizes) for i in range(len(owners))] == owners
        for bad in (-1, len(owners)):
            with pytest.raises(IndexError, match="index"):
                owner_of(bad, sizes)


def test_format_sizes_and_str():
    assert format_sizes(Shard(2), [5, 5, 4, 4], 0) == "Shard(2) sizes [5, 5, 4, 4] on mesh dim 0"
    layout = ShardLayout.build((20, 3), (4,), [Shard(0)])
    assert str(layout) == (
        "ShardLayout(global (20, 3), mesh (4,), [Shard(0) sizes [5, 5, 5, 5] on mesh dim 0])"
    )
    twice = ShardLayout.build((5,), (2, 2), [Shard(0), Shard(-1)])
    assert twice.sizes == (((3, 2),), ((2, 1), (1, 1)))
    assert repr(twice) == (
        "ShardLayout(global (5,), mesh (2, 2), [Shard(0) sizes [3, 2] on mesh dim 0, "
        "Shard(0) sizes [[2, 1], [1, 1]] on mesh dim 1])"
    )
    other = ShardLayout.build((7, 5), (2, 3), [Partial(), Shard(1)], [None, [2, 2, 1]])
    assert str(other).endswith(
        "[Partial(sum) on mesh dim 0, Shard(1) sizes [2, 2, 1] on mesh dim 1])"
    )


# ---------------------------------------------------------------- layouts
def test_default_layout_matches_dtensor():
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    rng = random.Random(1)
    for _ in range(400):
        mesh = rng.choice(MESHES)
        shape = tuple(rng.randint(0, 9) for _ in range(rng.randint(1, 3)))
        placements = random_placements(rng, mesh, len(shape))
        layout = ShardLayout.build(shape, mesh, placements)
        assert layout.is_even()
        torch_places = list(layout.placements)
        for coord in layout.coords():
            ref_shape, ref_offset = _compute_local_shape_and_global_offset(
                shape, mesh, list(coord), torch_places
            )
            assert layout.local_shape(coord) == ref_shape
            # an empty nested piece has no start; torch then reports the dim size, we report
            # where the piece would start (its place in sizes_along)
            ours = layout.local_offset(coord)
            assert [o for o, n in zip(ours, ref_shape, strict=True) if n] == [
                o for o, n in zip(ref_offset, ref_shape, strict=True) if n
            ]


def test_random_layouts_tile_the_tensor():
    rng = random.Random(2)
    for _ in range(600):
        layout = random_layout(rng)
        shape, mesh = layout.global_shape, layout.mesh_shape
        copies = 1
        for m, p in enumerate(layout.placements):
            copies *= 1 if isinstance(p, Shard) else mesh[m]
        count = torch.zeros(shape, dtype=torch.long)
        for coord in layout.coords():
            box = layout.local_box(coord)
            assert layout.local_shape(coord) == tuple(b - a for a, b in box)
            assert layout.local_offset(coord) == tuple(a for a, _ in box)
            assert layout.numel(coord) == count[tuple(slice(a, b) for a, b in box)].numel()
            count[tuple(slice(a, b) for a, b in box)] += 1
        assert bool((count == copies).all())
        for d in range(len(shape)):
            pieces = layout.sizes_along(d)
            assert sum(pieces) == shape[d]
            starts = {layout.local_box(c)[d] for c in layout.coords()}
            assert {(a, a + n) for a, n in zip(offsets(pieces), pieces, strict=True)} == starts
        assert layout.with_sizes(None).is_even()
        assert layout.is_even() == (layout == layout.with_sizes(None))


def test_round_trip_through_local_shapes():
    rng = random.Random(3)
    for _ in range(500):
        layout = random_layout(rng)
        shapes = {c: layout.local_shape(c) for c in layout.coords()}
        args = (layout.mesh_shape, layout.placements, shapes)
        assert ShardLayout.from_local_shapes(None, *args) == layout
        assert ShardLayout.from_local_shapes(list(layout.global_shape), *args) == layout
        assert ShardLayout.build(
            layout.global_shape, layout.mesh_shape, layout.placements,
            [None if e is None else [list(p) for p in e] if len(e) > 1 else list(e[0])
             for e in layout.sizes],
        ) == layout  # fmt: skip


def test_same_dim_twice_and_shard_sizes():
    layout = ShardLayout.build(
        (9, 2), (2, 3), [Shard(0), Shard(0)], [[5, 4], [[1, 0, 4], [2, 2, 0]]]
    )
    assert layout.sizes_along(0) == (1, 0, 4, 2, 2, 0)
    assert layout.local_box((1, 1)) == ((7, 9), (0, 2))
    assert layout.shard_sizes(0) == (5, 4) and layout.shard_sizes(1, (1, 2)) == (2, 2, 0)
    with pytest.raises(ValueError, match="coord"):
        layout.shard_sizes(1)
    assert ShardLayout.build((2,), (1,), [Replicate()]).shard_sizes(0) is None
    assert layout.sizes_along(-1) == (2,)
    with pytest.raises(ValueError, match="tensor_dim"):
        layout.sizes_along(2)
    with pytest.raises(ValueError, match="mesh_dim"):
        layout.shard_sizes(2)
    flat = ShardLayout.build((8,), (2, 2), [Shard(0), Shard(0)], [None, [3, 1]])
    assert flat.sizes == (((4, 4),), ((3, 1), (3, 1)))


BUILD_ERRORS = [
    (dict(sizes=[5, 5, 4]), ValueError, ["sizes", "has 3 sizes", "4 ranks"]),
    (dict(sizes=[5, 5, 4, 3]), ValueError,
     ["Shard(0) sizes [5, 5, 4, 3] on mesh dim 0", "17", "18"]),
    (dict(sizes=[5, 5, -1, 9]), ValueError, ["sizes", "negative"]),
    (dict(sizes=[5, 5, 4.0, 4]), TypeError, ["sizes[2]", "int"]),
    (dict(sizes="5544"), TypeError, ["sizes"]),
    (dict(sizes=[[5, 5], [4, 4]]), ValueError, ["sizes", "2 entries", "1 dims"]),
    (dict(mesh_shape=(2, 2, 1), placements=[Shard(0)] * 3), ValueError,
     ["mesh_shape", "1-D and 2-D"]),
    (dict(mesh_shape=(0,)), ValueError, ["mesh_shape[0]"]),
    (dict(global_shape=(-1, 3)), ValueError, ["global_shape[0]"]),
    (dict(placements=[Shard(0), Replicate()]), ValueError,
     ["placements", "one placement per mesh"]),
    (dict(placements=[Shard(2)]), ValueError, ["placements[0]", "Shard(2)", "out of range"]),
    (dict(placements=[Shard(-3)]), ValueError, ["placements[0]", "-2 .. 1"]),
    (dict(placements=[_StridedShard(0, split_factor=2)]), ValueError, ["placements[0]", "Shard"]),
    (dict(placements=["Shard(0)"]), TypeError, ["placements[0]"]),
    (dict(placements=Shard), TypeError, ["placements"]),
    (dict(placements=[Replicate()], sizes=[[18]]), ValueError, ["sizes[0]", "Replicate()", "None"]),
    (dict(mesh_shape=(2, 2), placements=[Shard(0), Shard(1)], sizes=[[9, 9], 3]), TypeError,
     ["sizes[1]"]),
    (dict(mesh_shape=(2, 2), placements=[Shard(0), Shard(1)], sizes=[[9, 9], [[1, 2]]]), TypeError,
     ["sizes[1]", "list of ints"]),
    (dict(mesh_shape=(2, 2), placements=[Shard(0), Shard(0)], sizes=[[9, 9], [[1, 8]]]),
     ValueError, ["sizes[1]", "1 lists", "2 pieces"]),
    (dict(mesh_shape=(2, 2), placements=[Shard(0), Shard(0)], sizes=[[9, 9], [[1, 8], [1, 9]]]),
     ValueError, ["sizes[1][1]", "10", "9", "inside piece 1"]),
    (dict(mesh_shape=(2, 2), placements=[Shard(0), Shard(0)], sizes=[[10, 8], [1, 9]]),
     ValueError, ["sizes[1][1]", "10", "8"]),
]  # fmt: skip


@pytest.mark.parametrize(("kwargs", "exc", "words"), BUILD_ERRORS)
def test_build_errors(kwargs, exc, words):
    args = dict(global_shape=(18, 3), mesh_shape=(4,), placements=[Shard(0)], sizes=None) | kwargs
    with pytest.raises(exc) as info:
        ShardLayout.build(**args)
    for word in words:
        assert word in str(info.value)


LOCAL_ERRORS = [
    ((2,), [Shard(0)], {(0,): (3,)}, None, "missing [(1,)]"),
    ((2,), [Shard(0)], {(0,): (3,), (1,): (3,), (2,): (1,)}, None, "unexpected [(2,)]"),
    ((2,), [Replicate()], {(0,): (3,), (1,): (4,)}, None, "sizes 3 and 4"),
    ((2,), [Partial()], {(0,): (3, 2), (1,): (3, 1)}, None, "tensor dim 1"),
    ((2, 2), [Shard(0), Replicate()], {(0, 0): (3,), (0, 1): (2,), (1, 0): (1,), (1, 1): (1,)},
     None, "ranks (0, 0) and (0, 1)"),
    ((2,), [Shard(0)], {(0,): (3,), (1,): (3, 1)}, None, "same number of dims"),
    ((2,), [Shard(0)], {(0,): (3,), (1,): (3,)}, (7,), "global_shape[0] is 7"),
    ((2,), [Shard(0)], {(0,): (3,), (1,): (3,)}, (6, 1), "global_shape"),
    ((2,), [Shard(0)], [(3,), (3,)], None, "local_shapes must map"),
]  # fmt: skip


@pytest.mark.parametrize(("mesh", "places", "shapes", "global_shape", "words"), LOCAL_ERRORS)
def test_from_local_shapes_errors(mesh, places, shapes, global_shape, words):
    with pytest.raises((ValueError, TypeError)) as info:
        ShardLayout.from_local_shapes(global_shape, mesh, places, shapes)
    assert "local_shapes" in str(info.value) or "global_shape" in str(info.value)
    assert words in str(info.value)


def test_constructor_validates_canonical_form():
    with pytest.raises(ValueError, match="sizes"):
        ShardLayout((4,), (2,), (Shard(0),), (((3, 3),),))
    with pytest.raises(ValueError, match="placements"):
        ShardLayout((4,), (2,), (Shard(-1),), (((2, 2),),))
    with pytest.raises(ValueError, match="coord"):
        ShardLayout.build((4,), (2,), [Shard(0)]).local_shape((2,))


def test_build_keeps_layouts_per_typed_arguments():
    """build keeps each layout per arguments; equal values of other types (2.0, True)
    are other arguments, so the checks still refuse them after the int form was kept."""
    ok = ShardLayout.build((18, 3), (4,), [Shard(0)], [5, 5, 4, 4])
    assert ShardLayout.build((18, 3), (4,), [Shard(0)], [5, 5, 4, 4]) is ok
    assert ShardLayout.build([18, 3], (4,), (Shard(0),), (5, 5, 4, 4)) == ok  # kept apart
    with pytest.raises(TypeError, match=r"sizes\[2\]"):
        ShardLayout.build((18, 3), (4,), [Shard(0)], [5, 5, 4.0, 4])
    with pytest.raises(TypeError, match=r"global_shape\[0\]"):
        ShardLayout.build((18.0, 3), (4,), [Shard(0)], [5, 5, 4, 4])
    one = ShardLayout.build((18, 1), (4,), [Shard(0)])
    assert one.global_shape == (18, 1)
    with pytest.raises(TypeError, match=r"global_shape\[1\]"):
        ShardLayout.build((18, True), (4,), [Shard(0)])
    with pytest.raises(ValueError, match="out of range"):  # refused every time, not kept
        ShardLayout.build((18, 3), (4,), [Shard(2)])
    with pytest.raises(ValueError, match="out of range"):
        ShardLayout.build((18, 3), (4,), [Shard(2)])


def test_replace_keeps_layouts_per_typed_changes_and_boxes_per_coordinate():
    base = ShardLayout.build((18, 3), (4,), [Shard(0)], [5, 5, 4, 4])
    a = base.replace(global_shape=(18, 4))
    assert base.replace(global_shape=(18, 4)) is a and a.global_shape == (18, 4)
    with pytest.raises(TypeError, match=r"global_shape\[1\]"):  # 4.0: refused, not a hit
        base.replace(global_shape=(18, 4.0))
    kept = base.replace(sizes=(((3, 5, 5, 5),),))
    assert base.replace(sizes=(((3, 5, 5, 5),),)) is kept
    with pytest.raises(ValueError, match="sizes"):  # the list form: refused, not a hit
        base.replace(sizes=[[[3, 5, 5, 5]]])
    assert base.local_box((2,)) == ((10, 14), (0, 3)) and base.local_offset([3]) == (14, 0)
    with pytest.raises(ValueError, match="coord"):
        base.local_box((4,))
    for bad in [(True,), (1.0,)]:  # not the kept (1,)
        for method in (base.local_box, base.local_offset, base.local_shape):
            with pytest.raises(TypeError, match=r"coord\[0\]"):
                method(bad)


def test_cut_by_names_the_mesh_dims_of_more_than_one_rank():
    """A dim cut only by a mesh dim of one rank is whole there: ``cut_by`` leaves it out."""
    lay = ShardLayout.build((4, 6, 5), (2, 1), [Shard(1), Shard(2)])
    assert lay.cut_by(1) == [0]
    assert lay.cut_by(2) == []  # mesh dim 1 has one rank
    assert lay.cut_by(0) == []
    both = ShardLayout.build((4, 6), (2, 3), [Shard(1), Shard(1)])
    assert both.cut_by(1) == [0, 1]
    one = ShardLayout.build((4, 6), (1,), [Shard(0)])
    assert one.cut_by(0) == [] and one.cut_by(1) == []
    rep = ShardLayout.build((4, 6), (2,), [Replicate()])
    assert rep.cut_by(0) == []


def test_whole_means_no_mesh_dim_of_more_than_one_rank_cuts_it():
    build = ShardLayout.build
    assert build((4, 6), (1,), [Shard(1)]).is_whole()
    assert build((4, 6), (2, 1), [Replicate(), Shard(1)]).is_whole()
    assert build((4, 6), (3,), [Replicate()]).is_whole()
    assert not build((4, 6), (2,), [Shard(1)], [[6, 0]]).is_whole()  # a piece of 0: a cut
    assert not build((4, 6), (2, 1), [Shard(0), Shard(1)]).is_whole()
    assert not build((4, 6), (1,), [Partial()]).is_whole()
    # a strided dim cut by a mesh dim of one rank: its one piece is all of it, in order
    strided = ShardLayout((8,), (1,), (Shard(0),), (((4,),),), atoms=((2, 4),), cuts=(1,))
    assert not strided.is_block() and strided.is_whole()
