"""Neighborhood attention against its definition: SDPA over all keys with a boolean mask
that keeps each query's neighborhood (NATTEN's semantics, ``shardlab.layout.neighborhood``).
Plain tensors, then ShardTensors cut along one or two spatial dims (1-D and 2-D meshes,
uneven, shards of one row), float64, forward and q/k/v gradients; bytes = the halo lower
bound; bad input raises the same error on every rank."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from shardlab.layout.neighborhood import neighbors
from shardlab.ops.neighborhood import na1d, na2d, na3d, neighborhood_attention


def definition(q, k, v, ks, ds, cs, scale=None):
    """Masked SDPA over the flattened spatial dims: query i sees key j iff j is in its
    neighborhood along every dim."""
    n = q.ndim - 3
    mask = None
    for length, kk, d, c in zip(q.shape[1 : n + 1], ks, ds, cs):
        m = torch.zeros(length, length, dtype=torch.bool)
        for i, keys in enumerate(neighbors(length, kk, d, c)):
            m[i, [j for j in keys if j >= 0]] = True
        mask = (
            m
            if mask is None
            else (mask[:, None, :, None] & m[None, :, None, :]).flatten(2).flatten(0, 1)
        )
    b, h = q.shape[0], q.shape[-2]
    flat = lambda t: t.reshape(b, -1, h, t.shape[-1]).transpose(1, 2)  # noqa: E731
    out = F.scaled_dot_product_attention(flat(q), flat(k), flat(v), attn_mask=mask, scale=scale)
    return out.transpose(1, 2).reshape(*q.shape[:-1], v.shape[-1])


def _grads(fn, leaves, g):
    leaves = [x.detach().clone().requires_grad_() for x in leaves]
    out = fn(*leaves)
    return (out, *torch.autograd.grad(out, leaves, g))


CASES_1D = [(k, d, c) for k in (3, 5, 7, 9, 11, 13) for d in (1, 2, 3) for c in (False, True)]


@pytest.mark.parametrize("k,d,causal", CASES_1D)
def test_plain_na1d_equals_the_definition(k, d, causal):
    gen = torch.Generator().manual_seed(k * 10 + d)
    length = k * d + 3
    q, kk, v = (torch.randn(2, length, 2, 4, dtype=torch.float64, generator=gen) for _ in "qkv")
    g = torch.randn(2, length, 2, 4, dtype=torch.float64, generator=gen)
    got = _grads(lambda a, b, c: na1d(a, b, c, k, d, causal), (q, kk, v), g)
    want = _grads(lambda a, b, c: definition(a, b, c, (k,), (d,), (causal,)), (q, kk, v), g)
    assert all(torch.allclose(x, y, atol=1e-12) for x, y in zip(got, want))


@pytest.mark.parametrize(
    "fn,shape,k,d,c",
    [
        (na2d, (1, 7, 9, 2, 3), (3, 5), (2, 1), (False, True)),
        (na2d, (2, 13, 13, 1, 4), 13, 1, False),
        (na2d, (1, 9, 8, 2, 4), 3, (3, 2), True),
        (na3d, (1, 5, 6, 7, 1, 2), (3, 3, 5), (1, 2, 1), (True, False, False)),
    ],
)
def test_plain_na2d_na3d_equal_the_definition(fn, shape, k, d, c):
    gen = torch.Generator().manual_seed(0)
    n = len(shape) - 3
    q, kk, v = (torch.randn(*shape, dtype=torch.float64, generator=gen) for _ in "qkv")
    g = torch.randn(*shape, dtype=torch.float64, generator=gen)
    per = lambda x: x if isinstance(x, tuple) else (x,) * n  # noqa: E731
    got = _grads(lambda a, b, e: fn(a, b, e, k, d, c, scale=0.3), (q, kk, v), g)
    want = _grads(lambda a, b, e: definition(a, b, e, per(k), per(d), per(c), 0.3), (q, kk, v), g)
    assert all(torch.allclose(x, y, atol=1e-12) for x, y in zip(got, want))


def test_plain_errors_are_torch_style():
    x = torch.zeros(1, 9, 1, 2)
    with pytest.raises(ValueError, match="odd integer"):
        na1d(x, x, x, 4)
    with pytest.raises(ValueError, match="larger than the spatial dim 1 extent 9"):
        na1d(x, x, x, 5, dilation=2)
    with pytest.raises(ValueError, match=r"\(B, 2 spatial dims, H, D\)"):
        na2d(x, x, x, 3)


def _sharded_body(cases):
    def body():
        from torch.distributed.tensor import Shard

        import shardlab
        from shardlab import distribute, this_rank

        me = this_rank()
        out = []
        for shape, ks, ds, cs, cuts, mesh_shape in cases:
            mesh = me.mesh if len(mesh_shape) == 1 else this_rank().mesh_for(mesh_shape)
            n = len(shape) - 3
            gen = torch.Generator().manual_seed(1)
            q, k, v = (torch.randn(*shape, dtype=torch.float64, generator=gen) for _ in "qkv")
            g = torch.randn(*shape, dtype=torch.float64, generator=gen)
            places = [Shard(dim) for dim, _ in cuts]
            sizes = [s for _, s in cuts]
            leaves = [x.clone().requires_grad_() for x in (q, k, v)]
            with shardlab.trace() as t:
                sh = [distribute(x, mesh, places, sizes) for x in leaves]
                o = neighborhood_attention(*sh, ks, ds, cs, None, n)
                (o * distribute(g, mesh, places, sizes)).sum().backward()
            ref = lambda a, b, c, ks=ks, ds=ds, cs=cs: definition(a, b, c, ks, ds, cs)  # noqa: E731
            want = _grads(ref, (q, k, v), g)
            got = (o.full_tensor(), *(x.grad for x in leaves))
            recv = [e for e in t.events if e.kind == "recv" and e.label.startswith("na")]
            out.append(
                {
                    "exact": [torch.allclose(x, y, atol=1e-12) for x, y in zip(got, want)],
                    "fwd": sum(e.bytes for e in recv if "forward" in e.label),
                    "bwd": sum(e.bytes for e in recv if "backward" in e.label),
                    "kinds": {e.kind for e in t.events if e.label.startswith("na")},
                    "coord": tuple(mesh.get_coordinate()),
                }
            )
        return out

    return body


def _lower_bound(shape, ks, ds, cs, cuts, coord):
    """Bytes of the K and V entries rank ``coord`` reads and does not own (float64)."""
    n = len(shape) - 3
    owned, needed = [], []
    for i in range(n):
        length = shape[i + 1]
        cut = [(m, s) for m, (dim, s) in enumerate(cuts) if dim == i + 1]
        a, b = 0, length
        if cut:
            m, s = cut[0]
            a = sum(s[: coord[m]])
            b = a + s[coord[m]]
        owned.append(set(range(a, b)))
        nb = neighbors(length, ks[i], ds[i], cs[i])
        needed.append({j for r in range(a, b) for j in nb[r] if j >= 0})
    cells = itertools.product(*needed)
    foreign = sum(1 for c in cells if not all(x in o for x, o in zip(c, owned)))
    return foreign * shape[0] * shape[-2] * 2 * shape[-1] * 8  # K and V


SHARDED = {
    # (shape, kernel sizes, dilations, causal, [(spatial dim, sizes) per mesh dim], mesh)
    2: [
        ((1, 10, 2, 3), (3,), (1,), (False,), [(1, [9, 1])], (2,)),
        ((1, 10, 5, 2, 2), (5, 3), (2, 1), (True, False), [(2, [4, 1])], (2,)),
    ],
    3: [
        ((1, 11, 2, 3), (5,), (1,), (False,), [(1, [5, 1, 5])], (3,)),
        ((2, 12, 1, 2), (3,), (3,), (True,), [(1, [1, 1, 10])], (3,)),
        ((1, 13, 4, 1, 2), (13, 3), (1, 1), (False, True), [(1, [6, 2, 5])], (3,)),
    ],
    4: [
        ((1, 9, 3, 2), (7,), (1,), (False,), [(1, [1, 1, 1, 6])], (4,)),
        ((1, 7, 9, 2, 3), (3, 5), (2, 1), (False, True), [(1, [3, 4]), (2, [1, 8])], (2, 2)),
        (
            (1, 6, 6, 5, 1, 2),
            (3, 3, 5),
            (1, 2, 1),
            (True, False, False),
            [(1, [5, 1]), (3, [2, 3])],
            (2, 2),
        ),
    ],
}


@pytest.mark.parametrize("world", [2, 3, 4])
def test_sharded_equals_the_definition_with_halo_bytes(ranks_for, world):
    cases = SHARDED[world]
    per_rank = ranks_for(world).run(_sharded_body(cases))
    for i, case in enumerate(cases):
        shape, ks, ds, cs, cuts, _ = case
        total = 0
        for res in per_rank:
            r = res[i]
            assert all(r["exact"]), (case, r)
            bound = _lower_bound(shape, ks, ds, cs, cuts, r["coord"])
            assert r["fwd"] == bound, (case, r, bound)  # exactly what my queries read
            assert r["kinds"] <= {"send", "recv"}, r  # no collective
            total += bound
        # backward: each read row's gradient goes home once
        assert sum(res[i]["bwd"] for res in per_rank) == total


def test_world_one_and_errors_on_every_rank(ranks_for):
    def body():
        from torch.distributed.tensor import Shard

        from shardlab import distribute, this_rank

        mesh = this_rank().mesh
        x = distribute(torch.zeros(1, 9, 1, 2), mesh, [Shard(1)], [[1, 1, 7]])
        errors = []
        for kw in ({"kernel_size": 4}, {"kernel_size": 11}, {"kernel_size": 5, "dilation": 2}):
            try:
                na1d(x, x, x, **kw)
            except ValueError as exc:
                errors.append(str(exc))
        return errors

    per_rank = ranks_for(3).run(body)
    assert len(per_rank[0]) == 3 and all(r == per_rank[0] for r in per_rank)
