"""Domain-parallel convolution: bytes per rank, peak memory per rank, patch overhead.

Run: ``python benchmarks/bench_conv.py [--size 1024] [--channels 16] [--ranks 4]``.

1. Bytes each rank sends for one nn.Conv2d(k=3, padding=1) forward on an image sharded
   over H, against the receptive-field lower bound and against DTensor's own conv2d on
   the same layout (which exchanges nothing and returns a wrong result, see DESIGN.md).
2. Peak memory per rank of forward + backward of 3 conv layers: the growth of the
   process's peak RSS (``ru_maxrss``) during the step, each configuration in a fresh
   pool, with glibc's mmap threshold pinned so that tensors are mmapped and RSS follows
   live tensor memory.
   Target: at most 1/N of single device plus the halo, +10 %.
3. Overhead of a patched ``F.conv2d`` call on plain tensors against the unpatched one.
   Target: at most 2 us or 2 %.
4. Halo exchange overlapped with the convolution: the exchange alone (post, then wait
   for every message) against what is left to wait for once the convolution of the
   window has run (``_conv_overlap``: the messages travel meanwhile); hidden = 1 - left
   / exchange. Also one forward with the overlap on and off (``conv.halo_overlap``).
   Median of ``--reps``, slowest rank.
"""

from __future__ import annotations

import argparse
import timeit


