"""The rank pool: results, per-rank state, output, errors, recovery (shared pools)."""

import os
import time

import pytest
import torch
import torch.distributed as dist

import shardlab
from shardlab import RankError, Ranks, this_rank


def _rank_and_sum():
    ctx = this_rank()
    x = torch.tensor([float(ctx.rank)])
    dist.all_reduce(x)
    return ctx.rank, ctx.world_size, x.item(), tuple(ctx.mesh.shape)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_results_in_rank_order(ranks_for, world):
    got = ranks_for(world).run(_rank_and_sum)
    total = float(sum(range(world)))
    assert got == [(r, world, total, (world,)) for r in range(world)]


def test_mesh_for_makes_each_mesh_once(ranks_for):
    """``this_rank().mesh_for(shape)``: the same DeviceMesh object every time it is asked
    for again (a 2-D mesh made anew each time piles up process groups and their threads),
    one per shape and dim names, and the default mesh for the 1-D mesh over all ranks."""

    def body():
        import threading

        me = this_rank()
        first = me.mesh_for((2, 2))
        threads = threading.active_count(), len(os.listdir("/proc/self/task"))
        again = [me.mesh_for((2, 2)) for _ in range(5)]
        same_threads = threads == (threading.active_count(), len(os.listdir("/proc/self/task")))
        named = me.mesh_for((2, 2), names=("dp", "sp"))
        x = torch.ones(1)
        dist.all_reduce(x, group=named.get_group("sp"))
        return (
            all(m is first for m in again),
            same_threads,
            named is not first and named.mesh_dim_names == ("dp", "sp"),
            x.item(),
            me.mesh_for((4,)) is me.mesh,
            tuple(first.mesh.flatten().tolist()),
        )

    assert ranks_for(4).run(body) == [(True, True, True, 2.0, True, (0, 1, 2, 3))] * 4


def _threads_files_rss() -> tuple[int, int, int]:
    """This process's threads, open files and resident memory (MiB), from /proc."""
    status = dict(line.split(":", 1) for line in open("/proc/self/status"))
    threads = int(status["Threads"])
    rss = int(status["VmRSS"].split()[0]) // 1024
    return threads, len(os.listdir("/proc/self/fd")), rss


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads /proc")
def test_meshes_made_again_do_not_pile_up(ranks_for):
    """torch's own ``init_device_mesh``, called 200 times in a pool (1-D and 2-D, several
    shapes and dim names, as a cell run again and again does), each mesh then carrying a
    ShardTensor through a patched convolution: after the first round of shapes, no thread,
    open file or MiB more per rank (each new mesh's gloo groups held sockets and threads
    until the process ended: 185 threads after 50 meshes; shardlab's tables that name a
    mesh are bounded)."""

    def body():
        import torch.nn.functional as F
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard

        import shardlab

        shapes = [((2, 2), ("dp", "tp")), ((4,), None), ((1, 4), ("a", "b")), ((4, 1), None)]
        shapes += [((2, 2), ("x", "y"))]
        seen = []
        x = torch.randn(2, 3, 9, 8, dtype=torch.float64)
        w = torch.randn(4, 3, 3, 3, dtype=torch.float64)
        want = F.conv2d(x, w, padding=1).sum(0)
        for i in range(200):
            shape, names = shapes[i % len(shapes)]
            mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
            for d in range(mesh.ndim):  # each group works
                t = torch.ones(1)
                dist.all_reduce(t, group=mesh.get_group(d))
                assert t.item() == shape[d]
            # and ShardTensors on it (the engine's tables name each new mesh object)
            places = [Shard(2)] + [Replicate()] * (mesh.ndim - 1)
            with shardlab.patched():
                sizes = [{1: [9], 2: [5, 4], 4: [3, 2, 0, 4]}[shape[0]]] + [None] * (mesh.ndim - 1)
                st = shardlab.distribute(x, mesh, places, sizes)
                got = F.conv2d(st, w, padding=1).sum(0).full_tensor()
            assert torch.allclose(got, want)
            del mesh, st
            if i == len(shapes) - 1:
                seen.append(_threads_files_rss())
        seen.append(_threads_files_rss())
        return seen

    for first, last in ranks_for(4).run(body):
        assert last[:2] == first[:2], (first, last)
        assert last[2] <= first[2] * 1.05, (first, last)


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads /proc")
def test_a_mesh_per_ranks_cell_does_not_pile_up(ranks_for, capsys):
    """500 ``%%ranks`` cells, each making its 2-D mesh with torch's ``init_device_mesh``
    (as a learner re-running a cell does): threads and open files per rank as after the
    first cell, memory within 5 %."""
    from shardlab.runtime.magic import ranks_magic

    pool = ranks_for(4)
    cell = (
        "from torch.distributed.device_mesh import init_device_mesh\n"
        "mesh = init_device_mesh('cpu', (2, 2), mesh_dim_names=('dp', 'cp'))\n"
    )
    ranks_magic("r", cell, {"r": pool})
    first = pool.run(_threads_files_rss)
    for _ in range(499):
        ranks_magic("r", cell, {"r": pool})
    last = pool.run(_threads_files_rss)
    capsys.readouterr()
    for a, b in zip(first, last):
        assert b[:2] == a[:2] and b[2] <= a[2] * 1.05, (first, last)


