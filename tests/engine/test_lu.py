"""LU, Cholesky, determinants, inverses and solves of a matrix cut along a matrix dim
(``shardlab/engine/aten/lu.py`` on ``rowlu.py``): equal to one device, forward and backward
(float64), over random uneven and empty pieces, rows or columns cut (on the 2x2 mesh: by one
mesh dim, or rows and columns each by one), batched matrices, on 1 to 4 ranks, never a
whole-tensor gather (``shardlab.gathers("raise")`` around the call and its backward); and
the messages the docstring of ``rowlu.py`` counts.
"""

from __future__ import annotations

import pytest
import torch


def _spd(g, n, batch=()):
    a = torch.randn(*batch, n, n, generator=g, dtype=torch.float64)
    return a @ a.mT + n * torch.eye(n, dtype=torch.float64)


def _cases():
    """(name, fn(A, B) -> tensor or tuple, A's maker, B's maker or None, grad)."""
    L = torch.linalg

    def sq(g, n, batch=()):
        return torch.randn(*batch, n, n, generator=g, dtype=torch.float64) + n * torch.eye(
            n, dtype=torch.float64
        )

    def tri(g, n, batch=()):
        return sq(g, n, batch).tril()

    def rhs(g, n, batch=(), k=2):
        return torch.randn(*batch, n, k, generator=g, dtype=torch.float64)

    return [
        ("det", lambda a, b: L.det(a), sq, None),
        ("slogdet", lambda a, b: tuple(L.slogdet(a)), sq, None),
        ("logdet", lambda a, b: torch.logdet(a @ a.mT), sq, None),
        ("inv", lambda a, b: L.inv(a), sq, None),
        ("solve", lambda a, b: L.solve(a, b), sq, rhs),
        ("solve_left_false", lambda a, b: L.solve(a, b.mT, left=False), sq, rhs),
        ("lu_factor", lambda a, b: L.lu_factor(a)[0], sq, None),
        ("lu", lambda a, b: tuple(L.lu(a)), sq, None),
        ("lu_solve", lambda a, b: L.lu_solve(*L.lu_factor(a), b), sq, rhs),
        ("lu_solve_adjoint", lambda a, b: L.lu_solve(*L.lu_factor(a), b, adjoint=True), sq, rhs),
        ("lu_unpack", lambda a, b: tuple(torch.lu_unpack(*L.lu_factor(a))), sq, None),
        ("cholesky", lambda a, b: L.cholesky(a), _spd, None),
        ("cholesky_upper", lambda a, b: L.cholesky(a, upper=True), _spd, None),
        ("cholesky_solve", lambda a, b: torch.cholesky_solve(b, L.cholesky(a)), _spd, rhs),
        ("cholesky_inverse", lambda a, b: torch.cholesky_inverse(L.cholesky(a)), _spd, None),
        ("solve_triangular", lambda a, b: L.solve_triangular(a, b, upper=False), tri, rhs),
        ("solve_triangular_right",
         lambda a, b: L.solve_triangular(a.mT, b.mT, upper=True, left=False), tri, rhs),
        ("triangular_solve_t",
         lambda a, b: torch.triangular_solve(b, a, upper=False, transpose=True)[0], tri, rhs),
    ]  # fmt: skip


def _layout(rng, mesh, ndim):
    """Rows or columns cut on a 1-D mesh; on the 2x2 mesh, rows or columns by one mesh
    dim (the other Replicate) or both dims, one by each mesh dim (moved to the rows)."""
    from torch.distributed.tensor import Replicate, Shard

    row, col = ndim - 2, ndim - 1
    if mesh.ndim == 1:
        return [Shard(rng.choice([row, col]))]
    return rng.choice([[Shard(row), Replicate()], [Replicate(), Shard(col)],
                       [Shard(row), Shard(col)], [Shard(col), Shard(row)]])  # fmt: skip


