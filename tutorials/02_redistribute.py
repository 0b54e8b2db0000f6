# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---


# %% [markdown]
# # 02 · `redistribute`: changing placements, and what it costs
#
# `d.redistribute(mesh, placements)` returns the same global tensor with other
# placements. Each change is one collective (or none): knowing which one, and
# how many bytes it moves, is most of what it takes to reason about the cost of
# a parallel program.
#
# | from → to | collective | bytes each rank receives (ring, tensor of M bytes, N ranks) |
# |---|---|---|
# | `Replicate` → `Shard` | none: keep your block | 0 |
# | `Shard` → `Replicate` | all-gather | (N−1)/N · M |
# | `Partial` → `Shard` | reduce-scatter | (N−1)/N · M |
# | `Partial` → `Replicate` | all-reduce = reduce-scatter + all-gather | 2 (N−1)/N · M |
# | `Shard(i)` → `Shard(j)` | all-to-all | (N−1)/N² · M |
#
# We measure each one with `shardlab.trace()`, which records every collective a
# rank calls with the size of the tensor it hands in (the *payload*; what
# travels on the wire depends on the algorithm, as in the table).

# %%
import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

import shardlab
from shardlab import viz

WORLD = 4  # try 2 or 3
ranks = shardlab.Ranks(WORLD)
X = torch.arange(96.0, dtype=torch.float64).reshape(12, 8)  # M = 768 bytes


def placed(placements):
    """X on the 1-D mesh with ``placements``; a Partial X is split into per-rank summands."""
    me = shardlab.this_rank()
    if placements == [Partial()]:
        # rank r holds r everywhere, rank 0 also X minus all of them: the sum is X
        part = torch.full_like(X, me.rank) + (X - sum(range(me.world_size))) * (me.rank == 0)
        return DTensor.from_local(part, me.mesh, [Partial()])
    return distribute_tensor(X, me.mesh, placements)

# %% [markdown]
# ## Every transition, measured

# %%
def transition(src, dst):
    d = placed(src)
    with shardlab.trace() as t, shardlab.trace.label(f"redistribute {src[0]} → {dst[0]}"):
        out = d.redistribute(d.device_mesh, dst)
    return t.counts(), t.bytes(), torch.equal(out.full_tensor(), X)


TRANSITIONS = [
    ([Replicate()], [Shard(0)], {}),
    ([Shard(0)], [Replicate()], {"all_gather": 1}),
    ([Partial()], [Shard(0)], {"reduce_scatter": 1}),
    ([Partial()], [Replicate()], {"all_reduce": 1}),
]
for src, dst, expected in TRANSITIONS:
    counts, payload, same = ranks.run(transition, src, dst)[0]
    print(f"{str(src):16} → {str(dst):16} {str(counts):24} payload {payload:4} B per rank")
    assert same and counts == (expected if WORLD > 1 else {})

# %% [markdown]
# The payload of the all-gather is the rank's own block (M/N); each rank gets
# back the other N−1 blocks. Reduce-scatter and all-reduce hand in the whole
# tensor (M): every rank contributes to every element.
#
# As a picture, one row per rank, one column per collective, in order (the
# trace also saw the set-up and the checks; we keep the labelled transitions):

# %%
with shardlab.trace() as t:
    for src, dst, _ in TRANSITIONS:
        ranks.run(transition, src, dst)
viz.plot_collectives(t.filter(label="redistribute"))

# %% [markdown]
# ## `Shard(0)` → `Shard(1)`: where the backend matters
#
# The ideal is an all-to-all: each rank sends each other rank the part of its
# rows that falls in that rank's columns. On a CPU mesh DTensor 2.13 does not
# use all-to-all (its source says gloo lacks it); it falls back to an
# **all-gather of everything** and keeps a slice, with a warning. That receives
# (N−1)/N · M per rank instead of (N−1)/N² · M: N times too much. shardlab's
# `ShardTensor.redistribute` sends exactly the pieces, point to point.

# %%
def rows_to_columns(use_shardlab, check=True):
    d = placed([Shard(0)])
    if use_shardlab:
        d = shardlab.ShardTensor.from_local(d.to_local(), d.device_mesh, [Shard(0)])
    n = d.device_mesh.size()
    with shardlab.trace() as t:
        out = d.redistribute(d.device_mesh, [Shard(1)])
    received = t.bytes(kind="recv") + t.bytes(kind="all_gather") * (n - 1)  # all-gather: N-1 blocks
    return received, torch.equal(out.full_tensor(), X) if check else None