def _memory_step(size, channels, sharded, warmup=True):
    import resource

    from _common import fixed_mmap_threshold

    fixed_mmap_threshold()
    if warmup:  # first calls initialise caches and buffers: not the step's memory
        _memory_step(max(size // 16, 16), channels, sharded, warmup=False)

    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import Shard

    import shardlab
    from shardlab.layout import chunk_sizes

    torch.manual_seed(0)
    me, n = dist.get_rank(), dist.get_world_size()
    model = torch.nn.Sequential(
        *[torch.nn.Conv2d(channels, channels, 3, padding=1) for _ in range(3)]
    )
    rows = chunk_sizes(size, n)[me] if sharded else size
    local = torch.randn(1, channels, rows, size)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    with shardlab.patched():
        x = (
            shardlab.ShardTensor.from_local(local, shardlab.this_rank().mesh, [Shard(2)])
            if sharded
            else local.requires_grad_()
        )
        y = model(x)
        loss = y.square().sum()
        loss = loss.full_tensor() if sharded else loss
        loss.backward()
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return after - before, local.numel() * 4


def _bytes(size, channels):
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard

    import shardlab
    from shardlab.layout import chunk_sizes, conv_plan

    me, n = dist.get_rank(), dist.get_world_size()
    mesh = shardlab.this_rank().mesh
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(channels, channels, 3, padding=1)
    img = torch.randn(1, channels, size, size)
    sizes = list(chunk_sizes(size, n))
    with shardlab.patched():
        x = shardlab.distribute(img, mesh, [Shard(2)], sizes=[sizes])
        with shardlab.trace() as t:
            y = conv(x)
    ours = t.bytes(kind="send")
    bound = conv_plan(sizes, 3, 1, 1, (1, 1)).bytes_per_element_sent(me) * channels * size * 4
    ref = conv(img)
    err_ours = (y.full_tensor() - ref).abs().max().item()
    try:
        from torch.distributed.tensor import Replicate, distribute_tensor

        dx = DTensor.from_local(x.to_local().detach(), mesh, [Shard(2)])
        dw = distribute_tensor(conv.weight.detach(), mesh, [Replicate()])
        db = distribute_tensor(conv.bias.detach(), mesh, [Replicate()])
        with shardlab.trace() as t2:
            dy = torch.nn.functional.conv2d(dx, dw, db, padding=1)
        theirs = t2.bytes(kind="send") + t2.bytes(kind="all_reduce")
        local = dy.to_local() if isinstance(dy, DTensor) else dy
        start = sum(sizes[:me])
        err_theirs = (
            (local - ref[:, :, start : start + sizes[me]]).abs().max().item()
            if local.shape == ref[:, :, start : start + sizes[me]].shape
            else float("nan")
        )
        theirs = f"{theirs} B, max error {err_theirs:.2g}"
    except Exception as exc:  # noqa: BLE001
        theirs = f"error: {type(exc).__name__}"
    return ours, bound, err_ours, theirs


def _overlap(size, channels, reps):
    import statistics
    import time

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.tensor import Shard

    import shardlab
    from shardlab.comm.halo import peers_along, post_halo
    from shardlab.demo._common import gather
    from shardlab.layout import chunk_sizes, conv_plan
    from shardlab.ops import _conv_overlap
    from shardlab.ops import conv as C

    me, n = dist.get_rank(), dist.get_world_size()
    mesh = shardlab.this_rank().mesh
    torch.manual_seed(0)
    w = torch.randn(channels, channels, 3, 3)
    sizes = list(chunk_sizes(size, n))
    local = torch.randn(1, channels, sizes[me], size)  # (1, C, H_local, W)
    x = shardlab.ShardTensor.from_local(local, mesh, [Shard(2)], [sizes])
    plan, (peers, pos) = conv_plan(sizes, 3, 1, 1, (1, 1)), peers_along(mesh, 0)
    left = []  # seconds the overlapped convolution still waited for its messages

    class Timed:
        def __init__(self, work):
            self.work = work

        def wait(self):
            t0 = time.perf_counter()
            self.work.wait()
            left[-1] += time.perf_counter() - t0

    def timed_post(*args):
        bufs, works = post_halo(*args)
        left.append(0.0)
        return bufs, [Timed(w) for w in works]

    def forward(on):
        with shardlab.patched(), C.halo_overlap(on), torch.no_grad():
            F.conv2d(x, w, None, 1, 1)

    def exchange():
        for work in post_halo(local, plan, peers, pos, 2, sum(sizes[:me]), "bench")[1]:
            work.wait()

    steps = {"on": lambda: forward(True), "off": lambda: forward(False), "exchange": exchange}
    times: dict = {k: [] for k in steps}
    _conv_overlap.post_halo = timed_post
    try:
        for _ in range(reps + 1):  # the first round warms up
            for k, fn in steps.items():
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                times[k].append(time.perf_counter() - t0)
    finally:
        _conv_overlap.post_halo = post_halo
    times["left"] = left
    return {k: max(gather(statistics.median(v[1:]))) for k, v in times.items()}


def _overhead(reps=20000, rounds=9):
    """Best-of-``rounds`` per-call time, plain and patched rounds interleaved."""
    import torch
    import torch.nn.functional as F

    import shardlab

    x, w = torch.randn(1, 1, 8, 8), torch.randn(1, 1, 3, 3)
    call = lambda: F.conv2d(x, w)  # noqa: E731
    best = {"plain": float("inf"), "patched": float("inf")}
    for _ in range(rounds):
        best["plain"] = min(best["plain"], timeit.timeit(call, number=reps) / reps)
        with shardlab.patched():
            best["patched"] = min(best["patched"], timeit.timeit(call, number=reps) / reps)
    return best


def main() -> None:
    import shardlab

    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--channels", type=int, default=16)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--reps", type=int, default=9)
    a = ap.parse_args()
    n = a.ranks
    with shardlab.Ranks(n) as ranks:
        rows = ranks.run(_bytes, a.size, a.channels)
    print(
        f"## bytes sent per rank, nn.Conv2d({a.channels}, {a.channels}, 3, padding=1) on "
        f"(1, {a.channels}, {a.size}, {a.size}) float32 sharded over H on {n} ranks"
    )
    print("| rank | shardlab bytes | lower bound | max error | DTensor conv2d |")
    print("|---|---|---|---|---|")
    for r, (ours, bound, err, theirs) in enumerate(rows):
        print(f"| {r} | {ours} | {bound} | {err:.1e} | {theirs} |")
    with shardlab.Ranks(1) as one:
        single, _ = one.run(_memory_step, a.size, a.channels, False)[0]
    with shardlab.Ranks(n) as ranks:
        mem = ranks.run(_memory_step, a.size, a.channels, True)
    halo_bytes = 2 * a.channels * a.size * 4 * 3  # 2 halo rows per layer, 3 layers
    target = single / n + halo_bytes
    print(
        f"\n## peak memory growth of forward + backward (3 conv layers), MiB; "
        f"single device: {single / 2**20:.1f}"
    )
    print("| rank | peak growth | target (1/N + halo) + 10 % | within target |")
    print("|---|---|---|---|")
    for r, (peak, _) in enumerate(mem):
        print(
            f"| {r} | {peak / 2**20:.1f} | {1.1 * target / 2**20:.1f} | "
            f"{'yes' if peak <= 1.1 * target else 'no'} |"
        )
    best = _overhead()
    diff = best["patched"] - best["plain"]
    print(
        f"\n## patched F.conv2d on plain tensors (1x1x8x8, 3x3): plain "
        f"{best['plain'] * 1e6:.2f} us, patched {best['patched'] * 1e6:.2f} us, overhead "
        f"{diff * 1e6:.2f} us ({100 * diff / best['plain']:.1f} %)"
    )
    print(
        f"\n## halo exchange overlapped with the convolution: F.conv2d({a.channels} -> "
        f"{a.channels}, 3, padding=1) forward, H sharded, median of {a.reps}, slowest rank, ms"
    )
    print("| ranks | image | exchange alone | left to wait after the conv | hidden | "
          "forward, overlap off | forward, overlap on |")  # fmt: skip
    print("|---|---|---:|---:|---:|---:|---:|")
    for k in sorted({2, n}):
        for size in (a.size // 4, a.size):
            with shardlab.Ranks(k) as ranks:
                r = ranks.run(_overlap, size, a.channels, a.reps)[0]
            print(
                f"| {k} | {size} x {size} | {1e3 * r['exchange']:.2f} | {1e3 * r['left']:.2f} | "
                f"{100 * (1 - r['left'] / r['exchange']):.0f} % | {1e3 * r['off']:.1f} | "
                f"{1e3 * r['on']:.1f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
