"""``ExpertParallel`` on one MoE block from transformers (Mixtral's, Qwen2-MoE's with its
shared expert): equal to one device forward and backward in float64, each rank's experts'
gradients the slice of one device's, the router's equal on every rank; the tracer's
all-to-all bytes are the routed rows; capacity drops exactly the pairs it says; bad input
raises the same clear error on every rank."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from tests.experts import _moe  # noqa: E402

CASES = {2: [5, 3], 4: [5, 0, 3, 4]}  # tokens per rank along S: uneven, one rank empty


def _block_body(family: str, sizes: list[int], shard_input: bool, capacity=None):
    def body():
        import copy

        from torch.distributed.tensor import Shard
        from torch.distributed.tensor.parallel import parallelize_module

        import shardlab
        from shardlab import ExpertParallel

        me = shardlab.this_rank()
        block = _moe.block(family)
        one = copy.deepcopy(block)
        g = torch.randn(1, sum(sizes), _moe.HIDDEN, dtype=torch.float64,
                        generator=torch.Generator().manual_seed(1))  # fmt: skip
        w = torch.randn(g.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
        index, _ = _moe.routed(one, g)  # (T, k): the experts one device picks
        mine = _moe.cut(sizes, me.rank)

        dropped = torch.zeros(index.shape, dtype=torch.bool)  # the pairs capacity drops
        if capacity is not None:
            for r in range(len(sizes)):  # each rank: the first C pairs of each expert
                at = _moe.cut(sizes, r)
                cap = -(-capacity * index[at].numel() // 4)  # ceil(c * T_r * k / E)
                seen = [0] * 4
                for t in range(at.start, at.stop):
                    for j in range(_moe.K):
                        e = int(index[t, j])
                        dropped[t, j] = seen[e] >= cap
                        seen[e] += 1
            gate = one.gate.forward  # one device, the same pairs dropped

            def masked(h):
                logits, weights, idx = gate(h)
                return logits, weights.masked_fill(dropped, 0), idx

            one.gate.forward = masked
        xr = g.clone().requires_grad_()
        (one(xr) * w).sum().backward()

        parallelize_module(block, me.mesh, ExpertParallel(capacity_factor=capacity))
        x = g[:, mine].clone().requires_grad_()
        with shardlab.trace() as t:
            xin = shardlab.distribute(g, me.mesh, [Shard(1)], [sizes]) if shard_input else x
            if shard_input:
                xin = xin.detach().requires_grad_()
            y = block(xin)
            (y * (shardlab.distribute(w, me.mesh, [Shard(1)], [sizes]) if shard_input
                  else w[:, mine])).sum().backward()  # fmt: skip
        if shard_input:
            full = y.full_tensor()
            forward = _moe.close(full, one(g.clone()).detach(), 1e-12) and y.placements == (
                Shard(1),
            )
            x_grad = xin.grad.to_local()
        else:
            forward = _moe.close(y, one(g.clone())[:, mine].detach(), 1e-12)
            x_grad = x.grad
        local = block.experts.num_experts
        mine_e = slice(me.rank * local, (me.rank + 1) * local)
        experts = {
            n: _moe.close(
                getattr(block.experts, n).grad.to_local(), getattr(one.experts, n).grad[mine_e]
            )  # fmt: skip
            for n in ("gate_up_proj", "down_proj")
        }
        replicated = {
            n: _moe.close(p.grad, dict(one.named_parameters())[n].grad)
            for n, p in block.named_parameters()
            if not n.startswith("experts.")
        }
        kept = ~dropped
        return {
            "forward": forward,
            "input grad": _moe.close(x_grad, xr.grad[:, mine]),
            "experts": experts,
            "replicated": replicated,
            "events": [(e.kind, e.label, e.bytes) for e in t.events],
            "sent": int(kept[mine].sum()),  # pairs of my tokens, routed
            "received": int((kept & (index // local == me.rank)).sum()),  # to my experts
            "dropped": int(dropped.sum()),
        }

    return body


@pytest.mark.parametrize("shard_input", [False, True], ids=["plain", "ShardTensor"])
@pytest.mark.parametrize("world", [2, 4])
def test_a_mixtral_block_expert_parallel_equals_one_device(ranks_for, world, shard_input):
    sizes = CASES[world]
    row = _moe.HIDDEN * 8  # bytes of one float64 token row
    results = ranks_for(world).run(_block_body("mixtral", sizes, shard_input))
    for res in results:
        assert res["forward"] and res["input grad"], res
        assert all(res["experts"].values()) and all(res["replicated"].values()), res
        sent, received = res["sent"] * row, res["received"] * row
        assert res["events"] == [
            ("all_to_all", "experts.counts forward", 4 * 8),  # E int64
            ("all_to_all", "experts.dispatch forward", sent),
            ("all_to_all", "experts.combine forward", received),
            ("all_to_all", "experts.combine backward", sent),
            ("all_to_all", "experts.dispatch backward", received),
            ("all_reduce", "params backward", 4 * _moe.HIDDEN * 8),  # the router's gradient
        ], res["events"]
    total = sum(CASES[world]) * _moe.K * row  # every token's k rows, once each way
    assert sum(r["sent"] for r in results) * row == total
    assert sum(r["received"] for r in results) * row == total


def test_a_qwen2_moe_block_with_its_shared_expert_equals_one_device(ranks_for):
    """The shared expert and its gate are replicated like the router: their gradients
    summed over the ranks, in the same one all-reduce."""
    for res in ranks_for(2).run(_block_body("qwen2_moe", CASES[2], False)):
        assert res["forward"] and res["input grad"], res
        assert all(res["experts"].values()), res
        assert len(res["replicated"]) == 5 and all(res["replicated"].values()), res
        reduces = [e for e in res["events"] if e[0] == "all_reduce"]
        assert len(reduces) == 1 and reduces[0][1] == "params backward", res["events"]


@pytest.mark.parametrize("factor", [0.5, 8.0])
def test_capacity_drops_the_pairs_past_each_experts_share(ranks_for, factor):
    """Capacity c: each rank sends each expert at most ceil(c * T_r * k / E) pairs, the
    first in token order; the output equals one device whose router weights of exactly
    those pairs are zeroed, forward and backward, and the rows sent are the kept ones."""
    row = _moe.HIDDEN * 8
    results = ranks_for(2).run(_block_body("mixtral", [9, 7], False, capacity=factor))
    for res in results:
        assert res["forward"] and res["input grad"], res
        assert all(res["experts"].values()) and all(res["replicated"].values()), res
        dispatch = [e for e in res["events"] if e[1] == "experts.dispatch forward"]
        assert dispatch == [("all_to_all", "experts.dispatch forward", res["sent"] * row)]
    if factor < 1:
        assert results[0]["dropped"] > 0  # 0.5: half of each expert's even share
    else:
        assert results[0]["dropped"] == 0
        assert sum(r["sent"] for r in results) == 16 * _moe.K


def test_bad_input_raises_the_same_clear_error_on_every_rank(ranks_for):
    def body():
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import parallelize_module

        import shardlab
        from shardlab import ExpertParallel

        me = shardlab.this_rank()
        said = {}
        for name, run in {
            "6 experts on 4 ranks": lambda: parallelize_module(
                _moe.block("mixtral", experts=6), me.mesh, ExpertParallel()
            ),
            "2-D mesh": lambda: parallelize_module(
                _moe.block("mixtral"), me.mesh_for((2, 2)), ExpertParallel()
            ),
            "no experts module": lambda: parallelize_module(
                _moe.block("mixtral"), me.mesh, ExpertParallel(experts="moe")
            ),
            "replicated tokens": lambda: parallelize_module(
                _moe.block("mixtral"), me.mesh, ExpertParallel()
            )(shardlab.distribute(torch.randn(1, 4, 16).double(), me.mesh, [Replicate()])),
        }.items():
            try:
                run()
                said[name] = None
            except (ValueError, TypeError) as e:
                said[name] = f"{type(e).__name__}: {e}"
        return said

    results = ranks_for(4).run(body)
    assert all(r == results[0] for r in results), results  # every rank alike
    said = results[0]
    assert "num_experts must be a multiple of the mesh size" in said["6 experts on 4 ranks"]
    assert "6 experts" in said["6 experts on 4 ranks"] and "4 ranks" in said["6 experts on 4 ranks"]
    assert "device_mesh must be 1-D" in said["2-D mesh"]
    assert said["no experts module"].startswith("TypeError: ExpertParallel(experts='moe')")
    assert "Replicate()" in said["replicated tokens"] and "token dim" in said["replicated tokens"]
    with pytest.raises(ValueError, match="capacity_factor"):
        __import__("shardlab").ExpertParallel(capacity_factor=0)


def test_src_data_rank_keeps_rank_0s_weights(ranks_for):
    """As torch's styles: by default the weights of the mesh's rank 0 are the ones kept
    (its experts scattered, its router broadcast); ``src_data_rank=None`` keeps each
    rank's own and sends nothing."""

    def body():
        from torch.distributed.tensor.parallel import parallelize_module

        import shardlab
        from shardlab import ExpertParallel

        me = shardlab.this_rank()
        out = {}
        for src in (0, None):
            block = _moe.block("mixtral")
            with torch.no_grad():
                for p in block.parameters():
                    p.add_(me.rank)  # each rank's weights differ
            own = {n: p.detach().clone() for n, p in block.named_parameters()}
            with shardlab.trace() as t:
                parallelize_module(block, me.mesh, ExpertParallel(), src_data_rank=src)
            # rank 0's weights: the block as drawn (rank 0 added 0)
            kept = dict(_moe.block("mixtral").named_parameters()) if src == 0 else own
            out[src] = (
                torch.equal(block.gate.weight, kept["gate.weight"]),
                torch.equal(block.experts.gate_up_proj.to_local(),
                            kept["experts.gate_up_proj"][me.rank * 2 : me.rank * 2 + 2]),
                len(t.events),
            )  # fmt: skip
        return out

    for res in ranks_for(2).run(body):
        assert res[0][:2] == (True, True) and res[0][2] > 0, res
        assert res[None] == (True, True, 0), res