rows = [len(b) for b in torch.chunk(X, WORLD, dim=0)]  # torch.chunk sizes of the 12 rows
cols = [b.shape[1] for b in torch.chunk(X, WORLD, dim=1)]
# lower bound: rank r needs, from each other rank s, s's rows of r's columns (8 bytes each)
lower_bound = [sum(rows[s] * cols[r] * 8 for s in range(WORLD) if s != r) for r in range(WORLD)]
for use_shardlab in (False, True):
    results = ranks.run(rows_to_columns, use_shardlab)
    assert all(same for _, same in results)
    received = [b for b, _ in results]
    print(f"{'shardlab' if use_shardlab else 'DTensor '}: bytes received per rank {received}")
    if not use_shardlab:  # at least everything but its own rows (more with padding)
        assert all(r >= (WORLD - 1) * X.numel() * 8 // WORLD for r in received)
print(f"lower bound:       {lower_bound}")
assert received == lower_bound  # shardlab's point-to-point pieces

# %% [markdown]
# shardlab's pieces as messages: each arrow is one block going from the rank
# that has those rows to the rank that owns those columns.

# %%
with shardlab.trace() as t:
    ranks.run(rows_to_columns, True, check=False)  # no full_tensor() this time
viz.plot_collectives(t.filter(kind=("send", "recv")))  # not the set-up collectives

# %% [markdown]
# ## Backward: why `Partial` → `Replicate` needs no message
#
# Every `redistribute` is differentiable. Its backward moves the gradient the
# other way. The forward of `Partial` → `Replicate` is an all-reduce:
# `y = x₀ + x₁ + … + x_{N−1}`, the same `y` on every rank. Every rank computes
# the same loss from it, so every rank already holds the whole `∂L/∂y`: the
# gradient arriving at `y` is `Replicate`. The backward of a sum copies it to
# each term, `∂L/∂xᵣ = ∂L/∂y`, so it goes back to each `xᵣ` **unchanged, with
# no communication**: DTensor keeps it `Replicate` rather than turning it into
# `Partial`. (Making it `Partial` would leave each rank a share, and the next
# step would need an all-reduce to get back what every rank already had.)
#
# This relies on every rank computing the same loss from `y`, as SPMD code
# does. If ranks computed different losses, each would get only its own
# gradient.

# %%
def backward_of_all_reduce():
    me = shardlab.this_rank()
    x = torch.full((4,), float(me.rank), dtype=torch.float64, requires_grad=True)  # my summand
    w = torch.arange(4.0, dtype=torch.float64)
    p = DTensor.from_local(x, me.mesh, [Partial()])
    grad_placements = []
    p.register_hook(lambda g: grad_placements.append(g.placements))
    with shardlab.trace() as forward:
        y = p.redistribute(me.mesh, [Replicate()])  # all-reduce
    loss = (y.to_local() * w).sum()  # the same loss on every rank
    with shardlab.trace() as backward:
        loss.backward()
    return forward.counts(), backward.counts(), grad_placements, x.grad


for rank, (fwd, bwd, grad_placements, grad) in enumerate(ranks.run(backward_of_all_reduce)):
    # single device: loss = (sum_r x_r) . w, so d loss / d x_r = w for every r
    assert torch.equal(grad, torch.arange(4.0, dtype=torch.float64))
    assert grad_placements == [(Replicate(),)] and bwd == {}
print(f"forward {fwd}; backward {bwd or 'no messages'}; gradient placements {grad_placements[0]}")

# %% [markdown]
# The same reasoning, turned around: the backward of `Shard` → `Replicate` (an
# all-gather) is `Replicate` → `Shard`, which only keeps the local block. The
# backward of `Replicate` → `Shard` is an all-gather of the gradient, and so is
# the backward of `Partial` → `Shard` (a reduce-scatter forward): the gradient
# of each summand is the whole gradient, gathered.

# %%
def backward_of(src, dst):
    d = placed(src).detach().requires_grad_()
    out = d.redistribute(d.device_mesh, dst)
    with shardlab.trace() as t:
        out.to_local().sum().backward()
    return t.counts()


gather = {"all_gather": 1} if WORLD > 1 else {}
assert all(c == {} for c in ranks.run(backward_of, [Shard(0)], [Replicate()]))
assert all(c == gather for c in ranks.run(backward_of, [Replicate()], [Shard(0)]))
assert all(c == gather for c in ranks.run(backward_of, [Partial()], [Shard(0)]))
print("backward of Replicate → Shard(0) and of Partial → Shard(0):", gather or "no messages")

# %%
ranks.close()
