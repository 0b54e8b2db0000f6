"""A long session on one pool: many mixed calls, failures among them, nothing grows.

Run: ``python benchmarks/soak.py [--minutes 10] [--ranks 4] [--calls 10000]``

One :class:`shardlab.Ranks` pool runs ``--calls`` calls spread over ``--minutes`` (idle
gaps between them, as in a notebook), a mix of what a workshop does all day, in a fixed
order:

* collectives (all-reduce, broadcast, all-gather) of varied sizes;
* ShardTensor work: an image cut unevenly along H through a patched conv, group norm
  and pooling, forward and backward; a redistribute; a 2-D mesh made again with torch's
  ``init_device_mesh`` (as a re-run cell does);
* every 500th call an exception on one rank, every 1000th a rank that dies
  (``os._exit``), every 1500th an interrupt (SIGINT to this process, as Jupyter's
  button sends) while the ranks sleep.

Each failure must come back as a :class:`shardlab.RankError` (the interrupt as
``KeyboardInterrupt``, as in a notebook), and the next call must work. Every 500 calls it
samples each rank's threads, open files and resident memory from ``/proc`` and prints a
row; at the end, the first sample after warm-up against the last (flat means: threads
and files equal, memory within 5 %). Exit status 1 when something grew or a failure came
back as anything else.
"""

from __future__ import annotations

import argparse
import os
import signal
import threading
import time


def _sample():
    status = dict(line.split(":", 1) for line in open("/proc/self/status"))
    rss = int(status["VmRSS"].split()[0]) // 1024
    return int(status["Threads"]), len(os.listdir("/proc/self/fd")), rss


def _collective(i):
    import torch
    import torch.distributed as dist

    from shardlab import this_rank

    me = this_rank()
    n = 1 + (i * 37) % 4096
    x = torch.full((n,), float(me.rank))
    if i % 3 == 0:
        dist.all_reduce(x)
        return float(x[0])
    if i % 3 == 1:
        dist.broadcast(x, src=0)
        return float(x[0])
    out = [torch.empty_like(x) for _ in range(me.world_size)]
    dist.all_gather(out, x)
    return float(sum(o[0] for o in out))


def _shard_tensor_work(i):
    import torch
    import torch.nn.functional as F
    from torch.distributed.tensor import Shard

    import shardlab
    from shardlab import this_rank

    me = this_rank()
    g = torch.Generator().manual_seed(i)
    img = torch.randn(1, 2, 11 + i % 7, 6, generator=g, requires_grad=True)
    w = torch.randn(3, 2, 3, 3, generator=g, requires_grad=True)
    with shardlab.patched():
        x = shardlab.distribute(img, me.mesh, [Shard(2)])
        y = F.max_pool2d(F.group_norm(F.conv2d(x, w, padding=1), 3), 2, ceil_mode=True)
        y.square().sum().backward()
        z = y.redistribute(me.mesh, [Shard(3)]).full_tensor()
    return float(z.detach().sum())


def _mesh_again(i):
    from torch.distributed.device_mesh import init_device_mesh

    from shardlab import this_rank

    w = this_rank().world_size
    shape = (2, w // 2) if w % 2 == 0 and w > 2 else (w,)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("a", "b")[: len(shape)])
    return mesh.ndim


def _fail_on_one(i):
    from shardlab import this_rank

    if this_rank().rank == i % this_rank().world_size:
        raise ZeroDivisionError(f"call {i} fails on one rank")
    return 0


def _die_on_one(i):
    from shardlab import this_rank

    if this_rank().rank == i % this_rank().world_size:
        os._exit(7)
    return 0


def _sleep(i):
    time.sleep(10)
    return 0


def main() -> int:
    import shardlab

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--calls", type=int, default=10_000)
    a = ap.parse_args()
    # Python's own SIGINT handler, as a Jupyter kernel has one: a shell's background job
    # (``cmd &`` without job control, ``nohup``) starts with SIGINT ignored, and the
    # interrupts below would then do nothing
    signal.signal(signal.SIGINT, signal.default_int_handler)

    work = [_collective, _collective, _shard_tensor_work, _collective, _mesh_again]
    failures = {"exception": 0, "death": 0, "interrupt": 0}
    wrong: list[str] = []
    samples: list[tuple[int, float, list]] = []
    start = time.monotonic()
    with shardlab.Ranks(a.ranks, timeout=30) as ranks:
        head = f"{'calls':>6} {'min':>5} {'threads':>8} {'files':>6} {'RSS MiB':>8}"
        print(head, "(max over ranks)")
        i = 0
        while i < a.calls:
            i += 1
            try:
                if i % 1500 == 0:
                    timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT))
                    timer.start()
                    try:
                        ranks.run(_sleep, i)
                        wrong.append(f"call {i}: the interrupt did not stop the ranks")
                    except KeyboardInterrupt:
                        failures["interrupt"] += 1
                elif i % 1000 == 0:
                    ranks.run(_die_on_one, i)
                    wrong.append(f"call {i}: a rank died and nothing was raised")
                elif i % 500 == 0:
                    ranks.run(_fail_on_one, i)
                    wrong.append(f"call {i}: a rank raised and nothing was raised")
                else:
                    ranks.run(work[i % len(work)], i)
            except shardlab.RankError as e:
                failures["death" if e.exc_type == "RankDied" else "exception"] += 1
                if i % 500:
                    wrong.append(f"call {i}: {e}"[:300])
            except Exception as e:  # noqa: BLE001
                wrong.append(f"call {i}: {type(e).__name__} instead of a RankError: {e}"[:300])
            pause = start + i * a.minutes * 60 / a.calls - time.monotonic()
            if pause > 0:  # calls spread over the session, idle gaps between them
                time.sleep(pause)
            if i % 500 == 250:  # between failures: the pool as it runs
                row = ranks.run(_sample)
                samples.append((i, (time.monotonic() - start) / 60, row))
                top = [max(r[k] for r in row) for k in range(3)]
                print(f"{i:>6} {samples[-1][1]:>5.1f} {top[0]:>8} {top[1]:>6} {top[2]:>8}")
        elapsed = (time.monotonic() - start) / 60
    print(f"\n{i} calls in {elapsed:.1f} min on {a.ranks} ranks; failures raised as expected:")
    print(f"  {failures}")
    grew = []
    if len(samples) >= 3:
        first, last = samples[1][2], samples[-1][2]  # (the first after warm-up)
        for r, (f, la) in enumerate(zip(first, last)):
            if la[0] > f[0] or la[1] > f[1] or la[2] > f[2] * 1.05:
                grew.append(f"rank {r}: threads/files/RSS {f} -> {la}")
        print(f"  rank 0 after warm-up {first[0]} -> at the end {last[0]} (threads, files, MiB)")
    for line in wrong + grew:
        print("  PROBLEM:", line)
    print("flat, every failure a RankError" if not (wrong or grew) else "NOT flat / wrong")
    return 1 if (wrong or grew) else 0


if __name__ == "__main__":
    raise SystemExit(main())