def _body(seed, world):
    import random

    from torch.distributed.tensor import Replicate, Shard

    import shardlab
    from tests.engine.test_lu import _cases, _layout
    from tests.tensor._cases import meshes_for_world, sizes_for

    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    meshes = meshes_for_world(world)
    bad = []
    for name, fn, make, make_b in _cases():
        for trial in range(2):
            mesh = meshes[trial % len(meshes)]
            n = rng.randint(1, 6)
            batch = rng.choice([(), (), (2,)])
            a = make(g, n, batch)
            b = None if make_b is None else make_b(g, n, batch)
            places = _layout(rng, mesh, a.ndim)
            x = shardlab.distribute(
                a, mesh, places, sizes_for(rng, a.shape, tuple(mesh.shape), places)
            )
            x.requires_grad_()
            ref = a.clone().requires_grad_()
            bx = None
            if b is not None:  # B's rows cut on the first mesh dim, other sizes
                bp = [Shard(b.ndim - 2)] + [Replicate()] * (mesh.ndim - 1)
                bx = shardlab.distribute(
                    b, mesh, bp, sizes_for(rng, b.shape, tuple(mesh.shape), bp)
                )
            want = fn(ref, b)
            want = want if isinstance(want, tuple) else (want,)
            w = [torch.randn(t.shape, generator=g, dtype=torch.float64) for t in want]
            sum((t * wi).sum() for t, wi in zip(want, w) if t.is_floating_point()).backward()
            case = (name, tuple(a.shape), [str(p) for p in places])
            try:
                with shardlab.gathers("raise"):
                    got = fn(x, bx)
                    got = got if isinstance(got, tuple) else (got,)
                    rep = [shardlab.distribute(wi, mesh, [Replicate()] * mesh.ndim) for wi in w]
                    total = sum((t * wi).sum() for t, wi in zip(got, rep) if t.is_floating_point())
                    total.backward()
            except Exception as e:  # noqa: BLE001
                bad.append((*case, f"{type(e).__name__}: {e}"[:300]))
                continue
            for i, (p, q) in enumerate(zip(got, want)):
                pf = p.full_tensor() if hasattr(p, "full_tensor") else p
                if not torch.allclose(pf.to(q.dtype), q, atol=1e-9, rtol=1e-8):
                    bad.append((*case, f"forward {i}"))
            gx = x.grad.full_tensor() if x.grad is not None else None
            if gx is None or not torch.allclose(gx, ref.grad, atol=1e-8, rtol=1e-7):
                bad.append((*case, "backward"))
    return bad


@pytest.mark.parametrize("world", [1, 3, 4])
def test_lu_family_equals_one_device_without_a_gather(ranks_for, world):
    got = ranks_for(world).run(_body, 7 + world, world)
    assert got[0] == [], got[0]


def _messages():
    import torch.distributed as dist
    from torch.distributed.tensor import Shard

    import shardlab

    mesh = shardlab.this_rank().mesh
    g = torch.Generator().manual_seed(0)
    a = torch.randn(6, 6, generator=g, dtype=torch.float64)
    x = shardlab.distribute(a, mesh, [Shard(0)], [[3, 0, 3]])
    b = torch.randn(6, 2, generator=g, dtype=torch.float64)
    with shardlab.trace() as t:
        torch.linalg.lu_factor(x)
    lu = [(e.kind, e.bytes, e.label) for e in t.events if e.rank == dist.get_rank()]
    with shardlab.trace() as t:
        torch.linalg.solve(x, b)  # (B whole: sliced; the LU's steps, then the two solves)
    solve = [(e.kind, e.bytes, e.label) for e in t.events if e.rank == dist.get_rank()]
    return lu, solve


def test_the_messages_the_docstring_counts(ranks_for):
    """LU of a (6, 6) matrix cut [3, 0, 3]: per column one all-gather of the (value, row)
    pair (16 bytes) and one all-reduce of two rows (96 bytes); a solve with a whole B adds
    only the triangular solves' blocks of X, rank 0's to rank 2 (forward) and rank 2's to
    rank 0 (backward): 3 x 2 numbers each."""
    got = ranks_for(3).run(_messages)
    for rank, (lu, solve) in enumerate(got):
        assert [k for k, *_ in lu] == ["all_gather", "all_reduce"] * 6, lu
        assert {(k, b) for k, b, _ in lu} == {("all_gather", 16), ("all_reduce", 96)}, lu
        assert [(k, b) for k, b, _ in solve[: len(lu)]] == [(k, b) for k, b, _ in lu]
        rest = solve[len(lu) :]
        if rank == 1:  # (no rows: no block sent or received)
            assert rest == [], rest
        else:
            assert sorted(k for k, *_ in rest) == ["recv", "send"], rest
            assert all(b == 3 * 2 * 8 for _, b, _ in rest), rest
