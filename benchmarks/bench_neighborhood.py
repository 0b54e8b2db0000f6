"""Neighborhood attention (na2d) on an image cut along H: bytes, peak memory, time.

Run: ``python benchmarks/bench_neighborhood.py [--ranks 4] [--size 256] [--kernel 7]``.

q, k, v of shape (1, S, S, 4, 32) float32 (heads-last, NATTEN's layout), kernel k x k,
H cut in equal blocks over the ranks; forward + backward of ``sum(out * g)``. Bytes: what
each rank receives (the tracer) against the halo lower bound (the K and V rows its queries
see and it does not own). Peak: live tensor memory created during the step
(``shardlab.demo._common.LiveBytes``), against the same step on one device (rank 0 alone)
and against the (tokens x tokens) score matrix a dense masked attention would hold.
Times: one thread per rank; the ranks share this machine's cores (indicative only).
"""

from __future__ import annotations

import argparse


def body(size, kernel, heads, dim, reps):
    import time

    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import Shard

    import shardlab
    from shardlab.demo._common import gather, peak_bytes
    from shardlab.layout import chunk_sizes
    from shardlab.layout.neighborhood import neighbors
    from shardlab.ops.neighborhood import na2d

    torch.set_num_threads(1)
    mesh, me, n = shardlab.this_rank().mesh, dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(0)
    full = [torch.randn(1, size, size, heads, dim, generator=gen) for _ in "qkvg"]
    sizes = chunk_sizes(size, n)
    a = sum(sizes[:me])

    def step(x):
        leaves = [t.detach().requires_grad_() for t in x[:3]]
        if x is full:
            out = na2d(*leaves, kernel)
            (out * x[3]).sum().backward()
        else:
            sh = [
                shardlab.ShardTensor.from_local(t, mesh, [Shard(1)], [sizes], validate=False)
                for t in leaves
            ]
            out = na2d(*sh, kernel)
            (out.to_local() * x[3]).sum().backward()
        return out

    mine = [t[:, a : a + sizes[me]].clone() for t in full]
    res = {}
    with shardlab.trace() as t:
        step(mine)
    res["recv"] = sum(e.bytes for e in t.events if e.kind == "recv" and "forward" in e.label)
    res["recv_bwd"] = sum(e.bytes for e in t.events if e.kind == "recv" and "backward" in e.label)
    rows = {j for i in range(a, a + sizes[me]) for j in neighbors(size, kernel, 1, False)[i]}
    foreign = len([j for j in rows if not a <= j < a + sizes[me]])
    res["bound"] = foreign * size * heads * dim * 4 * 2  # K and V rows, float32
    res["peak"] = peak_bytes(lambda: step(mine), torch.device("cpu"))
    times = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        step(mine)
        times.append(time.perf_counter() - t0)
    res["s"] = max(gather(sorted(times)[len(times) // 2]))
    if me == 0:
        res["single_peak"] = peak_bytes(lambda: step(full), torch.device("cpu"))
        t0 = time.perf_counter()
        step(full)
        res["single_s"] = time.perf_counter() - t0
    dist.barrier()
    return gather(res)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--size", type=int, default=256)
    p.add_argument("--kernel", type=int, default=7)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--reps", type=int, default=2)
    a = p.parse_args()

    import shardlab

    with shardlab.Ranks(a.ranks, timeout=1800) as ranks:  # rank 0 alone runs one device
        rows = ranks.run(body, a.size, a.kernel, a.heads, a.dim, a.reps)[0]
    tokens = a.size * a.size
    print(
        f"na2d on (1, {a.size}, {a.size}, {a.heads}, {a.dim}) float32, kernel {a.kernel}x"
        f"{a.kernel}, H cut over {a.ranks} gloo ranks, forward + backward\n"
    )
    print("| rank | recv fwd KiB | lower bound KiB | recv bwd KiB | peak MiB | / 1 device |")
    print("|---:|---:|---:|---:|---:|---:|")
    single = rows[0]["single_peak"]
    for r, x in enumerate(rows):
        print(
            f"| {r} | {x['recv'] / 1024:.0f} | {x['bound'] / 1024:.0f} | "
            f"{x['recv_bwd'] / 1024:.0f} | {x['peak'] / 2**20:.1f} | "
            f"{x['peak'] / single:.3f} |"
        )
    dense = tokens * tokens * a.heads * 4 / 2**20
    print(
        f"\none device: peak {single / 2**20:.1f} MiB, {rows[0]['single_s']:.2f} s; "
        f"sharded step {rows[0]['s']:.2f} s (slowest rank); a dense masked attention "
        f"would hold {dense:.0f} MiB of scores"
    )


if __name__ == "__main__":
    main()
