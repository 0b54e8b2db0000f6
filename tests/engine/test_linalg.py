"""Dense linear algebra on a matrix cut along its rows (``shardlab/engine/aten/linalg.py``,
TSQR): equal to one device, forward and backward (float64), over random uneven and empty
pieces, tall, square and wide matrices, batched ones, on 1 to 4 ranks; one all-gather of the
R factors in the forward, of the size the docstring states, and never a whole-tensor gather
(``shardlab.gathers("raise")`` around the call and its backward).

Gauge: ``qr``'s factors are compared as they are: the rule recovers LAPACK's signs of R's
diagonal (the docstring's step 4). Singular vectors are unique only up to the sign of each
pair (torch says they differ across devices): S is compared as it is; U and Vh after both
are multiplied by the signs that align U's columns with torch's, and the backward weights
those aligned factors, on both sides (the aligning signs are constants: the same function
of A, its gradient exact). Everything else (pinv, lstsq, svdvals, rank, cond, the norms) is
unique and compared as it is.
"""

from __future__ import annotations

import pytest
import torch


def _case(rng, world, tall_only=False):
    from tests.tensor._cases import random_sizes

    n = rng.randint(1, 4)
    kind = rng.choice(["tall", "square"] if tall_only else ["tall", "square", "wide"])
    m = {"tall": rng.randint(n + 1, 3 * n + 4), "square": n, "wide": max(1, n - 2)}[kind]
    if kind == "wide":
        n = n + 2
    batch = rng.choice([(), (), (2,)])
    return batch, m, n, random_sizes(rng, m, world)


def _tsqr_bytes(sizes, m, n, batch, signs=True, extra=0):
    """The all-gather's bytes per rank, as the docstring of linalg.py counts them."""
    k, lens, start = min(m, n), [], 0
    for s in sizes:
        kq = min(s, n)
        t = max(0, min(k - start, s)) if signs else 0
        lens.append(kq * n + t * kq + (kq + 1) * extra)
        start += s
    b = 1
    for d in batch:
        b *= d
    return max(lens) * b * 8


def _body(seed, world):
    import random

    from torch.distributed.tensor import Shard

    import shardlab
    from tests.engine.test_linalg import _case, _tsqr_bytes

    rng = random.Random(seed)
    mesh = shardlab.this_rank().mesh
    bad, msgs = [], []

    def check(name, fn, g, sizes, sign_cols=None, extra=None, grad=True, signs=True):
        """fn(A, B-or-None) -> tuple of results; compared with torch on one device."""
        row = g.ndim - 2
        x = shardlab.distribute(g, mesh, [Shard(row)], [sizes]).requires_grad_(grad)
        ref = g.clone().requires_grad_(grad)
        bx = None if extra is None else shardlab.distribute(extra, mesh, [Shard(row)], [sizes])
        with shardlab.gathers("raise"), shardlab.trace() as t:
            got = fn(x, bx)
        want = fn(ref, extra)
        if sign_cols is not None:  # (U, S, Vh): align U's columns with torch's
            u, s, vh = got
            d = torch.sign((u.full_tensor().detach() * want[0].detach()).sum(-2))
            d = torch.where(d == 0, 1.0, d).to(g.dtype)
            got = (u * d.unsqueeze(-2), s, vh * d.unsqueeze(-1))
        for i, (a, b) in enumerate(zip(got, want)):
            if not torch.allclose(a.full_tensor(), b, atol=1e-10, rtol=1e-9):
                bad.append((name, tuple(g.shape), sizes, f"forward {i}"))
        gathers = [e for e in t.events if e.kind == "all_gather"]
        want_bytes = _tsqr_bytes(sizes, g.shape[-2], g.shape[-1], tuple(g.shape[:-2]), signs,
                                 0 if extra is None else extra.shape[-1])  # fmt: skip
        msgs.append((name, world, [(e.bytes, e.label) for e in gathers], want_bytes))
        if not grad:
            return
        ws = [torch.randn(b.shape, dtype=b.dtype) for b in want]
        with shardlab.gathers("raise"):
            sum((a * w).sum() for a, w in zip(got, ws)).backward()
        sum((b * w).sum() for b, w in zip(want, ws)).backward()
        if not torch.allclose(x.grad.full_tensor(), ref.grad, atol=1e-8, rtol=1e-7):
            bad.append((name, tuple(g.shape), sizes, "backward"))

    gen = torch.Generator().manual_seed(seed)
    for _ in range(6):
        batch, m, n, sizes = _case(rng, world)
        g = torch.randn(*batch, m, n, dtype=torch.float64, generator=gen)
        check("qr", lambda a, b: tuple(torch.linalg.qr(a)), g, sizes)
        check("qr r", lambda a, b: torch.linalg.qr(a, mode="r")[1:], g, sizes, grad=False)
        check("svd", lambda a, b: tuple(torch.linalg.svd(a, full_matrices=False)), g, sizes,
              sign_cols=True)  # fmt: skip
        check("svdvals", lambda a, b: (torch.linalg.svdvals(a),), g, sizes, signs=False,
              grad=False)  # fmt: skip
        check("pinv", lambda a, b: (torch.linalg.pinv(a),), g, sizes, signs=False)
        batch, m, n, sizes = _case(rng, world, tall_only=True)
        g = torch.randn(*batch, m, n, dtype=torch.float64, generator=gen)
        rhs = torch.randn(*batch, m, rng.randint(1, 3), dtype=torch.float64, generator=gen)
        driver = rng.choice([None, "gels", "gelsd", "gelss"])
        fn = lambda a, b, d=driver: tuple(torch.linalg.lstsq(a, b, driver=d))[:2]  # noqa: E731
        check(f"lstsq {driver}", fn, g, sizes, extra=rhs, signs=False)  # (and its residuals)
        check("matrix_rank", lambda a, b: (torch.linalg.matrix_rank(a),), g, sizes, grad=False)
        check("cond", lambda a, b: (torch.linalg.cond(a),), g, sizes)
        check("nuc", lambda a, b: (torch.linalg.matrix_norm(a, "nuc"),), g, sizes)
        check("2-norm", lambda a, b: (torch.linalg.matrix_norm(a, 2),), g, sizes)
    return bad, msgs


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_linalg_on_rows_equals_one_device_with_one_all_gather(ranks_for, world):
    for bad, msgs in ranks_for(world).run(_body, world, world):
        assert not bad, bad[:4]
        for name, w, gathers, want in msgs:
            if w == 1:
                assert gathers == [], (name, gathers)
            elif name in ("svdvals", "matrix_rank", "cond", "nuc", "2-norm"):
                assert len(gathers) == 1 and gathers[0][1] == "svd.tsqr", (name, gathers)
            else:
                assert [b for b, _ in gathers] == [want], (name, gathers, want)


