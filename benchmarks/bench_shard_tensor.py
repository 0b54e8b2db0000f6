"""ShardTensor: bytes and time of scatter_tensor and redistribute, against DTensor's own
calls for the same even layout and against the lower bound.

Run: ``python benchmarks/bench_shard_tensor.py [--ranks 4] [--rows 2048 --cols 512]``.
Bytes are what one rank *receives* (the busiest rank), from the shardlab tracer: a
point-to-point ``recv`` counts its size; collectives count what a ring algorithm
delivers to each rank (all_gather: (n-1) x input, all_reduce: 2 (n-1)/n x input,
broadcast: the tensor on non-root ranks, scatter: the rank's chunk).
The lower bound is what must reach the busiest rank: the elements of its new block
that it did not hold before.
"""

from __future__ import annotations

import argparse
import time


def body(rows, cols, reps):
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

    import shardlab
    from shardlab import scatter_tensor
    from shardlab.layout import ShardLayout, redistribute_plan

    mesh = shardlab.this_rank().mesh
    me, n = dist.get_rank(), dist.get_world_size()
    g = torch.randn(rows, cols)
    rows_out = []

    def timed(fn):
        fn()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        dist.barrier()
        return (time.perf_counter() - t0) / reps

    def traced(fn):
        with shardlab.trace() as t:
            fn()
        got = [None] * n
        dist.all_gather_object(got, t.events)
        from shardlab.trace import Trace

        all_t = Trace([e for evs in got for e in evs])
        from _common import received_bytes

        return max(received_bytes(all_t.events, r) for r in range(n))

    # scatter from rank 0: each rank's own shard is the lower bound
    ours = lambda: scatter_tensor(g if me == 0 else None, 0, mesh, [Shard(0)])  # noqa: E731
    theirs = lambda: distribute_tensor(g, mesh, [Shard(0)], src_data_rank=0)  # noqa: E731
    bound = (rows // n) * cols * 4
    rows_out.append(
        (
            "scatter Shard(0) from rank 0",
            traced(ours),
            traced(theirs),
            bound,
            timed(ours),
            timed(theirs),
        )
    )

    pairs = [
        ("Shard(0) -> Replicate", [Shard(0)], [Replicate()]),
        ("Shard(0) -> Shard(1)", [Shard(0)], [Shard(1)]),
        ("Replicate -> Shard(0)", [Replicate()], [Shard(0)]),
        ("Partial -> Replicate", [Partial()], [Replicate()]),
        ("Partial -> Shard(0)", [Partial()], [Shard(0)]),
    ]
    for name, src, dst in pairs:
        st = shardlab.distribute(g, mesh, src)
        dt = (
            distribute_tensor(g, mesh, src)
            if not isinstance(src[0], Partial)
            else torch.distributed.tensor.DTensor.from_local(st.to_local(), mesh, src)
        )
        ours = lambda st=st, dst=dst: st.redistribute(mesh, dst)  # noqa: E731
        theirs = lambda dt=dt, dst=dst: dt.redistribute(mesh, dst)  # noqa: E731
        if isinstance(src[0], Partial):  # every rank must receive the other parts' sums
            lay = ShardLayout.build((rows, cols), (n,), dst)
            mine = lay.numel((me,))
            bound = (
                mine * (n - 1) / n * 2 * 4 if isinstance(dst[0], Replicate) else mine * (n - 1) * 4
            )
        else:
            plan = redistribute_plan(
                ShardLayout.build((rows, cols), (n,), src),
                ShardLayout.build((rows, cols), (n,), dst),
            )
            bound = (
                max(sum(m.numel for m in plan if m.dst == (r,) and not m.local) for r in range(n))
                * 4
            )
        rows_out.append((name, traced(ours), traced(theirs), bound, timed(ours), timed(theirs)))
    return rows_out


def main() -> None:
    import shardlab

    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--cols", type=int, default=512)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    with shardlab.Ranks(a.ranks) as ranks:
        res = ranks.run(body, a.rows, a.cols, a.reps)[0]
    mib = 2**20
    print(
        f"{a.ranks} gloo ranks, float32 ({a.rows}, {a.cols}) = {a.rows * a.cols * 4 / mib:.1f} "
        "MiB; bytes received by the busiest rank"
    )
    print(
        "| op | shardlab MiB | DTensor MiB | lower bound MiB | shardlab / bound | "
        "shardlab ms | DTensor ms |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, ours, theirs, bound, t_ours, t_theirs in res:
        ratio = ours / bound if bound else float("nan")
        print(
            f"| {name} | {ours / mib:.2f} | {theirs / mib:.2f} | {bound / mib:.2f} | "
            f"{ratio:.2f} | {t_ours * 1e3:.1f} | {t_theirs * 1e3:.1f} |"
        )


if __name__ == "__main__":
    main()
