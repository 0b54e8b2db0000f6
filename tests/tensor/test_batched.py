"""Batched ``torch.linalg`` ops with batch dims cut: each rank solves its own matrices (no
message but torch's error check), equal to one device forward and backward."""

import pytest
import torch
from torch.distributed.tensor import Shard

from shardlab import distribute, this_rank, trace

f64 = torch.float64
CHECK = "whole-tensor fallback for _linalg_check_errors"  # the one message: torch's check

CALLS = {  # name: (call on (A, S, B) (A square, S symmetric positive definite), labels sent)
    "det": (lambda a, s, b: torch.linalg.det(a), set()),
    "slogdet": (lambda a, s, b: torch.linalg.slogdet(a)[1], set()),
    "logdet": (lambda a, s, b: torch.logdet(s), set()),
    "qr": (lambda a, s, b: torch.linalg.qr(a)[1], set()),
    "matrix_exp": (lambda a, s, b: torch.linalg.matrix_exp(0.1 * a), set()),
    "solve_triangular": (
        lambda a, s, b: torch.linalg.solve_triangular(s.tril(), b, upper=False), set()
    ),
    "cholesky_solve": (lambda a, s, b: torch.cholesky_solve(b, s.tril()), set()),
    "lu": (lambda a, s, b: torch.linalg.lu(a)[2], set()),
    "lu_solve": (
        lambda a, s, b: torch.linalg.lu_solve(*torch.linalg.lu_factor_ex(a)[:2], b), set()
    ),
    "householder": (lambda a, s, b: torch.linalg.householder_product(a, b[..., 0]), set()),
    "solve": (lambda a, s, b: torch.linalg.solve(a, b), {CHECK}),
    "solve vector": (lambda a, s, b: torch.linalg.solve(a, b[..., 0]), {CHECK}),
    "inv": (lambda a, s, b: torch.linalg.inv(a), {CHECK}),
    "cholesky": (lambda a, s, b: torch.linalg.cholesky(s), {CHECK}),
    "lu_factor": (lambda a, s, b: torch.linalg.lu_factor(a)[0], {CHECK}),
}  # fmt: skip


def _body(mesh_shape, batch, placements, sizes, plain_b):
    def body():
        from shardlab import this_rank

        mesh = this_rank().mesh if len(mesh_shape) == 1 else this_rank().mesh_for(mesh_shape)
        gen = torch.Generator().manual_seed(0)
        a = torch.randn(*batch, 4, 4, dtype=f64, generator=gen) + 4 * torch.eye(4, dtype=f64)
        s = a @ a.mT
        b = torch.randn(*batch, 4, 3, dtype=f64, generator=gen)
        out = {}
        for name, (call, labels) in CALLS.items():
            ref_in = [t.clone().requires_grad_() for t in (a, s, b)]
            ref = call(*ref_in)
            w = torch.randn(ref.shape, dtype=f64, generator=torch.Generator().manual_seed(1))
            (ref * w).sum().backward()
            xs = [t.clone().requires_grad_() for t in (a, s, b)]
            sts = [distribute(t, mesh, placements, sizes) for t in xs]
            if plain_b:
                sts[2] = xs[2]  # a whole B against cut A: sliced where A is cut
            with trace() as t:
                y = call(*sts)
            got = y.full_tensor()
            (got * w).sum().backward()
            ok = torch.allclose(got, ref, atol=1e-10)
            for x, r in zip(xs, ref_in):  # (an input the call does not use: no gradient)
                ok &= (x.grad is None) == (r.grad is None)
                ok &= r.grad is None or torch.allclose(x.grad, r.grad, atol=1e-9)
            sent = {e.label for e in t.events}
            out[name] = (bool(ok), sent <= labels, y.placements)
        return out

    return body


@pytest.mark.parametrize(
    ("mesh_shape", "batch", "placements", "sizes", "plain_b", "local"),
    [
        ((2,), (5,), [Shard(0)], [[3, 2]], False, True),
        ((3,), (2, 5), [Shard(1)], [[2, 2, 1]], False, True),
        ((3,), (5,), [Shard(0)], [[2, 2, 1]], True, True),
        ((2, 2), (3, 4), [Shard(0), Shard(1)], [[2, 1], [1, 3]], False, True),
        # an empty piece: the whole-tensor fallback (a kernel that refuses a dtype or a
        # mode only where there is data would raise on some ranks only)
        ((3,), (5,), [Shard(0)], [[4, 0, 1]], False, False),
    ],
)
def test_batched_linalg_solves_each_rank_its_own(
    ranks_for, mesh_shape, batch, placements, sizes, plain_b, local
):
    """Values and the gradients of A, S and B as one device; forward sends nothing but
    torch's error check (``info`` gathered, so a singular matrix raises on every rank);
    the result keeps the batch cut."""
    world = 1
    for n in mesh_shape:
        world *= n
    for rank in ranks_for(world).run(_body(mesh_shape, batch, placements, sizes, plain_b)):
        for name, (ok, quiet, places) in rank.items():
            assert ok and (quiet or not local), (name, ok, quiet)
            if local:
                assert list(places) == list(placements), (name, places)


def test_what_kernels_refuse_where_there_is_data_raises_on_every_rank(ranks_for):
    """Half precision and LU without pivoting: torch's CPU kernels accept an empty batch
    and refuse a full one. With a rank holding no matrix, every rank still raises."""

    def body():
        mesh = this_rank().mesh
        a = torch.eye(3, dtype=f64).repeat(3, 1, 1)
        errors = []
        for call in (
            lambda t: torch.linalg.det(t.half()),
            lambda t: torch.linalg.lu_factor(t, pivot=False),
        ):
            for sizes in ([[2, 0, 1]], [[1, 1, 1]]):
                try:
                    call(distribute(a, mesh, [Shard(0)], sizes))
                    errors.append(None)
                except (RuntimeError, NotImplementedError) as exc:  # torch's own, each
                    errors.append(type(exc).__name__)
        return errors

    want = ["NotImplementedError"] * 2 + ["RuntimeError"] * 2
    for errors in ranks_for(3).run(body):
        assert errors == want, errors


def test_a_singular_matrix_raises_on_every_rank(ranks_for):
    """torch's error names the batch element; the rank that holds it is not the only one
    to raise (the others would wait for it)."""

    def body():
        mesh = this_rank().mesh
        a = torch.eye(3, dtype=f64).repeat(4, 1, 1)
        a[3] = 0  # the last batch element, on the last rank
        st = distribute(a, mesh, [Shard(0)], [[2, 1, 1]])
        try:
            torch.linalg.inv(st)
        except RuntimeError as exc:
            return str(exc)
        return None

    for msg in ranks_for(3).run(body):
        assert msg is not None and "Batch element 3" in msg, msg
