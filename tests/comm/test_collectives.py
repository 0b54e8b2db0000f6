"""``shardlab/comm/collectives.py``: the collectives of ops on ShardTensors, as nodes of a
traced graph when the blocks are fake, sending the same messages when the graph runs."""

from __future__ import annotations

import pytest
import torch

from shardlab.comm import traced


def test_real_blocks_are_not_traced():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from shardlab.comm import collectives

    assert not collectives.is_traced(torch.ones(2))
    with FakeTensorMode():
        assert collectives.is_traced(torch.ones(2))
    assert collectives.exchange([]) is False


@pytest.mark.skipif(not traced.TRACEABLE, reason="torch < 2.13: no traceable ShardTensor")
def test_a_traced_graph_holds_the_collectives_and_sends_them(ranks_for):
    """AOTAutograd without dynamo (``aot_function``) on two ranks, uneven rows: softmax
    and a sum over the cut dim trace their all-reduces as ``shardlab::all_reduce`` nodes
    (forward and backward); the compiled function equals torch, forward and backward,
    and its all-reduces are sent when it runs (the tracer sees them; AOTAutograd's own
    backward formulas may need another number of them than eagerly)."""

    def body():
        from functorch.compile import aot_function, make_boxed_func
        from torch.distributed.tensor import Shard

        import shardlab

        mesh = shardlab.this_rank().mesh
        graphs = []

        def keep(gm, _):
            graphs.append(str(gm.graph))
            return make_boxed_func(gm.forward)

        def fn(t):
            return t.softmax(0) * t.sum(0, keepdim=True)

        x = torch.randn(10, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
        compiled = aot_function(fn, fw_compiler=keep, bw_compiler=keep)
        results, sent = [], []
        for run in (fn, compiled):
            leaf = x.clone().requires_grad_()
            st = shardlab.distribute(leaf, mesh, [Shard(0)], [[7, 3]])
            with shardlab.trace() as t:
                out = run(st)
                out.sum().backward()
            results.append((out.full_tensor(), leaf.grad))
            sent.append(sorted(e.op for e in t.events if e.rank == shardlab.this_rank().rank))
        want_x = x.clone().requires_grad_()
        want = fn(want_x)
        want.sum().backward()
        exact = all(torch.allclose(o, want) and torch.allclose(g, want_x.grad) for o, g in results)
        in_graphs = [g.count("shardlab.all_reduce") for g in graphs]
        return exact, in_graphs, sent

    exact, in_graphs, (eager_sent, compiled_sent) = ranks_for(2).run(body)[0]
    assert exact
    assert compiled_sent and set(compiled_sent) <= set(eager_sent)  # the graph sent them
    assert len(in_graphs) == 2 and all(n > 0 for n in in_graphs)  # forward and backward
