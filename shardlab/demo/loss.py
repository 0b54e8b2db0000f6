"""Loss parallel: vocab-parallel cross-entropy as the vocabulary grows.

The logits (T, V) of T tokens are sharded over the vocabulary (class) dim: rank r holds
(T, V_r) and never the whole (T, V). The patched ``F.cross_entropy`` needs only
per-token numbers from the other ranks::

    forward   1. all-reduce MAX  of m_t = max_c x_tc                (T,)
              2. all-reduce SUM  of sum_c exp(x_tc - m_t), x_t,target  (2, T)
    backward  none: d loss / d x_tc = (softmax_tc - [c = target_t]) / T, local

So the bytes per rank grow with T, not with V, while the logits (and their gradient)
per rank shrink as V/N. Per vocabulary size the demo measures forward + backward
(median of a few steps after a warm-up, slowest rank), the same on one device (rank 0
alone, the full logits, the same torch threads as one rank), the bytes each rank
receives, the logits and peak memory per rank, and checks loss and gradient against
one device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import Shard

import shardlab
from shardlab.demo import _common as common
from shardlab.layout import chunk_sizes

SIZES = (8192, 32768, 131072)  # vocabulary sizes V
QUICK = (64, 96)
TOKENS, QUICK_TOKENS = 512, 16


def logits_block(vocab: int, sizes: list[int], r: int, tokens: int, device) -> torch.Tensor:
    """Rank r's block (T, V_r) of the logits, drawn from its own seed: no rank needs the
    whole (T, V) to make its block (one device concatenates them all)."""
    gen = torch.Generator(device=device).manual_seed(1000 * vocab + r)
    return torch.randn(tokens, sizes[r], generator=gen, device=device)


def _step(logits, target, sizes):
    """Forward + backward. ``sizes`` given: ``logits`` is this rank's (T, V_r) block."""
    logits.grad = None
    with shardlab.patched():
        x = logits
        if sizes is not None:  # the blocks of all ranks as one (T, V), classes sharded
            x = shardlab.ShardTensor.from_local(
                logits, shardlab.this_rank().mesh, [Shard(1)], [sizes], validate=False
            )
        loss = F.cross_entropy(x, target)  # 0-dim, the same value on every rank
        loss.backward()
    return loss


def one_size(vocab: int, args) -> dict:
    """Measure one vocabulary size on every rank; returns the same row on every rank."""
    ctx = shardlab.this_rank()
    me, n, dev, mesh = ctx.rank, ctx.world_size, ctx.device, ctx.mesh
    reps, tokens = common.reps_of(args), QUICK_TOKENS if args.quick else TOKENS
    sizes = chunk_sizes(vocab, n)  # classes of every rank, e.g. [V/2, V/2]
    mine = logits_block(vocab, sizes, me, tokens, dev).requires_grad_()  # (T, V_me)
    gen = torch.Generator(device=dev).manual_seed(vocab)
    target = torch.randint(0, vocab, (tokens,), generator=gen, device=dev)  # (T,) everywhere

    def step():
        return _step(mine, target, sizes)

    with shardlab.trace() as t_fwd:  # the warm-up step, forward and backward traced apart
        with shardlab.patched():
            x = shardlab.ShardTensor.from_local(
                mine, mesh, [Shard(1)], [sizes], validate=False
            )  # (T, V)
            loss = F.cross_entropy(x, target)
    with shardlab.trace() as t_bwd:
        loss.backward()
    grad = shardlab.ShardTensor.from_local(mine.grad, mesh, [Shard(1)], [sizes], validate=False)
    got = [loss.full_tensor().detach(), grad.full_tensor()]  # all-gather, for the check
    del grad, x, loss
    if me != 0:
        del got  # only rank 0 compares
    seconds = common.median_seconds(step, reps, dev)
    res = {
        "recv": common.received_bytes(t_fwd) + common.received_bytes(t_bwd),
        "collectives": sum(e.kind != "recv" for e in t_fwd.events),
        "bwd_messages": len(t_bwd),
        "peak": common.peak_bytes(step, dev),
        "shard": mine.numel() * mine.element_size(),
    }
    if me == 0:  # one device: the full (T, V) logits on rank 0 alone (others wait below)
        full = torch.cat([logits_block(vocab, sizes, r, tokens, dev) for r in range(n)], 1)
        full.requires_grad_()  # (T, V)
        ref = _step(full, target, None)
        res["err"] = common.rel_error(zip(got, [ref.detach(), full.grad]))
        del got
        res["single"] = common.median_seconds(lambda: _step(full, target, None), reps, dev, False)
        res["single_peak"] = common.peak_bytes(lambda: _step(full, target, None), dev)
        res["full"] = full.numel() * full.element_size()
        del full, ref
    ranks = common.gather(res)  # the others wait here for rank 0
    common.check(ranks[0]["err"], f"loss, vocab {vocab}")
    mib = 2**20
    return {
        "vocab": vocab,
        "tokens": tokens,
        "ranks": n,
        "ms": 1e3 * seconds,
        "single_ms": 1e3 * ranks[0]["single"],
        "speedup": ranks[0]["single"] / seconds,
        "collectives_fwd": ranks[0]["collectives"],
        "messages_bwd": max(r["bwd_messages"] for r in ranks),
        "recv_per_rank": [r["recv"] for r in ranks],
        "recv": max(r["recv"] for r in ranks),
        "logits_mib": max(r["shard"] for r in ranks) / mib,
        "single_logits_mib": ranks[0]["full"] / mib,
        "peak_mib": max(r["peak"] for r in ranks) / mib,
        "single_peak_mib": ranks[0]["single_peak"] / mib,
        "max_rel_err": ranks[0]["err"],
        "ok": True,
    }