def test_args_kwargs_and_closures(ranks_for):
    offset = 10  # captured by value from this frame, as in a notebook
    fn = lambda a, *, b: this_rank().rank * a + b + offset
    assert ranks_for(3).run(fn, 2, b=1) == [11, 13, 15]


def test_functions_using_torch_ops_travel(ranks_for):
    """A function whose code says ``torch.ops.aten...`` (or any ``x.ops`` next to a
    ``torch`` global): cloudpickle ships ``torch.ops`` with it, by name."""

    def body(a):
        torch.backends.cudnn.deterministic = torch.backends.cudnn.deterministic  # another one
        return float(torch.ops.aten.add.Tensor(torch.tensor(a), this_rank().rank))

    assert ranks_for(2).run(body, 1.5) == [1.5, 2.5]


def test_namespace_persists_across_calls(ranks_for):
    ranks = ranks_for(2)
    ranks.push(step=5)

    def bump():
        ns = this_rank().ns
        ns["step"] += this_rank().rank + 1
        return ns["step"]

    assert ranks.run(bump) == [6, 7]
    assert ranks.run(bump) == [7, 9]
    assert ranks.pull("step") == [7, 9]
    ranks.push(a=1, b=2)
    assert ranks.pull("a", "b") == {"a": [1, 1], "b": [2, 2]}


def test_output_printed_in_rank_order_with_prefix(ranks_for, capsys):
    def talk():
        r = this_rank().rank
        time.sleep(0.05 * (3 - r))  # rank 3 finishes first
        print(f"hello from {r}")
        print("second line")

    ranks_for(4).run(talk)
    out = capsys.readouterr().out.splitlines()
    want = []
    for r in range(4):
        want += [f"[rank {r}] hello from {r}", f"[rank {r}] second line"]
    assert out == want


def test_exception_on_one_rank_names_it_and_keeps_state(ranks_for):
    ranks = ranks_for(3)
    ranks.push(keep="me")

    def fail_on_1():
        if this_rank().rank == 1:
            raise ValueError("bad value on purpose")
        return "fine"

    with pytest.raises(RankError) as info:
        ranks.run(fail_on_1)
    err = info.value
    assert err.rank == 1 and err.exc_type == "ValueError"
    assert "bad value on purpose" in str(err) and "fail_on_1" in err.remote_traceback
    assert not err.restarted
    # no collective was involved: the pool and its state survive
    assert ranks.pull("keep") == ["me", "me", "me"]


def test_failure_while_others_wait_in_collective(ranks_for):
    ranks = ranks_for(3)
    pids = list(ranks.pids)

    def fail_then_collective():
        if this_rank().rank == 2:
            raise ZeroDivisionError("rank 2 fails before the all-reduce")
        x = torch.ones(1)
        dist.all_reduce(x)  # ranks 0, 1 would wait for rank 2 until the timeout
        return x.item()

    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        ranks.run(fail_then_collective)
    elapsed = time.monotonic() - t0
    assert info.value.rank == 2 and info.value.exc_type == "ZeroDivisionError"
    assert info.value.restarted
    assert elapsed < ranks.timeout  # the grace period, not the collective timeout
    # the pool rebuilds itself on the next call
    assert [r[2] for r in ranks.run(_rank_and_sum)] == [3.0] * 3
    assert set(ranks.pids).isdisjoint(pids)


@pytest.fixture(scope="module")
def quick_timeout():
    """Two ranks whose collectives time out after 3 s (the session's pools wait 10 s):
    started once for this module, for the test that waits for a timeout."""
    with Ranks(2, timeout=3.0) as ranks:
        yield ranks


