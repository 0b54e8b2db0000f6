"""Domain-parallel convolution: how a conv stack scales with image size and ranks.

The image (1, C, H, W) lives on rank 0; ``shardlab.scatter_tensor`` hands each of the N
ranks its own H/N rows. An unchanged ``nn.Sequential`` of 3x3 convs then runs on the
sharded image under ``shardlab.patched()``::

    rank 0   rows [0, H/N)        each conv first receives 1 halo row from each
    rank 1   rows [H/N, 2H/N)     neighbour (point to point): 1 x C x W floats;
    ...                           backward sends the halo gradients back

Per image size the demo measures forward + backward of the sharded stack (median of a
few steps after a warm-up, slowest rank), the same step on one device (rank 0 alone, the
full image, the same torch threads as one rank), what each rank receives, the peak
memory per rank, and checks that output and weight gradients equal single device.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Shard

import shardlab
from shardlab.demo import _common as common

SIZES = (256, 512, 1024)  # square images, H = W
QUICK = (16, 32)
CHANNELS = 8
LAYERS = 3  # conv - relu - conv - relu - conv


def model(channels: int = CHANNELS, layers: int = LAYERS, device="cpu") -> torch.nn.Module:
    """The same weights on every rank (seeded): conv 3x3 (padding 1), ReLU in between."""
    torch.manual_seed(0)
    mods: list[torch.nn.Module] = []
    for _ in range(layers):
        mods += [torch.nn.Conv2d(channels, channels, 3, padding=1), torch.nn.ReLU()]
    return torch.nn.Sequential(*mods[:-1]).to(device)


def _step(net, x):
    """Forward + backward. Loss = sum of y^2; each rank back-propagates the sum over its
    own rows, and shardlab sums the weight gradients over the ranks: the same full
    gradient as one device."""
    net.zero_grad(set_to_none=True)
    with shardlab.patched():
        y = net(x)  # sharded x: ShardTensor (1, C, H, W), rows split like x
        local = y.to_local() if isinstance(y, shardlab.ShardTensor) else y  # (1, C, H_r, W)
        local.square().sum().backward()
    return y


def rank_counts(world: int) -> list[int]:
    """The numbers of ranks a run compares: 2, 4, 8, ... up to the world, and the world."""
    counts = [k for k in (2**i for i in range(1, 16)) if k < world]
    return [*counts, world] if world > 1 else [1]


def one_size(size: int, args, mesh, single: dict) -> dict | None:
    """Measure one image size on the ranks of ``mesh`` (the first k ranks); the others
    return None at once. ``single`` caches rank 0's one-device figures per size."""
    ctx = shardlab.this_rank()
    if mesh.get_coordinate() is None:
        return None  # not one of these k ranks
    me, dev, c, group = ctx.rank, ctx.device, CHANNELS, mesh.get_group()
    reps = common.reps_of(args)
    net = model(c, LAYERS, dev)
    img = None
    if me == 0:  # the full image exists on rank 0 only
        gen = torch.Generator(device=dev).manual_seed(size)
        img = torch.randn(1, c, size, size, generator=gen, device=dev)  # (1, C, H, W)
    x = shardlab.scatter_tensor(img, 0, mesh, [Shard(2)])  # mine: (1, C, ~H/k, W)
    rows = x.to_local().shape[2]

    with shardlab.trace(mesh=mesh) as t:  # the warm-up step, traced
        y = _step(net, x)
    got = [y.full_tensor(), *(p.grad for p in net.parameters())]  # all-gather: check only
    seconds = common.median_seconds(lambda: _step(net, x), reps, dev, group=group)
    peak = common.peak_bytes(lambda: _step(net, x), dev)
    mine = {
        "recv": common.received_bytes(t.filter(kind="recv")),  # halo rows
        "reduce": common.received_bytes(t.filter(kind="all_reduce")),  # weight gradients
        "rows": rows,
        "peak": peak,
    }
    if me == 0:  # one device: the full image, rank 0 alone (the others wait below)
        ref = _step(net, img)
        want = [ref, *(p.grad for p in net.parameters())]
        mine["err"] = common.rel_error(zip(got, want))
        if size not in single:
            single[size] = (
                common.median_seconds(lambda: _step(net, img), reps, dev, False),
                common.peak_bytes(lambda: _step(net, img), dev),
            )
        mine["single"], mine["single_peak"] = single[size]
    del got, y
    ranks = common.gather(mine, group)  # the others wait here for rank 0
    common.check(ranks[0]["err"], f"conv, image {size}, {mesh.size()} ranks")
    return {
        "image": size,
        "ranks": mesh.size(),
        "rows_per_rank": [r["rows"] for r in ranks],
        "ms": 1e3 * seconds,
        "single_ms": 1e3 * ranks[0]["single"],
        "speedup": ranks[0]["single"] / seconds,
        "halo_bytes_per_rank": [r["recv"] for r in ranks],
        "halo_bytes": max(r["recv"] for r in ranks),
        "reduce_bytes": max(r["reduce"] for r in ranks),
        "peak_mib": max(r["peak"] for r in ranks) / 2**20,
        "single_peak_mib": ranks[0]["single_peak"] / 2**20,
        "max_rel_err": ranks[0]["err"],
        "ok": True,
    }


