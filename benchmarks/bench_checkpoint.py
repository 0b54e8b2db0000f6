"""Distributed checkpoints: time of ``dcp.save`` / ``dcp.load`` and bytes on disk, for a
ShardTensor with uneven sizes against the same tensor as a plain DTensor (even sizes).

Run: ``python benchmarks/bench_checkpoint.py [--ranks 2 4] [--mib 1 16 64] [--reps 9]``.
The tensor is float32 (rows, 1024), cut along the rows: the ShardTensor's pieces grow
1 : 2 : ... : n (4 ranks: 10 %, 20 %, 30 %, 40 % of the rows), the DTensor's are
``torch.chunk``'s. Times are the median of ``--reps`` calls, barrier to barrier (the
slowest rank); "reshard" loads the ShardTensor's checkpoint into the even DTensor.
Bytes: the size of the checkpoint directory (data files and ``.metadata``); the last
column is what the ShardTensor's checkpoint takes beyond the DTensor's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def body(mib, reps, root):
    import warnings

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import Shard, distribute_tensor

    import shardlab

    warnings.filterwarnings("ignore", message="Detected an existing checkpoint")
    mesh = shardlab.this_rank().mesh
    n = dist.get_world_size()
    rows = mib * 256  # x 1024 float32 = mib MiB
    weights = list(range(1, n + 1))
    sizes = [rows * w // sum(weights) for w in weights]
    sizes[-1] += rows - sum(sizes)
    g = torch.randn(rows, 1024, generator=torch.Generator().manual_seed(0))
    tensors = {
        "ShardTensor": (shardlab.distribute(g, mesh, [Shard(0)], sizes),
                        shardlab.distribute(torch.zeros_like(g), mesh, [Shard(0)], sizes)),
        "DTensor": (distribute_tensor(g, mesh, [Shard(0)]),
                    distribute_tensor(torch.zeros_like(g), mesh, [Shard(0)])),
    }  # fmt: skip

    def timed(fn):
        out = []
        for _ in range(reps):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            dist.barrier()
            out.append(time.perf_counter() - t0)
        return statistics.median(out)

    res = {}
    for name, (src, dst) in tensors.items():
        path = f"{root}/{mib}-{n}-{name}"
        save = timed(lambda src=src, path=path: dcp.save({"x": src}, checkpoint_id=path))
        load = timed(lambda dst=dst, path=path: dcp.load({"x": dst}, checkpoint_id=path))
        assert torch.equal(dst.to_local(), src.to_local()), name
        res[name] = [save, load, dir_bytes(path)]
    target = tensors["DTensor"][1]
    target.to_local().zero_()
    path = f"{root}/{mib}-{n}-ShardTensor"
    res["ShardTensor"].append(timed(lambda: dcp.load({"x": target}, checkpoint_id=path)))
    assert torch.equal(target.full_tensor(), g)
    return res


def main() -> None:
    import shutil
    import tempfile
    import warnings

    import shardlab

    warnings.filterwarnings("ignore")
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--mib", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--reps", type=int, default=9)
    a = ap.parse_args()
    mib = 2**20
    print("float32 (rows, 1024) cut along rows, gloo ranks, checkpoints on local disk")
    print(
        "| ranks | tensor MiB | ShardTensor sizes | save ms ShardTensor | save ms DTensor | "
        "load ms ShardTensor | load ms DTensor | reshard ms | disk MiB DTensor | "
        "disk bytes, ShardTensor - DTensor |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    root = tempfile.mkdtemp(prefix="bench_checkpoint_")
    try:
        for n in a.ranks:
            with shardlab.Ranks(n) as ranks:
                for size in a.mib:
                    r = ranks.run(body, size, a.reps, root)[0]
                    (s1, l1, b1, re), (s2, l2, b2) = r["ShardTensor"], r["DTensor"]
                    shares = "1:" + ":".join(str(i) for i in range(2, n + 1))
                    print(
                        f"| {n} | {size} | {shares} | {s1 * 1e3:.0f} | {s2 * 1e3:.0f} | "
                        f"{l1 * 1e3:.0f} | {l2 * 1e3:.0f} | {re * 1e3:.0f} | "
                        f"{b2 / mib:.3f} | {b1 - b2:+d} |"
                    )
                    shutil.rmtree(root)
                    os.makedirs(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
