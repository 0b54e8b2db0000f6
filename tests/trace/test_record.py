"""The tracer records the exact events of known programs, on every rank."""

import pytest
import torch
import torch.distributed as dist

import shardlab
from shardlab import this_rank
from shardlab.trace import Trace, label


def _no_modes() -> bool:
    """No dispatch mode, and none of the tracer's kernels, installed."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    from shardlab.trace.hooks import installed

    return len(_get_current_dispatch_mode_stack()) == 0 and not installed()


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_all_reduce_event(ranks_for, world):
    def body():
        assert _no_modes()
        x = torch.ones(4)
        with shardlab.trace() as t:
            dist.all_reduce(x)
        assert _no_modes()  # nothing stays installed
        return t.events

    for rank, events in enumerate(ranks_for(world).run(body)):
        assert len(events) == 1
        e = events[0]
        assert (e.rank, e.kind, e.op, e.bytes, e.dtype, e.shapes) == (
            rank,
            "all_reduce",
            "c10d.allreduce",  # the ProcessGroup method torch.distributed calls
            16,
            "float32",
            ((4,),),
        )
        assert e.group == tuple(range(world)) and e.peer is None
        assert e.mesh_dim == 0 and e.api == "c10d" and e.duration >= 0


@pytest.mark.parametrize("world", [2, 3, 4])
def test_point_to_point_ring(ranks_for, world):
    """send/recv, isend/irecv and batch_isend_irecv: peers and bytes per message."""

    def body():
        me, n = this_rank().rank, this_rank().world_size
        right, left = (me + 1) % n, (me - 1) % n
        a = torch.arange(3, dtype=torch.float64) + me
        got = torch.empty(3, dtype=torch.float64)
        with shardlab.trace() as t:
            with label("ring", "blocking"):
                if me % 2 == 0:
                    dist.send(a, right)
                    dist.recv(got, left)
                else:
                    dist.recv(got, left)
                    dist.send(a, right)
            with label("ring", "async"):
                reqs = [dist.isend(a[:2].contiguous(), right), dist.irecv(got[:2], left)]
                for r in reqs:
                    r.wait()
            with label("ring", "batch"):
                ops = [dist.P2POp(dist.isend, a, right), dist.P2POp(dist.irecv, got, left)]
                for r in dist.batch_isend_irecv(ops):
                    r.wait()
        return [(e.kind, e.peer, e.bytes, e.label) for e in t.events]

    for me, events in enumerate(ranks_for(world).run(body)):
        right, left = (me + 1) % world, (me - 1) % world
        blocking = [("send", right, 24, "ring blocking"), ("recv", left, 24, "ring blocking")]
        if me % 2:
            blocking.reverse()
        assert events == blocking + [
            ("send", right, 16, "ring async"),
            ("recv", left, 16, "ring async"),
            ("send", right, 24, "ring batch"),
            ("recv", left, 24, "ring batch"),
        ]


def test_every_collective_kind(ranks_for):
    world = 3

    def body():
        me = this_rank().rank
        x = torch.ones(6)
        with shardlab.trace() as t:
            dist.broadcast(x, src=1)
            outs = [torch.empty(6) for _ in range(world)]
            dist.all_gather(outs, x)
            big = torch.empty(6 * world)
            dist.all_gather_into_tensor(big, x)
            part = torch.empty(2)
            dist.reduce_scatter_tensor(part, x)
            dist.reduce(x, dst=2)
            dist.gather(x, [torch.empty(6) for _ in range(world)] if me == 0 else None, dst=0)
            dist.scatter(part, [torch.ones(2)] * world if me == 0 else None, src=0)
            dist.barrier()
        return [(e.kind, e.peer, e.bytes) for e in t.events]

    for events in ranks_for(world).run(body):
        assert events == [
            ("broadcast", 1, 24),
            ("all_gather", None, 24),
            ("all_gather", None, 24),
            ("reduce_scatter", None, 24),
            ("reduce", 2, 24),
            ("gather", 0, 24),
            ("scatter", 0, 8),
            ("barrier", None, 0),
        ]


def test_functional_collectives_and_dtensor(ranks_for):
    """DTensor's collectives (functional API) are recorded, with the cause labelled; a
    functional collective that runs a c10d one inside (``all_reduce`` does, on some torch
    versions) is one event."""

    def body():
        import torch.distributed._functional_collectives as funcol
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        mesh = this_rank().mesh
        with shardlab.trace() as t:
            y = funcol.all_reduce(torch.ones(5), "sum", mesh)
            float(y.sum())
            dt = distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, [Shard(0)])
            with label("demo.gather", "forward"):
                full = dt.redistribute(mesh, [Replicate()]).to_local()
        assert torch.equal(full, torch.arange(8.0).reshape(4, 2))
        return [(e.kind, e.api, e.bytes, e.label) for e in t.events]

    events = ranks_for(2).run(body)
    for ev in events:
        # distribute_tensor's own scatter of the source, then the labelled all-gather
        assert ev[0] == ("all_reduce", "functional", 20, "")
        assert [e[0] for e in ev].count("all_reduce") == 1
        assert ev[-1] == ("all_gather", "functional", 16, "demo.gather forward")


def test_end_is_when_the_rank_waited(ranks_for):
    """``Event.end``: when the message's ``Work.wait()`` (c10d; ``batch_isend_irecv``'s
    caller waits later) or ``wait_tensor`` (functional) returned; 0.0 for a message never
    waited for inside the trace. Nothing is left pending or installed."""

    def body():
        import time

        import torch.distributed._functional_collectives as funcol

        from shardlab.trace import hooks

        me, n = this_rank().rank, this_rank().world_size
        x, got = torch.ones(1000), torch.empty(1000)
        with shardlab.trace() as t:
            dist.all_reduce(x)
            works = dist.batch_isend_irecv(
                [dist.P2POp(dist.isend, x, (me + 1) % n), dist.P2POp(dist.irecv, got, (me - 1) % n)]
            )
            time.sleep(0.02)  # posted, not yet waited for
            for w in works:
                w.wait()
            float(funcol.all_reduce(torch.ones(5), "sum", this_rank().mesh).sum())
            late = dist.all_reduce(x, async_op=True)
        late.wait()  # after the trace: its event keeps end 0.0
        assert _no_modes() and not hooks._PENDING
        return [(e.kind, e.api, e.end - e.start if e.end else 0.0, e.duration) for e in t.events]

    for events in ranks_for(2).run(body):
        assert [(k, api) for k, api, *_ in events] == [
            ("all_reduce", "c10d"), ("send", "c10d"), ("recv", "c10d"),
            ("all_reduce", "functional"), ("all_reduce", "c10d"),
        ]  # fmt: skip
        took = [e[2] for e in events]
        assert took[0] >= events[0][3] > 0 and took[3] > 0
        assert min(took[1:3]) >= 0.02  # issued, then waited for after the sleep
        assert took[4] == 0.0


def test_nested_inference_backward_and_nothing_left(ranks_for):
    """Nested traces both see a message; a trace opened in inference mode, and the
    messages of a backward pass, are recorded; nothing stays installed, and the op
    still works (and is not recorded) afterwards."""

    def body():
        x = torch.ones(4)
        with shardlab.trace() as outer:
            dist.all_reduce(x)
            with shardlab.trace() as inner:
                dist.all_reduce(x)
        assert _no_modes()
        with torch.inference_mode(), shardlab.trace() as infer:
            dist.all_reduce(torch.ones(2))

        class Reduce(torch.autograd.Function):
            @staticmethod
            def forward(ctx, t):
                return t.clone()

            @staticmethod
            def backward(ctx, g):
                g = g.clone()
                dist.all_reduce(g)
                return g

        w = torch.ones(3, requires_grad=True)
        with shardlab.trace() as back:
            Reduce.apply(w).sum().backward()
        dist.all_reduce(x)
        assert torch.equal(x, torch.full((4,), float(this_rank().world_size) ** 3))
        return (
            len(outer.events),
            len(inner.events),
            [e.bytes for e in infer.events],
            [e.bytes for e in back.events],
        )

    for outer, inner, infer, back in ranks_for(3).run(body):
        assert (outer, inner, infer, back) == (2, 1, [8], [12])


def test_two_d_mesh_dims(ranks_for):
    def body():
        from shardlab import this_rank

        mesh = this_rank().mesh_for((2, 2), names=("dp", "sp"))
        with shardlab.trace(mesh=mesh) as t:
            dist.all_reduce(torch.ones(1), group=mesh.get_group("sp"))
            dist.all_reduce(torch.ones(2), group=mesh.get_group("dp"))
        return [(e.mesh_dim, e.group, e.bytes) for e in t.events]

    got = ranks_for(4).run(body)
    # rank r is at mesh coordinate (r // 2, r % 2)
    for r, events in enumerate(got):
        row = (2 * (r // 2), 2 * (r // 2) + 1)
        col = (r % 2, r % 2 + 2)
        assert events == [(1, row, 4), (0, col, 8)]


def test_kernel_trace_gathers_all_ranks(ranks_for):
    ranks = ranks_for(3)

    def step(n):
        x = torch.ones(n)
        dist.all_reduce(x)
        if this_rank().rank == 0:
            dist.send(x, 1)
        elif this_rank().rank == 1:
            dist.recv(x, 0)
        return float(x[0])

    with shardlab.trace() as t:
        assert ranks.run(step, 2) == [3.0, 3.0, 3.0]
        assert ranks.run(step, 4) == [3.0, 3.0, 3.0]
    assert ranks.run(step, 1) == [3.0, 3.0, 3.0]  # after the block: not traced
    assert t.ranks() == [0, 1, 2]
    assert t.counts() == {"all_reduce": 6, "send": 2, "recv": 2}
    assert t.counts(rank=0) == {"all_reduce": 2, "send": 2}
    assert t.bytes(rank=0) == (8 + 8) + (16 + 16)
    assert t.bytes(rank=2) == 8 + 16
    assert [e.seq for e in t.filter(rank=1).events] == [0, 1, 2, 3]
    assert Trace.from_json(t.to_json()).events == t.events
    table = t.table(rank=1)
    assert table.splitlines()[0].split()[:4] == ["rank", "#", "kind", "group"]
    assert "recv" in table and "0-2" in table
    assert "all_reduce=6" in repr(t)


def test_kernel_trace_resets_on_error(ranks_for):
    from shardlab.runtime.pool import CALL_HOOKS

    with pytest.raises(ZeroDivisionError):
        with shardlab.trace():
            raise ZeroDivisionError
    assert CALL_HOOKS.get() == ()
    assert ranks_for(2).run(_no_modes) == [True, True]


def test_label_is_scoped():
    from shardlab.trace import current_label

    assert current_label() == ""
    with label("conv2d.halo", "backward"):
        assert current_label() == "conv2d.halo backward"
        with label("inner"):
            assert current_label() == "inner"
        assert current_label() == "conv2d.halo backward"
    assert current_label() == ""


def test_all_to_all_splits_are_the_bytes_handed_each_rank(ranks_for):
    """``Event.splits``: per destination rank, the bytes an all-to-all hands it (uneven
    splits, even ones, c10d's list form, the functional one); None for other kinds."""
    world = 3

    def body():
        import torch.distributed._functional_collectives as funcol

        me = this_rank().rank
        send = [(me + s) % 3 for s in range(world)]  # rows for each rank: uneven
        recv = [(r + me) % 3 for r in range(world)]
        try:  # torch 2.11's gloo has no all_to_all of lists (every rank raises, no message)
            dist.all_to_all([torch.empty(1)] * world, [torch.ones(1)] * world)
            lists = True
        except RuntimeError:
            lists = False
        with shardlab.trace() as t:
            out = torch.empty(sum(recv), 2)
            dist.all_to_all_single(out, torch.ones(sum(send), 2), recv, send)
            dist.all_to_all_single(torch.empty(6), torch.ones(6))  # even: 2 each
            if lists:
                outs = [torch.empty(3) for r in range(world)]  # gloo: equal sizes only
                dist.all_to_all(outs, [torch.ones(3) for _ in range(world)])
            y = funcol.all_to_all_single(torch.ones(sum(send), 2), recv, send, this_rank().mesh)
            float(y.sum())
            dist.all_reduce(torch.ones(1))
        return lists, [(e.kind, e.bytes, e.splits) for e in t.events]

    for me, (lists, events) in enumerate(ranks_for(world).run(body)):
        uneven = tuple((me + s) % 3 * 8 for s in range(world))
        assert events == [
            ("all_to_all", sum(uneven), uneven),
            ("all_to_all", 24, (8, 8, 8)),
            *([("all_to_all", 36, (12, 12, 12))] if lists else []),
            ("all_to_all", sum(uneven), uneven),
            ("all_reduce", 4, None),
        ]
