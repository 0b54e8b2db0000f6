"""The whole-tensor fallback (``shardlab/engine/aten/fallback.py``): ops with no rule,
computed on the gathered tensors, against torch on one device."""

import pytest
import torch

from tests.tensor._cases import sizes_for


def _expanded_index_body(seed, mesh_shape=None):
    def body():
        import random

        from torch.distributed.tensor import Shard

        from shardlab import distribute, this_rank

        mesh = this_rank().mesh
        if mesh_shape is not None:
            from shardlab import this_rank

            mesh = this_rank().mesh_for(mesh_shape)
        rng = random.Random(seed)
        gen = torch.Generator().manual_seed(seed)
        out = []
        for _ in range(4):
            rows, cols, bins = rng.randint(3, 9), rng.randint(1, 4), rng.randint(1, 5)
            src = torch.randn(rows, cols, dtype=torch.float64, generator=gen)
            idx = torch.randint(0, bins, (rows,), generator=gen)
            cut = [Shard(0)] * mesh.ndim  # on a 2-D mesh: the rows cut twice
            sizes = sizes_for(rng, (rows, cols), tuple(mesh.shape), cut)
            s_src = distribute(src, mesh, cut, sizes).requires_grad_()
            s_idx = distribute(idx, mesh, cut, sizes)
            src.requires_grad_()

            def ops(x, i, rows=rows, cols=cols, bins=bins):
                e = i[:, None].expand(rows, cols)  # expanded over the columns: stride 0
                zeros = torch.zeros(bins, cols, dtype=torch.float64)
                return [
                    zeros.scatter_add(0, e, x),
                    zeros.scatter_reduce(0, e, x, "amax", include_self=False),
                    zeros.scatter_reduce(0, e, x, "mean"),
                    x.gather(0, e % rows),
                ]

            for got, ref in zip(ops(s_src, s_idx), ops(src, idx)):
                w = torch.randn(ref.shape, dtype=torch.float64, generator=gen)
                (g,) = torch.autograd.grad((got.full_tensor() * w).sum(), s_src)
                (r,) = torch.autograd.grad((ref * w).sum(), src)
                out.append(
                    (got.full_tensor() - ref).abs().max().item() < 1e-12
                    and (g.full_tensor() - r).abs().max().item() < 1e-12
                )
        return out

    return body


@pytest.mark.parametrize("world, mesh_shape", [(2, None), (3, None), (4, (2, 2))])
def test_an_expanded_index_reaches_the_op_as_on_one_device(ranks_for, world, mesh_shape):
    """``scatter_add`` / ``scatter_reduce`` / ``gather`` with a ShardTensor index expanded
    over a dim (``i[:, None].expand(n, c)``: stride 0 there), forward and backward, equal
    to torch. The fallback gave the gathered index its global strides by writing into
    an ``empty_strided`` tensor, which overlaps where a stride is 0: torch refused ("more
    than one element of the written-to tensor refers to a single memory location")."""
    for res in ranks_for(world).run(_expanded_index_body(seed=world, mesh_shape=mesh_shape)):
        assert res == [True] * len(res), res
