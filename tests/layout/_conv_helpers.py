"""Shared by the conv tests: simulate the ranks using only the plan, and brute-force
dependencies from torch itself."""

from __future__ import annotations

import torch

from shardlab.layout import OVERHANG, offsets

MODES = ("zeros", "reflect", "replicate", "circular")


def window_of(plan, r, x, pad_value=0.0):
    """Rank r's window, built from its own shard and the received ranges only."""
    shards = torch.split(x, list(plan.in_sizes), dim=-1)
    starts = offsets(plan.in_sizes)
    parts = []
    for src, start, stop in plan.blocks(r):
        assert start < stop
        local = shards[src][..., start - starts[src] : stop - starts[src]]
        assert local.shape[-1] == stop - start, "range not inside the source's shard"
        parts.append(local)
    buf = torch.cat(parts + [torch.full((*x.shape[:-1], 1), pad_value)], dim=-1)
    idx = torch.tensor(plan.local_index(r), dtype=torch.long)
    idx[idx < 0] = buf.shape[-1] - 1
    w0, w1 = plan.window(r)
    assert len(idx) == w1 - w0
    return buf.index_select(-1, idx)


def run_sharded(plan, x, local_op, pad_value=0.0):
    outs = []
    for r in range(len(plan.in_sizes)):
        if plan.out_sizes[r] == 0:
            assert plan.window(r)[0] == plan.window(r)[1] and not plan.blocks(r)
            continue
        y = local_op(window_of(plan, r, x, pad_value), r)
        c0, c1 = plan.crop(r)
        y = y[..., c0:c1]
        assert y.shape[-1] == plan.out_sizes[r]
        outs.append(y)
    return torch.cat(outs, dim=-1)


def check_lower_bound(plan, dep):
    """dep[j, i]: output j reads input i (from torch). Windows read exactly what is needed;
    every needed foreign row is received exactly once, from its owner."""
    starts = offsets(plan.in_sizes)
    assert sum(plan.out_sizes) == plan.out_length == dep.shape[0]
    for r, size in enumerate(plan.in_sizes):
        lo, hi = plan.out_range(r)
        needed = set(torch.nonzero(dep[lo:hi].any(0)).flatten().tolist())
        assert {g for g in plan.index_map(r) if g >= 0} == needed
        own = set(range(starts[r], starts[r] + size))
        received = []
        for src, start, stop in plan.recvs(r):
            assert src != r and starts[src] <= start < stop <= starts[src] + plan.in_sizes[src]
            received += range(start, stop)
        assert sorted(received) == sorted(needed - own)
        own_read = [g for _, a, b in plan.own_rows(r) for g in range(a, b)]
        assert sorted(own_read) == sorted(needed & own)
        assert [b.start for b in plan.blocks(r)] == sorted(b.start for b in plan.blocks(r))
    for r in range(len(plan.in_sizes)):  # sends mirror recvs
        assert plan.sends(r) == tuple(
            (d, a, b) for d in range(len(plan.in_sizes)) for s, a, b in plan.recvs(d) if s == r
        )
        assert plan.bytes_per_element_sent(r) == sum(b - a for _, a, b in plan.sends(r))


def dependency(f, length):
    """dep[j, i] = output j reads input i, from the single-device op applied to every one-hot
    input at once (conv / avg-pool are linear with positive weights; max-pool of a one-hot is 1
    exactly where its window covers the hot element, else 0)."""
    columns = f(torch.eye(length).view(length, 1, length))  # (L, 1, out): column i = f(e_i)
    return columns[:, 0, :].T > 0


def random_sizes(rng, ranks=None, max_size=5):
    ranks = ranks or rng.randint(1, 4)
    while True:
        sizes = [rng.choice([0, 1, 1, 2, 3, max_size]) for _ in range(ranks)]
        if sum(sizes):
            return sizes


def torch_raises(f):
    try:
        f()
    except (RuntimeError, ValueError):
        return True
    return False


def features(plan):
    """What a plan exercises: the sweeps must reach all the hard corners."""
    found = set()
    nonempty = [r for r, n in enumerate(plan.in_sizes) if n]
    for r in range(len(plan.in_sizes)):
        srcs = [b.rank for b in plan.recvs(r)]
        if len(srcs) != len(set(srcs)):
            found.add("split source")
        if plan.padding_mode != "circular" and any(
            any(min(r, q) < m < max(r, q) for m in nonempty) for q in srcs
        ):
            found.add("multi-hop")
        if OVERHANG in plan.index_map(r):
            found.add("overhang")
        if plan.in_sizes[r] == 0 or plan.out_sizes[r] == 0:
            found.add("empty")
    return found


def tally(plans):
    counts = {}
    for plan in plans:
        for f in features(plan) if plan else ():
            counts[f] = counts.get(f, 0) + 1
    return counts
