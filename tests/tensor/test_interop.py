"""ShardTensor next to DTensor's own tensor parallelism (parallelize_module)."""

import torch
from torch.distributed.tensor import Replicate, Shard

import shardlab


def test_parallelize_module_mlp_on_shard_tensors(ranks_for):
    def body():
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        mesh = shardlab.this_rank().mesh
        torch.manual_seed(0)
        mlp = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
        g = torch.randn(6, 4)
        ref = mlp(g)
        parallelize_module(mlp, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        outs = []
        for placements in ([Replicate()], [Shard(0)]):
            x = shardlab.distribute(g, mesh, placements)
            y = mlp(x)
            y = y.full_tensor() if hasattr(y, "full_tensor") else torch.as_tensor(y)
            outs.append(torch.allclose(y, ref, atol=1e-6))
        return outs

    assert ranks_for(2).run(body) == [[True, True]] * 2