COLUMNS = [
    ("image", "image H=W", "d"),
    ("ranks", "ranks", "d"),
    ("ms", "fwd+bwd ms", ".1f"),
    ("single_ms", "1 device ms", ".1f"),
    ("speedup", "speed-up", ".2f"),
    ("halo_bytes", "halo bytes recv/rank", ".0f"),
    ("reduce_bytes", "all-reduce bytes/rank", ".0f"),
    ("peak_mib", "peak MiB/rank", ".1f"),
    ("single_peak_mib", "1 device peak MiB", ".1f"),
    ("max_rel_err", "max rel err", ".1e"),
]


def run(args) -> list[dict]:
    """All image sizes on the current ranks; rank 0 prints the table and saves the plot."""
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    ctx = shardlab.this_rank()
    n, single, rows = ctx.world_size, {}, []
    for k in rank_counts(n):  # the first k ranks: every rank builds each group
        mesh = ctx.mesh if k == n else DeviceMesh(ctx.device.type, list(range(k)))
        for size in common.sizes_of(args, SIZES, QUICK):
            rows.append(one_size(size, args, mesh, single))
        dist.barrier()  # the ranks left out wait for this k to finish
    shared = [rows if ctx.rank == 0 else None]
    dist.broadcast_object_list(shared, src=0)  # every rank returns rank 0's rows
    rows = sorted(shared[0], key=lambda r: (r["image"], r["ranks"]))
    common.print_table(
        f"conv: {LAYERS} x Conv2d({CHANNELS}, {CHANNELS}, 3, padding=1) on "
        f"(1, {CHANNELS}, H, H) float32, H sharded over k of {n} {ctx.backend} ranks on "
        f"{ctx.device.type}, "
        f"forward + backward (median of {common.reps_of(args)}; 1 device = rank 0 alone); "
        f"checked against 1 device (max rel err <= {common.TOL:g})",
        COLUMNS,
        rows,
    )
    by_k = {k: [r for r in rows if r["ranks"] == k] for k in rank_counts(n)}
    xs = [r["image"] for r in by_k[n]]
    lines = {f"sharded, {k} ranks": (xs, [r["ms"] for r in rs]) for k, rs in by_k.items()}
    lines["1 device"] = (xs, [r["single_ms"] for r in by_k[n]])
    common.save_plot(
        os.path.join(args.out, "conv.png"),
        f"halo conv, {LAYERS} layers, {CHANNELS} channels",
        "image size H = W",
        [("forward + backward, ms", lines)],
    )
    return rows
