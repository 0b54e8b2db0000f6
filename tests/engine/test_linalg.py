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
        lens.append(kq * n + t * kq + kq * extra)
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
        check("lstsq", lambda a, b: (torch.linalg.lstsq(a, b).solution,), g, sizes, extra=rhs,
              signs=False)  # fmt: skip
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