COLUMNS = [
    ("vocab", "vocab V", "d"),
    ("ranks", "ranks", "d"),
    ("ms", "fwd+bwd ms", ".1f"),
    ("single_ms", "1 device ms", ".1f"),
    ("speedup", "speed-up", ".2f"),
    ("collectives_fwd", "all-reduces fwd", "d"),
    ("messages_bwd", "messages bwd", "d"),
    ("recv", "bytes recv/rank", ".0f"),
    ("logits_mib", "logits MiB/rank", ".1f"),
    ("single_logits_mib", "1 device logits MiB", ".1f"),
    ("peak_mib", "peak MiB/rank", ".1f"),
    ("single_peak_mib", "1 device peak MiB", ".1f"),
    ("max_rel_err", "max rel err", ".1e"),
]


def run(args) -> list[dict]:
    """All vocabulary sizes; rank 0 prints the table and saves the plot."""
    import os

    ctx = shardlab.this_rank()
    rows = [one_size(v, args) for v in common.sizes_of(args, SIZES, QUICK)]
    n, tokens = ctx.world_size, rows[0]["tokens"]
    common.print_table(
        f"loss: F.cross_entropy on ({tokens}, V) float32 logits, V sharded over {n} "
        f"{ctx.backend} ranks on "
        f"{ctx.device.type}, reduction 'mean', forward + backward (median of "
        f"{common.reps_of(args)}; 1 device = rank 0 alone; peak = tensor memory created "
        f"during the step); checked against 1 device (max rel err <= {common.TOL:g})",
        COLUMNS,
        rows,
    )
    xs = [r["vocab"] for r in rows]
    common.save_plot(
        os.path.join(args.out, "loss.png"),
        f"vocab-parallel cross-entropy, {tokens} tokens",
        "vocabulary size V",
        [
            (
                "forward + backward, ms",
                {
                    f"sharded, {n} ranks": (xs, [r["ms"] for r in rows]),
                    "1 device": (xs, [r["single_ms"] for r in rows]),
                },
            ),
            (
                "MiB per rank",
                {
                    "peak, sharded": (xs, [r["peak_mib"] for r in rows]),
                    "peak, 1 device": (xs, [r["single_peak_mib"] for r in rows]),
                    "logits shard": (xs, [r["logits_mib"] for r in rows]),
                    "full logits": (xs, [r["single_logits_mib"] for r in rows]),
                },
            ),
            ("bytes received per rank", {"forward + backward": (xs, [r["recv"] for r in rows])}),
        ],
    )
    return rows
