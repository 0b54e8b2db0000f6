"""A small U-Net (conv, batch norm, max pool, conv_transpose, bilinear upsampling, pad,
skip connections) domain-parallel over H: peak memory per rank and messages per step.

Run: ``python benchmarks/bench_unet.py [--size 256] [--width 8] [--ranks 4]``.

1. Peak memory of one training step (forward + backward) per rank against single device:
   the growth of the process's peak RSS (``ru_maxrss``) during the step, each
   configuration in a fresh pool after a small warm-up step, glibc's mmap threshold
   pinned so that RSS follows live tensor memory (as ``bench_conv.py``).
   Target: each rank's share of the single-device growth (its rows / H) plus halos.
2. Messages of one forward on every rank: all-reduces (one per batch norm) and the
   bytes of the point-to-point halos.
"""

from __future__ import annotations

import argparse


def _unet(width):
    import torch.nn as nn
    import torch.nn.functional as F

    def block(cin, cout):
        return nn.Sequential(
            nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(),
            nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(),
        )  # fmt: skip

    class UNet(nn.Module):
        def __init__(self):
            super().__init__()
            w = width
            self.enc1, self.enc2, self.bottom = block(2, w), block(w, 2 * w), block(2 * w, 2 * w)
            self.pool = nn.MaxPool2d(2)
            self.up2 = nn.ConvTranspose2d(2 * w, 2 * w, 2, stride=2)
            self.dec2, self.dec1 = block(4 * w, w), block(2 * w, w)
            self.head = nn.Conv2d(w, 3, 1)

        def forward(self, x):
            import torch

            fit = lambda u, s: F.pad(u, [0, s.shape[3] - u.shape[3], 0, s.shape[2] - u.shape[2]])  # noqa: E731
            x1 = self.enc1(x)
            x2 = self.enc2(self.pool(x1))
            x3 = self.bottom(self.pool(x2))
            y2 = self.dec2(torch.cat([x2, fit(self.up2(x3), x2)], 1))
            u1 = F.interpolate(y2, scale_factor=2, mode="bilinear", align_corners=False)
            return self.head(self.dec1(torch.cat([x1, fit(u1, x1)], 1)))

    return UNet()


def _sizes(size, n):
    """Uneven shards: the first rank gets size/(4n) more rows, the last that many fewer."""
    base = [size // n] * n
    extra = size // (4 * n) if n > 1 else 0
    base[0] += extra
    base[-1] = size - sum(base[:-1])
    return base


def _memory_step(size, width, sharded, warmup=True):
    import resource

    from _common import fixed_mmap_threshold

    fixed_mmap_threshold()
    if warmup:  # first calls initialise caches and buffers: not the step's memory
        _memory_step(max(size // 8, 16), width, sharded, warmup=False)

    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import Shard

    import shardlab

    torch.manual_seed(0)
    me, n = dist.get_rank(), dist.get_world_size()
    model = _unet(width)
    sizes = _sizes(size, n)
    rows = sizes[me] if sharded else size
    local = torch.randn(1, 2, rows, size)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    with shardlab.patched():
        x = (
            shardlab.ShardTensor.from_local(
                local, shardlab.this_rank().mesh, [Shard(2)], [sizes], shape=(1, 2, size, size)
            )
            if sharded
            else local
        )
        loss = model(x).square().sum()
        (loss.full_tensor() if sharded else loss).backward()
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return after - before, rows


def _messages(size, width):
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import Shard

    import shardlab

    torch.manual_seed(0)
    model = _unet(width)
    img = torch.randn(1, 2, size, size)
    ref = model(img)
    with shardlab.patched():
        x = shardlab.distribute(img, shardlab.this_rank().mesh, [Shard(2)], sizes=[
            _sizes(size, dist.get_world_size())])  # fmt: skip
        with shardlab.trace() as t:
            y = model(x)
    err = (y.full_tensor() - ref).abs().max().item()
    return t.counts().get("all_reduce", 0), t.bytes(kind="send"), t.bytes(kind="recv"), err


def main() -> None:
    import shardlab

    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--width", type=int, default=8)
    ap.add_argument("--ranks", type=int, default=4)
    a = ap.parse_args()
    n = a.ranks
    with shardlab.Ranks(1) as one:
        single, _ = one.run(_memory_step, a.size, a.width, False)[0]
    with shardlab.Ranks(n) as ranks:
        mem = ranks.run(_memory_step, a.size, a.width, True)
    with shardlab.Ranks(n) as ranks:
        msgs = ranks.run(_messages, a.size, a.width)
    print(
        f"## U-Net (width {a.width}, 10 batch norms) on (1, 2, {a.size}, {a.size}) float32, "
        f"H sharded over {n} ranks, sizes {_sizes(a.size, n)}"
    )
    print(f"\nsingle device: peak growth of forward + backward {single / 2**20:.1f} MiB\n")
    print("| rank | rows | peak growth MiB | share of single (rows/H) MiB | ratio |")
    print("|---|---|---|---|---|")
    for r, (peak, rows) in enumerate(mem):
        share = single * rows / a.size
        print(
            f"| {r} | {rows} | {peak / 2**20:.1f} | {share / 2**20:.1f} | "
            f"{peak / share if share else float('nan'):.2f} |"
        )
    print("\n## messages of one forward (training mode)\n")
    print("| rank | all-reduces | halo bytes sent | halo bytes received | max error |")
    print("|---|---|---|---|---|")
    for r, (ar, sent, recv, err) in enumerate(msgs):
        print(f"| {r} | {ar} | {sent} | {recv} | {err:.1e} |")


if __name__ == "__main__":
    main()
