"""Ring attention: how sequence-parallel attention scales with the sequence length.

q, k, v of shape (B, H, S, D) are sharded along the sequence S: rank r keeps its S/N
query rows and its S/N key/value rows. The patched ``F.scaled_dot_product_attention``
passes the K/V blocks around the ring, so every query block meets every key block::

    step 0:  r0 [q0 . kv0]  r1 [q1 . kv1]      own block
    step 1:  r0 [q0 . kv1]  r1 [q1 . kv0]      K, V moved one hop (N = 2)

Forward: each rank receives the N-1 other K and V blocks once. Backward: the K/V blocks
again, plus the dK/dV accumulators coming home. Each block runs in torch's fused CPU
kernel (no score matrix) unless a mask needs explicit (S/N x S/N) scores; ``is_causal`` uses
the true positions of the rows;
with contiguous blocks the last rank does the most work (``attention.balance`` /
``head_tail()`` even it out, see ``shardlab/ops/attention.py``).

Per sequence length, causal and not, the demo measures forward + backward (median of a
few steps after a warm-up, slowest rank), the same on one device (torch's fused SDPA on
rank 0 alone, the same torch threads as one rank), the bytes each rank receives, the
peak memory per rank, and checks output and q/k/v gradients against one device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import Shard

import shardlab
from shardlab.demo import _common as common
from shardlab.layout import chunk_sizes

SIZES = (512, 1024, 2048, 4096)  # sequence lengths S
QUICK = (16, 32)
BATCH, HEADS, DIM = 1, 4, 32


def _forward(leaves, sizes, causal):
    """Sharded (list of local blocks) or one device (full tensors) -> output."""
    with shardlab.patched():
        if sizes is not None:  # this rank's (B, H, S_r, D) blocks as one (B, H, S, D) each
            mesh = shardlab.this_rank().mesh
            leaves = [
                shardlab.ShardTensor.from_local(x, mesh, [Shard(2)], [sizes], validate=False)
                for x in leaves
            ]
        return F.scaled_dot_product_attention(*leaves, is_causal=causal)  # (B, H, S, D)


def _backward(out, leaves):
    """Loss = sum of out^2: each rank back-propagates its own rows (the ring brings the
    dK/dV of the other ranks' queries home)."""
    for x in leaves:
        x.grad = None
    local = out.to_local() if isinstance(out, shardlab.ShardTensor) else out
    with shardlab.patched():
        local.square().sum().backward()


def one_size(seq: int, causal: bool, args) -> dict:
    """Measure one sequence length on every rank; returns the same row on every rank."""
    ctx = shardlab.this_rank()
    me, n, dev, mesh = ctx.rank, ctx.world_size, ctx.device, ctx.mesh
    reps = common.reps_of(args)
    gen = torch.Generator(device=dev).manual_seed(seq)
    full = [torch.randn(BATCH, HEADS, seq, DIM, generator=gen, device=dev) for _ in "qkv"]
    sizes = chunk_sizes(seq, n)  # rows of every rank, e.g. [S/2, S/2]
    start = sum(sizes[:me])
    mine = [x[:, :, start : start + sizes[me]].clone().requires_grad_() for x in full]

    def step():
        _backward(_forward(mine, sizes, causal), mine)

    with shardlab.trace() as t_fwd:  # the warm-up step, traced
        out = _forward(mine, sizes, causal)
    with shardlab.trace() as t_bwd:
        _backward(out, mine)
    grads = [
        shardlab.ShardTensor.from_local(x.grad, mesh, [Shard(2)], [sizes], validate=False)
        for x in mine
    ]
    got = [g.full_tensor() for g in (out, *grads)]  # all-gathers, for the check only
    seconds = common.median_seconds(step, reps, dev)
    res = {
        "fwd": common.received_bytes(t_fwd),
        "bwd": common.received_bytes(t_bwd),
        "peak": common.peak_bytes(step, dev),
    }
    if me == 0:  # one device: the full sequence on rank 0 alone (the others wait below)
        leaves = [x.clone().requires_grad_() for x in full]

        def single():
            _backward(_forward(leaves, None, causal), leaves)

        ref = _forward(leaves, None, causal)
        _backward(ref, leaves)
        res["err"] = common.rel_error(zip(got, [ref, *(x.grad for x in leaves)]))
        res["single"] = common.median_seconds(single, reps, dev, together=False)
        res["single_peak"] = common.peak_bytes(single, dev)
    del got, out
    ranks = common.gather(res)  # the others wait here for rank 0
    common.check(ranks[0]["err"], f"attention, S={seq}, causal={causal}")
    return {
        "seq": seq,
        "causal": causal,
        "ranks": n,
        "ms": 1e3 * seconds,
        "single_ms": 1e3 * ranks[0]["single"],
        "speedup": ranks[0]["single"] / seconds,
        "recv_fwd": max(r["fwd"] for r in ranks),
        "recv_bwd": max(r["bwd"] for r in ranks),
        "recv_per_rank": [r["fwd"] + r["bwd"] for r in ranks],
        "peak_mib": max(r["peak"] for r in ranks) / 2**20,
        "single_peak_mib": ranks[0]["single_peak"] / 2**20,
        "max_rel_err": ranks[0]["err"],
        "ok": True,
    }


COLUMNS = [
    ("seq", "S", "d"),
    ("causal", "causal", ""),
    ("ranks", "ranks", "d"),
    ("ms", "fwd+bwd ms", ".1f"),
    ("single_ms", "1 device ms", ".1f"),
    ("speedup", "speed-up", ".2f"),
    ("recv_fwd", "bytes recv/rank fwd", ".0f"),
    ("recv_bwd", "bytes recv/rank bwd", ".0f"),
    ("peak_mib", "peak MiB/rank", ".1f"),
    ("single_peak_mib", "1 device peak MiB", ".1f"),
    ("max_rel_err", "max rel err", ".1e"),
]


def run(args) -> list[dict]:
    """All sequence lengths, causal and not; rank 0 prints the table and saves the plot."""
    import os

    ctx = shardlab.this_rank()
    seqs = common.sizes_of(args, SIZES, QUICK)
    rows = [one_size(s, c, args) for c in (False, True) for s in seqs]
    common.print_table(
        f"attention: F.scaled_dot_product_attention on (B, H, S, D) = ({BATCH}, {HEADS}, S, "
        f"{DIM}) float32, S sharded over {ctx.world_size} {ctx.backend} ranks on "
        f"{ctx.device.type} (ring), "
        f"forward + backward (median of {common.reps_of(args)}; 1 device = torch sdpa on "
        f"rank 0 alone); checked against 1 device (max rel err <= {common.TOL:g})",
        COLUMNS,
        rows,
    )
    time_lines, byte_lines = {}, {}
    for causal in (False, True):
        sel = [r for r in rows if r["causal"] == causal]
        xs, kind = [r["seq"] for r in sel], "causal" if causal else "full"
        time_lines[f"ring, {ctx.world_size} ranks, {kind}"] = (xs, [r["ms"] for r in sel])
        time_lines[f"1 device, {kind}"] = (xs, [r["single_ms"] for r in sel])
    byte_lines["forward"] = (xs, [r["recv_fwd"] for r in sel])
    byte_lines["backward"] = (xs, [r["recv_bwd"] for r in sel])
    common.save_plot(
        os.path.join(args.out, "attention.png"),
        f"ring attention, {BATCH}x{HEADS} heads of dim {DIM}",
        "sequence length S",
        [("forward + backward, ms", time_lines), ("bytes received per rank", byte_lines)],
    )
    return rows
