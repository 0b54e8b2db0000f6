"""Activation checkpointing on a domain-parallel U-Net: peak memory per rank and step time,
with and without ``torch.utils.checkpoint`` around each block.

Run: ``python benchmarks/bench_recompute.py [--size 256] [--width 8] [--ranks 4]``.

The U-Net of ``bench_unet.py`` (conv, batch norm, max pool, conv_transpose, bilinear
upsampling, skip connections), H cut unevenly over the ranks. "checkpointed": each of its
five double-conv blocks runs under ``checkpoint(block, x, use_reentrant=False)`` (their
activations are recomputed in backward, halo messages and batch-norm all-reduces too).
Peak memory: the growth of the process's peak RSS during one training step after a small
warm-up step, each configuration in a fresh pool (peak RSS only grows), glibc's mmap
threshold pinned so that RSS follows live tensor memory. Time: the median of 3 steps.
"""

from __future__ import annotations

import argparse


class _Checkpointed:
    """``block(x)`` through ``torch.utils.checkpoint`` (non-reentrant)."""

    def __init__(self, block):
        self.block = block

    def __call__(self, x):
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.block, x, use_reentrant=False)


def _model(width, checkpointed):
    from bench_unet import _unet

    model = _unet(width)
    if checkpointed:  # the same modules, called through checkpoint
        for name in ("enc1", "enc2", "bottom", "dec2", "dec1"):
            block = getattr(model, name)
            model._modules.pop(name)
            setattr(model, name, _Checkpointed(block))
            model.add_module(f"{name}_block", block)
    return model


def _step(size, width, sharded, checkpointed, warmup=True):
    import resource
    import statistics
    import time

    from _common import fixed_mmap_threshold
    from bench_unet import _sizes

    fixed_mmap_threshold()
    if warmup:
        _step(max(size // 8, 16), width, sharded, checkpointed, warmup=False)

    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import Shard

    import shardlab

    torch.manual_seed(0)
    me, n = dist.get_rank(), dist.get_world_size()
    model = _model(width, checkpointed)
    sizes = _sizes(size, n)
    rows = sizes[me] if sharded else size
    local = torch.randn(1, 2, rows, size)
    mesh = shardlab.this_rank().mesh

    def one():
        with shardlab.patched():
            x = (
                shardlab.ShardTensor.from_local(
                    local, mesh, [Shard(2)], [sizes], shape=(1, 2, size, size)
                )
                if sharded
                else local
            )
            loss = model(x).square().sum()
            (loss.full_tensor() if sharded else loss).backward()

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    one()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    if not warmup:
        return peak, rows, 0.0
    times = []
    for _ in range(3):
        dist.barrier()
        t0 = time.perf_counter()
        one()
        dist.barrier()
        times.append(time.perf_counter() - t0)
    return peak, rows, statistics.median(times)


def main() -> None:
    import shardlab

    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--width", type=int, default=8)
    ap.add_argument("--ranks", type=int, default=4)
    a = ap.parse_args()
    res = {}
    for ranks, sharded in ((1, False), (a.ranks, True)):
        for ckpt in (False, True):
            with shardlab.Ranks(ranks) as pool:
                res[ranks, ckpt] = pool.run(_step, a.size, a.width, sharded, ckpt)
    print(
        f"## U-Net (width {a.width}) on (1, 2, {a.size}, {a.size}) float32, one training step, "
        "peak RSS growth per rank (MiB) and step time"
    )
    print("\n| ranks | rank | rows | peak, plain | peak, checkpointed | ratio | step s, plain | "
          "step s, checkpointed |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for ranks in (1, a.ranks):
        for r, ((p0, rows, t0), (p1, _, t1)) in enumerate(zip(res[ranks, False], res[ranks, True])):
            print(
                f"| {ranks} | {r} | {rows} | {p0 / 2**20:.1f} | {p1 / 2**20:.1f} | "
                f"{p1 / p0 if p0 else float('nan'):.2f} | {t0:.3f} | {t1:.3f} |"
            )


if __name__ == "__main__":
    main()
