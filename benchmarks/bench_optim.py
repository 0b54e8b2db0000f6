"""Optimizer steps on cut parameters: ``AdamW`` with ``foreach=True`` (torch's GPU default),
``fused=True`` and ``foreach=False``, on a stack of ``--layers`` linear layers (width
``--width``) whose weights are cut along their output dim (uneven: 1 : 2 : ... : n) and
biases replicated, against the same step on plain tensors of one rank's size.

Run: ``python benchmarks/bench_optim.py [--ranks 1 2] [--layers 24] [--width 256]``.
One step is ``optimizer.step()`` alone (the gradients are set once); times are the median
of ``--reps`` steps, barrier to barrier (the slowest rank), in ms. "plain" is the same
optimizer on plain tensors shaped like rank 0's blocks: what the arithmetic costs without
ShardTensor; the ratio is the ShardTensor step over it. "even": the same weights cut
with ``torch.chunk`` sizes, as a ShardTensor and as a DTensor (DTensor knows only those):
what the step costs on each.
"""

from __future__ import annotations

import argparse
import statistics
import time


def body(layers, width, reps):
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import shardlab

    mesh = shardlab.this_rank().mesh
    n = mesh.size()
    weights = list(range(1, n + 1))
    sizes = [width * w // sum(weights) for w in weights]
    sizes[-1] += width - sum(sizes)
    torch.manual_seed(0)
    cut, even, dt, plain = [], [], [], []
    for _ in range(layers):
        w = torch.randn(width, width)
        b = torch.randn(width)
        cut.append(shardlab.distribute(w, mesh, [Shard(0)], [sizes]).requires_grad_())
        cut.append(shardlab.distribute(b, mesh, [Replicate()]).requires_grad_())
        even.append(shardlab.distribute(w, mesh, [Shard(0)]).requires_grad_())  # chunk sizes
        even.append(shardlab.distribute(b, mesh, [Replicate()]).requires_grad_())
        dt.append(distribute_tensor(w, mesh, [Shard(0)]).requires_grad_())
        dt.append(distribute_tensor(b, mesh, [Replicate()]).requires_grad_())
        plain.append(w[: sizes[0]].clone().requires_grad_())
        plain.append(b.clone().requires_grad_())
    for p in cut + even + dt + plain:
        p.grad = torch.randn_like(p) * 1e-3
    rows = {}
    for mode in ("foreach", "fused", "loop"):
        opts = {"foreach": mode == "foreach", "fused": mode == "fused" or None}
        if mode != "fused":
            opts.pop("fused")
        times = {}
        groups = (("ShardTensor", cut), ("even", even), ("DTensor", dt), ("plain", plain))
        for name, params in groups:
            opt = torch.optim.AdamW(params, lr=1e-3, **opts)
            opt.step()  # states made
            samples = []
            for _ in range(reps):
                dist.barrier()
                t0 = time.perf_counter()
                opt.step()
                dist.barrier()
                samples.append(time.perf_counter() - t0)
            times[name] = statistics.median(samples) * 1e3
        rows[mode] = times
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--reps", type=int, default=21)
    a = parser.parse_args()
    import shardlab

    print(f"AdamW step, {a.layers} layers of ({a.width}, {a.width}) + bias, weights cut 1:2:..:n")
    print(
        "| ranks | mode | ShardTensor ms | plain ms | ShardTensor / plain "
        "| ShardTensor, even ms | DTensor, even ms | ShardTensor / DTensor (even) |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for n in a.ranks:
        with shardlab.Ranks(n) as ranks:
            rows = ranks.run(body, a.layers, a.width, a.reps)[0]
        for mode, t in rows.items():
            print(
                f"| {n} | {mode} | {t['ShardTensor']:.2f} | {t['plain']:.2f} "
                f"| {t['ShardTensor'] / t['plain']:.1f} | {t['even']:.2f} | {t['DTensor']:.2f} "
                f"| {t['even'] / t['DTensor']:.2f} |"
            )


if __name__ == "__main__":
    main()