def test_other_layouts_and_arguments(ranks_for):
    """lstsq with B a vector, B cut otherwise (moved to A's rows first), a plain B, A of lower rank
    (torch's minimum-norm solution and rank); qr 'complete' of a wide matrix; the rows cut
    on a 2x2 mesh (the other mesh dim Replicate); ``solve_triangular`` with the triangular
    matrix whole and B cut along its free dim (no message, forward and backward); svd and
    pinv of a matrix cut along its columns (through its transpose: one all-gather each,
    forward and backward), and its qr, left to the fallback: equal to torch each time."""

    def body():
        from torch.distributed.tensor import Replicate, Shard

        import shardlab

        mesh = shardlab.this_rank().mesh
        gen = torch.Generator().manual_seed(3)
        out = {}

        def rows(t, sizes=(3, 0, 4, 2)):
            return shardlab.distribute(t, mesh, [Shard(t.ndim - 2)], [list(sizes)])

        a = torch.randn(9, 3, dtype=torch.float64, generator=gen)
        b = torch.randn(9, dtype=torch.float64, generator=gen)
        with shardlab.gathers("raise"):
            got = torch.linalg.lstsq(
                rows(a), shardlab.distribute(b, mesh, [Shard(0)], [[3, 0, 4, 2]])
            )
        out["lstsq vector"] = torch.allclose(
            got.solution.full_tensor(), torch.linalg.lstsq(a, b).solution
        )
        bm = torch.randn(9, 2, dtype=torch.float64, generator=gen)
        with shardlab.gathers("raise"):
            got = torch.linalg.lstsq(rows(a), bm, driver="gels")  # a plain B: its rows sliced
        want = torch.linalg.lstsq(a, bm, driver="gels")
        out["lstsq plain B"] = all(
            torch.allclose(x.full_tensor(), y) for x, y in zip(got[:2], want[:2])
        )
        with shardlab.gathers("raise"):
            got = torch.linalg.lstsq(rows(a), rows(bm, (1, 5, 1, 2)))
        out["lstsq B moved"] = torch.allclose(
            got.solution.full_tensor(), torch.linalg.lstsq(a, bm).solution
        )
        low = a[:, :2] @ torch.randn(2, 3, dtype=torch.float64, generator=gen)  # rank 2
        with shardlab.gathers("raise"):
            got = torch.linalg.lstsq(rows(low), rows(bm))
        want = torch.linalg.lstsq(low, bm)
        out["lstsq rank 2"] = torch.allclose(got.solution.full_tensor(), want.solution) and int(
            got.rank.full_tensor()) == int(want.rank) == 2  # fmt: skip
        w = torch.randn(3, 6, dtype=torch.float64, generator=gen)
        with shardlab.gathers("raise"):
            q, r = torch.linalg.qr(rows(w, (1, 0, 2, 0)), mode="complete")
        qq, rr = torch.linalg.qr(w, mode="complete")
        out["qr complete wide"] = torch.allclose(q.full_tensor(), qq) and torch.allclose(
            r.full_tensor(), rr
        )
        m2 = shardlab.this_rank().mesh_for((2, 2))
        x = shardlab.distribute(a, m2, [Shard(0), Replicate()], [[4, 5], None]).requires_grad_(True)
        ref = a.clone().requires_grad_(True)
        with shardlab.gathers("raise"), shardlab.trace() as t:
            q, r = torch.linalg.qr(x)
            ((q * q.detach()).sum() + r.sum()).backward()
        qq, rr = torch.linalg.qr(ref)
        ((qq * qq.detach()).sum() + rr.sum()).backward()
        out["qr 2x2 mesh"] = (
            torch.allclose(q.full_tensor(), qq)
            and torch.allclose(r.full_tensor(), rr)
            and torch.allclose(x.grad.full_tensor(), ref.grad)
        )
        tri = torch.randn(4, 4, dtype=torch.float64, generator=gen).triu() + 4 * torch.eye(
            4, dtype=torch.float64
        )
        for left, dim, shape in ((True, 1, (4, 7)), (False, 0, (7, 4))):
            bb = torch.randn(shape, dtype=torch.float64, generator=gen)
            tx = shardlab.distribute(tri, mesh, [Replicate()]).requires_grad_(True)
            bx = shardlab.distribute(bb, mesh, [Shard(dim)], [[2, 0, 4, 1]]).requires_grad_(True)
            tr, br = tri.clone().requires_grad_(True), bb.clone().requires_grad_(True)
            with shardlab.gathers("raise"), shardlab.trace() as t:
                y = torch.linalg.solve_triangular(tx, bx, upper=True, left=left)
            sent = len(t.events)
            with shardlab.gathers("raise"):
                (y * y.detach()).sum().backward()
            yr = torch.linalg.solve_triangular(tr, br, upper=True, left=left)
            (yr * yr.detach()).sum().backward()
            out[f"solve_triangular left={left}"] = (
                sent == 0 and torch.allclose(y.full_tensor(), yr)
                and torch.allclose(bx.grad.full_tensor(), br.grad)
                and torch.allclose(tx.grad.full_tensor(), tr.grad)
            )  # fmt: skip
        at = a.T.contiguous()  # (3, 9) cut along its columns: svd and pinv through A^T
        col = shardlab.distribute(at, mesh, [Shard(1)], [[3, 0, 4, 2]]).requires_grad_(True)
        ref = at.clone().requires_grad_(True)
        with shardlab.gathers("raise"), shardlab.trace() as t:
            u, s, vh = torch.linalg.svd(col, full_matrices=False)
            p = torch.linalg.pinv(col)
        uu, ss, vv = torch.linalg.svd(ref, full_matrices=False)
        d = torch.sign((u.full_tensor().detach() * uu.detach()).sum(0))
        u, vh = u * d, vh * d.unsqueeze(-1)  # the gauge: U's columns aligned with torch's
        ws = [torch.randn(v.shape, dtype=torch.float64, generator=gen) for v in (uu, ss, vv)]
        pp = torch.linalg.pinv(ref)
        with shardlab.gathers("raise"):
            (sum((v * w).sum() for v, w in zip((u, s, vh), ws)) + (p * p.detach()).sum()).backward()
        (sum((v * w).sum() for v, w in zip((uu, ss, vv), ws)) + (pp * pp.detach()).sum()).backward()
        out["columns: svd, pinv"] = (
            all(
                torch.allclose(x.full_tensor(), y) for x, y in ((u, uu), (s, ss), (vh, vv), (p, pp))
            )
            and torch.allclose(col.grad.full_tensor(), ref.grad)
            and [e.label for e in t.events if e.kind == "all_gather"] == ["svd.tsqr", "pinv.tsqr"]
            and [type(q).__name__ + str(getattr(q, "dim", "")) for q in p.placements] == ["Shard0"]
        )
        # qr of a column-cut matrix: moved to its rows (one all-to-all), then TSQR
        with shardlab.gathers("raise"), shardlab.trace() as t:
            q, r = torch.linalg.qr(shardlab.distribute(at, mesh, [Shard(1)], [[3, 0, 4, 2]]))
        qq, rr = torch.linalg.qr(at)
        labels = {e.label for e in t.events}
        out["columns: qr, moved to the rows"] = (
            torch.allclose(q.full_tensor(), qq)
            and torch.allclose(r.full_tensor(), rr)
            and labels == {"qr.to_rows", "qr.tsqr"}
        )
        return out

    for out in ranks_for(4).run(body):
        assert all(out.values()), out
