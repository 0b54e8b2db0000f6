"""Every op family returns ShardTensors, with the layout the rules promise, on every
supported torch (torch 2.11 once returned plain DTensors from ops on ShardTensors)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Partial, Shard

from shardlab import ShardTensor, distribute, this_rank

W = torch.randn(4, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
SAME = "same"  # the input's layout exactly

# (family, name, fn, what the result's layout must be)
CASES = [
    ("pointwise", "arith", lambda x: x * 2 + 1 - x.exp() / 3, SAME),
    ("pointwise", "where", lambda x: torch.where(x > 0, x, 0.0), SAME),
    ("pointwise", "gelu", F.gelu, SAME),
    ("pointwise", "cast", lambda x: x.to(torch.float32), SAME),
    ("pointwise", "broadcast", lambda x: x + torch.arange(4.0, dtype=torch.float64), SAME),
    ("reduction", "sum over batch", lambda x: x.sum(0), (Shard(0), (4, 0, 3))),
    ("reduction", "sum over the cut dim", lambda x: x.sum(1), (Partial("sum"), None)),
    ("reduction", "mean", lambda x: x.mean(-1), (Shard(1), (4, 0, 3))),
    ("reduction", "amax over the cut dim", lambda x: x.amax(1), (Partial("max"), None)),
    ("reduction", "var", lambda x: x.var(2), (Shard(1), (4, 0, 3))),
    ("reduction", "argmax", lambda x: x.argmax(1), None),
    ("reduction", "softmax", lambda x: x.softmax(-1), SAME),
    ("reduction", "cumsum of the cut dim", lambda x: x.cumsum(1), SAME),
    ("view", "flatten(1)", lambda x: x.flatten(1), (Shard(1), (16, 0, 12))),
    ("view", "split last", lambda x: x.view(3, 7, 2, 2), (Shard(1), (4, 0, 3))),
    ("view", "permute", lambda x: x.permute(2, 0, 1), (Shard(2), (4, 0, 3))),
    ("view", "slice", lambda x: x[:, 1:6], (Shard(1), (3, 0, 2))),
    ("view", "reshape", lambda x: x.reshape(-1, 4), None),  # strided: checked by value
    ("matmul", "x @ w", lambda x: x @ W, (Shard(1), (4, 0, 3))),
    ("matmul", "linear", lambda x: F.linear(x, W.t()), (Shard(1), (4, 0, 3))),
    ("matmul", "einsum", lambda x: torch.einsum("bsc,cd->bsd", x, W), (Shard(1), (4, 0, 3))),
    ("matmul", "scores", lambda x: x @ x.transpose(1, 2), None),
]


@pytest.mark.parametrize("family", ["pointwise", "reduction", "view", "matmul"])
def test_results_are_shard_tensors_with_the_promised_layout(ranks_for, family):
    def body():
        mesh = this_rank().mesh
        g = torch.randn(3, 7, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        x = distribute(g, mesh, [Shard(1)], [4, 0, 3])
        bad = []
        for fam, name, fn, want in CASES:
            if fam != family:
                continue
            y = fn(x)
            if type(y) is not ShardTensor:
                bad.append((name, type(y).__name__))
                continue
            if not torch.allclose(y.full_tensor().to(torch.float64), fn(g).to(torch.float64)):
                bad.append((name, "values"))
            lay = y.sharding
            if want == SAME and (lay.placements, lay.sizes) != (
                x.sharding.placements,
                x.sharding.sizes,
            ):
                bad.append((name, str(lay)))
            elif isinstance(want, tuple):
                place, sizes = want
                got = lay.sizes_along(place.dim) if isinstance(place, Shard) else None
                if lay.placements != (place,) or got != sizes:
                    bad.append((name, str(lay)))
        return bad

    assert ranks_for(3).run(body) == [[]] * 3