def test_mismatched_collective_times_out_and_recovers(quick_timeout):
    ranks = quick_timeout

    def only_rank_0_reduces():
        if this_rank().rank == 0:
            x = torch.ones(1)
            dist.all_reduce(x)  # rank 1 never joins
        return "done"

    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        ranks.run(only_rank_0_reduces)
    elapsed = time.monotonic() - t0
    assert info.value.rank == 0 and info.value.restarted
    assert elapsed < ranks.timeout + 10
    assert ranks.run(lambda: this_rank().rank) == [0, 1]


def test_dead_rank_detected_and_recovers(ranks_for):
    ranks = ranks_for(2)

    def die_on_1():
        if this_rank().rank == 1:
            os._exit(7)
        return "alive"

    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        ranks.run(die_on_1)
    assert time.monotonic() - t0 < 10
    assert info.value.rank == 1 and info.value.exc_type == "RankDied"
    assert "exit code 7" in str(info.value)
    assert ranks.run(lambda: this_rank().rank) == [0, 1]

    def imported():  # (nothing of the engine imported by this call or the one above)
        import sys

        engine = ("shardlab.ops", "shardlab.patch", "torch._dynamo")
        return sorted(m for m in engine if m in sys.modules)

    # the new ranks were forked with the engine imported (shardlab.runtime.launch.PRELOAD):
    # their first sharded call imports nothing
    assert ranks.run(imported) == [["shardlab.ops", "shardlab.patch", "torch._dynamo"]] * 2


def test_unpicklable_function_is_a_clear_error(ranks_for):
    import threading

    lock = threading.Lock()
    with pytest.raises(TypeError, match="picklable"):
        ranks_for(2).run(lambda: lock.locked())
    with pytest.raises(TypeError, match="callable"):
        ranks_for(2).run(42)
    assert ranks_for(2).run(lambda: 1) == [1, 1]


def test_attach_mode_inside_a_rank(ranks_for):
    """On a rank (RANK, WORLD_SIZE set, as under torchrun) Ranks() runs in place."""

    def inner():
        with Ranks() as here:
            assert here.attached
            return here.run(lambda: this_rank().rank * 10)

    assert ranks_for(3).run(inner) == [[0, 10, 20]] * 3

    def inner_error():
        here = Ranks()
        return here.run(lambda: 1 / (this_rank().rank - 1))

    with pytest.raises(RankError) as info:
        ranks_for(3).run(inner_error)
    assert "ZeroDivisionError" in str(info.value)


def _children():
    import multiprocessing

    return {p.pid for p in multiprocessing.active_children()}


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(n=0), ValueError, "positive int"),
        (dict(n=-2), ValueError, "positive int"),
        (dict(n="2"), ValueError, "positive int"),
        (dict(n=2.0), ValueError, "positive int"),
        (dict(n=2, backend="mpi"), ValueError, "supported backends"),
        (dict(n=2, timeout=0), ValueError, "timeout"),
        (dict(n=2, start_method="fork"), ValueError, "start_method"),
        (dict(n=2, device="tpu"), ValueError, "device='tpu'.*'cpu', 'cuda' and 'auto'"),
        (dict(n=2, backend="nccl", device="cpu"), ValueError, "nccl needs CUDA"),
    ],
)
def test_bad_arguments(kwargs, exc, match):
    before = _children()
    with pytest.raises(exc, match=match):
        Ranks(**kwargs)
    assert _children() == before


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine with GPUs")
def test_nccl_without_gpus_is_a_clear_error():
    before = _children()
    with pytest.raises(RuntimeError, match="GPUs"):
        Ranks(2, backend="nccl")
    assert _children() == before


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine with GPUs")
def test_cuda_without_gpus_is_a_clear_error_and_auto_is_cpu():
    before = _children()
    with pytest.raises(RuntimeError, match="device='cuda'.*sees no GPU"):
        Ranks(2, device="cuda")
    assert _children() == before
    with Ranks(1, device="auto") as ranks:
        assert ranks.device == "cpu" and "device='cpu'" in repr(ranks)
        assert ranks.run(lambda: shardlab.this_rank().device.type) == ["cpu"]


def test_closed_pool_refuses_calls():
    with Ranks(1) as ranks:
        assert ranks.run(lambda: "x") == ["x"]
        assert "running" in repr(ranks)
    assert "closed" in repr(ranks)
    with pytest.raises(RuntimeError, match="closed"):
        ranks.run(lambda: 1)
    ranks.close()  # twice is fine


def test_this_rank_outside_a_rank():
    with pytest.raises(RuntimeError, match="only available on a rank"):
        shardlab.this_rank()
