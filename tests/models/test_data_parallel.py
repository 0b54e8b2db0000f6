"""Data parallel around a sharded model: ``DistributedDataParallel`` over mesh dim "dp", the
sequence (decoders) or image rows (vision) cut unevenly over mesh dim "cp" of a 2x2 mesh,
``transformers`` models unchanged. Each dp group trains on its own batch; the gradients
equal one device's averaged over the two batches (DDP's mean), plain tensors, alike on the
ranks of a dp group: the cut's sums stay inside "cp", DDP's all-reduce inside "dp"."""

from __future__ import annotations

import pytest
import torch

from tests.models import _zoo

pytest.importorskip("transformers")


def _body(name: str):
    def body():
        import copy

        from torch.distributed.tensor import Shard
        from torch.nn.parallel import DistributedDataParallel

        import shardlab
        from shardlab import distribute, this_rank

        mesh = this_rank().mesh_for((2, 2), names=("dp", "cp"))
        gen = torch.Generator().manual_seed(3)
        if name in _zoo.DECODERS:
            model = _zoo.decoder(name).double()
            batch = torch.randint(0, _zoo.VOCAB, (4, 13), generator=gen)  # (B, S)

            def loss_of(m, x, cut):
                if cut:  # the sequence over "cp", 9 : 4
                    x = distribute(x, mesh["cp"], [Shard(1)], [[9, 4]])
                return m(input_ids=x, labels=x).loss
        else:
            model = _zoo.vision(name)[0].double()
            batch = torch.randn(4, 3, 32, 32, dtype=torch.float64, generator=gen)

            def loss_of(m, x, cut):
                if cut:  # image rows over "cp", 20 : 12
                    x = distribute(x, mesh["cp"], [Shard(2)], [[20, 12]])
                return m(pixel_values=x, labels=torch.tensor([1, 2])).loss

        halves = [batch[:2], batch[2:]]
        one = copy.deepcopy(model)
        for b in halves:  # one device: gradients summed over both batches
            loss_of(one, b, False).backward()
        ddp = DistributedDataParallel(model, process_group=mesh["dp"].get_group())
        with shardlab.patched():
            for _ in range(2):  # (a second step: the same gradients, buckets rebuilt)
                ddp.zero_grad()
                loss_of(ddp, halves[mesh.get_coordinate()[0]], True).backward()
        got = {n: p.grad for n, p in model.named_parameters()}
        want = {n: p.grad / 2 for n, p in one.named_parameters()}
        return {n: (type(got[n]) is torch.Tensor, got[n], want[n]) for n in want}

    return body


@pytest.mark.parametrize(
    "name", ["resnet", pytest.param("vit", marks=pytest.mark.more_worlds), "llama"]
)
def test_ddp_over_dp_around_a_model_cut_over_cp(ranks_for, name):
    # decoders: transformers computes their loss in float32 (``logits.float()``)
    rtol, atol = (1e-5, 1e-7) if name in _zoo.DECODERS else (1e-9, 1e-12)
    per_rank = ranks_for(4).run(_body(name))
    for res in per_rank:
        bad = [n for n, (plain, g, w) in res.items()
               if not plain or not torch.allclose(g, w, rtol=rtol, atol=atol)]  # fmt: skip
        assert not bad, bad
    for n in per_rank[0]:  # every rank holds the same (DDP's) gradient
        assert all(torch.equal(r[n][1], per_rank[0][n][1]) for r in per_rank), n
