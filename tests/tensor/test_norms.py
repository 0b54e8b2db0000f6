"""Norms of ShardTensors (through shardlab's reductions) equal single-device torch,
forward and backward.

``torch.norm``, ``Tensor.norm``, ``torch.linalg.norm`` / ``vector_norm`` / ``matrix_norm``
over random dims (sharded or not), every ``ord`` torch has for vectors, uneven sizes with
empty shards, world 1-4 and a 2x2 mesh. The reference is the plain torch call.
"""

import math
import random

import pytest
import torch
from torch.distributed.tensor import Shard

from shardlab import distribute
from shardlab.runtime import this_rank
from tests.tensor._cases import random_sizes

ORDS = [2, 1, 3, 0.5, math.inf, -math.inf, 0]


def _call(rng, x):
    """One random norm call, the same on every rank (``rng`` is seeded alike)."""
    kind = rng.choice(["vector_norm", "linalg.norm", "torch.norm", "Tensor.norm", "matrix_norm"])
    keepdim = rng.random() < 0.3
    dims = rng.choice([None, 0, 1, 2, (0, 2), (1, 2), (0, 1, 2)])
    if kind == "matrix_norm":
        d = rng.choice([(0, 1), (1, 2), (0, 2)])
        return kind, lambda t: torch.linalg.matrix_norm(t, "fro", dim=d, keepdim=keepdim)
    ord_ = rng.choice(ORDS)
    if kind == "vector_norm":
        return kind, lambda t: torch.linalg.vector_norm(t, ord_, dim=dims, keepdim=keepdim)
    if kind == "linalg.norm":  # one dim (vector) or the 'fro' of two dims
        d = rng.choice([None, 0, 2, (0, 1)])
        o = "fro" if isinstance(d, tuple) else (None if d is None else ord_)
        return kind, lambda t: torch.linalg.norm(t, o, dim=d, keepdim=keepdim)
    p = rng.choice(["fro", 2, 1, 3])
    if kind == "torch.norm":
        return kind, lambda t: torch.norm(t, p, dim=dims, keepdim=keepdim)
    return kind, lambda t: t.norm(p, dim=dims, keepdim=keepdim)


def _body(mesh_shape, cases, seed):
    def body():
        from shardlab import this_rank

        me = this_rank()
        mesh = me.mesh if len(mesh_shape) == 1 else this_rank().mesh_for(mesh_shape)
        rng = random.Random(seed)
        done = set()
        for i in range(cases):
            shape = (rng.randint(1, 6), rng.randint(1, 5), rng.randint(1, 7))
            sharded = rng.sample(range(3), len(mesh_shape))
            sizes = [random_sizes(rng, shape[d], n) for d, n in zip(sharded, mesh_shape)]
            kind, fn = _call(rng, None)
            gen = torch.Generator().manual_seed(seed * 1000 + i)
            g = torch.randn(shape, generator=gen, dtype=torch.float64)
            ref_x = g.clone().requires_grad_()
            x = g.clone().requires_grad_()
            st = distribute(x, mesh, [Shard(d) for d in sharded], sizes=sizes)
            try:
                ref = fn(ref_x)
            except RuntimeError as err:  # bad arguments: the same error from the ShardTensor
                with pytest.raises(RuntimeError, match=str(err).splitlines()[0][:40]):
                    fn(st)
                done.add("error")
                continue
            w = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
            (ref * w).sum().backward()
            out = fn(st)
            full = out.full_tensor()
            case = (kind, shape, sharded, sizes, i)
            assert full.shape == ref.shape and torch.allclose(full, ref, atol=1e-12), case
            (full * w).sum().backward()
            want = torch.zeros_like(g) if ref_x.grad is None else ref_x.grad  # ord 0: None
            got = torch.zeros_like(g) if x.grad is None else x.grad
            assert torch.allclose(got, want, atol=1e-10, equal_nan=True), case
            done.add(kind)
        return sorted(done)

    return body


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_norms_match_single_device(ranks_for, world):
    got = ranks_for(world).run(_body((world,), 40, seed=world))
    assert set(got[0]) >= {"vector_norm", "linalg.norm", "torch.norm", "Tensor.norm", "matrix_norm"}


def test_norms_on_a_2d_mesh(ranks_for):
    got = ranks_for(4).run(_body((2, 2), 30, seed=11))
    assert set(got[0]) >= {"vector_norm", "linalg.norm", "torch.norm", "Tensor.norm", "matrix_norm"}


def test_matrix_norms_and_zero_subgradients(ranks_for):
    """Norms torch computes by SVD (nuclear, spectral) of a matrix cut along its rows run on
    TSQR (``engine/aten/linalg.py``: one all-gather of the R factors each, labelled
    ``svd.tsqr``, no whole-tensor fallback); at zero the 2-norm's gradient is torch's
    subgradient 0, not nan."""

    def body():
        import shardlab

        g = torch.randn(5, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
        st = distribute(g, this_rank().mesh, [Shard(0)], [3, 0, 2])
        ok = []
        with shardlab.trace() as t:
            for fn in (
                lambda x: torch.linalg.matrix_norm(x, "nuc"),
                lambda x: torch.norm(x, "nuc"),
                lambda x: torch.linalg.norm(x, 2, dim=(0, 1)),
            ):
                ok.append(torch.allclose(fn(st).full_tensor(), fn(g)))
        z = torch.zeros(5, 3, dtype=torch.float64, requires_grad=True)
        torch.linalg.vector_norm(
            distribute(z, this_rank().mesh, [Shard(0)], [3, 0, 2])
        ).sum().full_tensor().backward()
        ok.append(torch.equal(z.grad, torch.zeros_like(z)))
        tsqr = [e.label for e in t.events if e.kind == "all_gather"]
        return ok, any("whole-tensor fallback" in e.label for e in t.events), tsqr

    assert ranks_for(3).run(body) == [([True] * 4, False, ["svd.tsqr"] * 3)] * 3
