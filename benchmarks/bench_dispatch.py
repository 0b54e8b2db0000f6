"""The per-op cost in Python: a local torch call, the same op on a DTensor, on a ShardTensor.

Run: ``python benchmarks/bench_dispatch.py [--reps 200] [--rounds 5] [--device cuda]``
(``--device cuda``: the ranks' tensors on the GPU, nccl on one rank, gloo ranks sharing it
on two; kernels waited for at the end of each round).

Tensor (4, 16·N, 32) cut along dim 1 on a 1- and a 2-rank gloo mesh (even sizes, so that
DTensor's layout is the same one), float32; median over ``rounds`` of the mean of ``reps``
calls, microseconds, on rank 0 (both ranks run the same loop; ops that communicate wait
for the other). ShardTensor's calls hit the decision cache after the first
(``shardlab/engine/decisions.py``) where its family has one. Ratio: ShardTensor / DTensor.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics


def _ops(dev="cpu"):
    import torch
    import torch.nn.functional as F

    w = torch.randn(32, 32, device=dev)
    img_w = torch.randn(4, 4, 3, 3, device=dev)
    return {
        "a + a": lambda a, d: a + a,
        "a * 2.0": lambda a, d: a * 2.0,
        "F.gelu": lambda a, d: F.gelu(a),
        "a.sum(-1)": lambda a, d: a.sum(-1),
        "a.softmax(-1)": lambda a, d: a.softmax(-1),
        "a @ W (W replicated)": lambda a, d: a @ d["W"],
        "a.transpose(0, 2)": lambda a, d: a.transpose(0, 2),
        "a.reshape(4, -1)": lambda a, d: a.reshape(4, -1),
        "a.view(4, 2, -1, 32) (sharded dim)": lambda a, d: a.view(4, 2, -1, 32),
        "F.layer_norm": lambda a, d: F.layer_norm(a, (32,)),
        "torch.cat([a, a], -1)": lambda a, d: torch.cat([a, a], -1),
        "F.conv2d (halos)": lambda a, d: F.conv2d(d["img"], img_w, padding=1),
        "SDPA (one block)": lambda a, d: F.scaled_dot_product_attention(d["q"], d["q"], d["q"]),
        "F.cross_entropy": lambda a, d: F.cross_entropy(d["logits"], d["target"]),
    }, w


def body(reps, rounds, trace_ops=False):
    import time

    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import shardlab

    mesh, dev = shardlab.this_rank().mesh, shardlab.this_rank().device
    n = dist.get_world_size()
    ops, w = _ops(dev)
    torch.manual_seed(0)
    x = torch.randn(4, 16 * n, 32, device=dev)
    img = torch.randn(1, 4, 16 * n, 16, device=dev)
    q = torch.randn(1, 2, 16 * n, 8, device=dev)
    logits = torch.randn(16 * n, 10, device=dev)
    target = torch.randint(0, 10, (16 * n,), device=dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else lambda: None
    gloo_on_cuda = dev.type == "cuda" and dist.get_backend() == "gloo" and n > 1

    def extras(kind):
        if kind == "local":
            return {"W": w, "img": img, "q": q, "logits": logits, "target": target}
        if kind == "dtensor":
            dt = lambda t, d: distribute_tensor(t, mesh, [Shard(d)])  # noqa: E731
            return {"W": distribute_tensor(w, mesh, [Replicate()]), "img": dt(img, 2),
                    "q": dt(q, 2), "logits": dt(logits, 0), "target": dt(target, 0)}  # fmt: skip
        st = lambda t, d: shardlab.distribute(t, mesh, [Shard(d)])  # noqa: E731
        return {"W": shardlab.distribute(w, mesh, [Replicate()]), "img": st(img, 2),
                "q": st(q, 2), "logits": st(logits, 0), "target": st(target, 0)}  # fmt: skip

    inputs = {
        "local": (x, extras("local")),
        "DTensor": (distribute_tensor(x, mesh, [Shard(1)]), extras("dtensor")),
        "ShardTensor": (shardlab.distribute(x, mesh, [Shard(1)]), extras("shard")),
    }
    table = {}
    for name, op in ops.items():
        for kind, (a, d) in inputs.items():
            # shardlab's patches for ShardTensors only: with them on, F.conv2d on a DTensor
            # would be shardlab's too
            if trace_ops:
                print(f"rank {dist.get_rank()}: {name} on {kind}", flush=True)
            if kind == "DTensor" and name.startswith("SDPA") and gloo_on_cuda:
                # DTensor's SDPA all-gathers the cut sequence; that functional all-gather of
                # CUDA tensors on gloo killed both ranks (SIGSEGV, torch 2.11, one H200)
                table[name, kind] = "crashes"
                continue
            with shardlab.patched() if kind == "ShardTensor" else contextlib.nullcontext():
                try:
                    for _ in range(5):
                        op(a, d)
                    means = []
                    for _ in range(rounds):
                        sync()
                        dist.barrier()
                        t0 = time.perf_counter()
                        for _ in range(reps):
                            op(a, d)
                        sync()  # on CUDA: the kernels too (they overlap the next calls)
                        means.append((time.perf_counter() - t0) / reps * 1e6)
                    table[name, kind] = statistics.median(means)
                except Exception as exc:  # DTensor refuses some (a cut view): say so
                    table[name, kind] = f"{type(exc).__name__}"
                    dist.barrier()
    return table


def main() -> None:
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from benchmarks._common import ranks_on

    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--worlds", default="1,2")
    ap.add_argument("--verbose", action="store_true", help="each rank prints each op it starts")
    a = ap.parse_args()
    ops, _ = _ops()
    for world in [int(w) for w in a.worlds.split(",")]:
        with ranks_on(world, a.device) as ranks:
            table = ranks.run(body, a.reps, a.rounds, a.verbose)[0]
        where = f"{ranks.backend} on {a.device}"
        print(f"\n## world {world} ({where}): tensor (4, {16 * world}, 32) float32, Shard(1), "
              "µs per call\n")  # fmt: skip
        print("| op | local torch | DTensor | ShardTensor | ShardTensor / DTensor |")
        print("|---|---:|---:|---:|---:|")
        ratios = []
        for name in ops:
            row = [table[name, k] for k in ("local", "DTensor", "ShardTensor")]
            fmt = [f"{v:.1f}" if isinstance(v, float) else v for v in row]
            ratio = row[2] / row[1] if all(isinstance(v, float) for v in row[1:]) else None
            if ratio is not None:
                ratios.append(ratio)
            print(f"| {name} | {' | '.join(fmt)} | {'' if ratio is None else f'{ratio:.1f}'} |")
        print(f"\nmedian ratio {statistics.median(ratios):.1f}, max {max(ratios):.1f} "
              f"(over the {len(ratios)} ops DTensor runs)")  # fmt: skip


if __name__ == "__main__":
    main()
