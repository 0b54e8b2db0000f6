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
# # 04 · Uneven shards: a tensor cut into pieces of any size
#
# A *sharded* tensor is one global tensor cut into blocks, one per rank. DTensor
# describes the cut with **placements**: `Shard(d)` cuts dim `d`, `Replicate()`
# gives every rank the whole tensor, `Partial()` means the global value is the
# *sum* of the ranks' values.
#
# DTensor only knows `torch.chunk` sizes. Real data rarely splits evenly (an
# image of 18 rows on 4 ranks), so shardlab's `ShardTensor` records the exact
# size of every block.

# %%
import torch
from torch.distributed.tensor import Shard

import shardlab
from shardlab import viz
from shardlab.layout import ShardLayout

WORLD = 4  # try 2 or 3
ranks = shardlab.Ranks(WORLD)

# %% [markdown]
# ## One tensor, one block per rank
#
# `shardlab.distribute(t, mesh, placements, sizes)` keeps on each rank its block
# of a tensor that every rank holds. Here 18 rows are cut into blocks of
# different sizes.

# %%
SIZES = [18 - 4 * (WORLD - 1)] + [4] * (WORLD - 1) if WORLD > 1 else [18]
layout = ShardLayout.build((18, 3), (WORLD,), [Shard(0)], [SIZES])
print(layout)
viz.plot_placements(layout)


# %%
def make(sizes):
    mesh = shardlab.this_rank().mesh  # the 1-D mesh over all ranks
    x = torch.arange(54.0).reshape(18, 3)  # the same global tensor on every rank
    st = shardlab.distribute(x, mesh, [Shard(0)], sizes=[sizes])
    return tuple(st.to_local().shape), st.full_tensor().equal(x), st.mean().full_tensor().item()


results = ranks.run(make, SIZES)
for rank, (shape, same, mean) in enumerate(results):
    print(f"rank {rank}: local block {shape}")
assert all(same for _, same, _ in results)
assert all(abs(mean - torch.arange(54.0).mean().item()) < 1e-5 for *_, mean in results)  # float32

# %% [markdown]
# `full_tensor()` gathers the blocks back, and `mean()` divides by the true
# number of elements: both equal the single-device values for any sizes.
#
# ## Data on one rank: `scatter_tensor`
#
# Often the data is loaded on one rank only. `scatter_tensor` sends each rank
# *only its own block*; the tracer shows who received what.


# %%
def scatter(sizes):
    me = shardlab.this_rank().rank
    x = torch.arange(54.0).reshape(18, 3) if me == 0 else None  # only rank 0 has it
    with shardlab.trace() as t:
        st = shardlab.scatter_tensor(x, 0, shardlab.this_rank().mesh, [Shard(0)], sizes=[sizes])
    return t.bytes(kind="recv", label="scatter_tensor"), st.to_local().numel() * 4


for rank, (received, block) in enumerate(ranks.run(scatter, SIZES)):
    print(f"rank {rank} received {received} bytes for its block of {block} bytes")
    assert received == (0 if rank == 0 else block)

# %% [markdown]
# ## Changing the layout: `redistribute`
#
# `redistribute` moves exactly the pieces that change owner. From rows to
# columns every rank sends each other rank the part of its rows that falls in
# the other rank's columns. 3 columns on 4 ranks leave the last one an empty
# block, `(18, 0)`: nobody sends it anything.


# %%
def to_columns(sizes):
    mesh = shardlab.this_rank().mesh
    x = torch.arange(54.0).reshape(18, 3)
    st = shardlab.distribute(x, mesh, [Shard(0)], [sizes])
    with shardlab.trace() as t:
        cols = st.redistribute(mesh, [Shard(1)])
    same = torch.equal(cols.full_tensor(), x)  # the same global tensor, now by columns
    received = t.bytes(kind="recv")
    return tuple(cols.to_local().shape), t.counts(), same, cols.sharding, t.events, received


results = ranks.run(to_columns, SIZES)
columns = [len(c) for c in torch.arange(3).chunk(WORLD)] + [0] * WORLD  # torch.chunk sizes
for rank, (shape, counts, same, _, _, received) in enumerate(results):
    print(f"rank {rank}: now holds {shape}, messages {counts}")
    # exactly the pieces that change owner: other ranks' rows of my columns, float32
    assert same and received == sum(SIZES[s] * columns[rank] * 4 for s in range(WORLD) if s != rank)
viz.plot_placements(results[0][3])

# %% [markdown]
# Each arrow is one piece: the rows a rank had, of the columns another rank now owns.

# %%
viz.plot_collectives(shardlab.trace.Trace([e for *_, events, _ in results for e in events]))

# %% [markdown]
# ## Results cut by their values: `nonzero` and `masked_select`
#
# How many entries `x > 40` holds on each rank depends on the values, so nothing can say
# in advance how many rows of `torch.nonzero(x > 40)` each rank will hold. A ShardTensor
# does not need to know in advance. Each rank keeps its own hits, in torch's order, and one
# all-gather of one number per rank (how many each found) gives the pieces' sizes. The
# result is cut in uneven pieces, some of them empty, and nothing else moves.

# %%
def hits(sizes):
    mesh = shardlab.this_rank().mesh
    x = torch.arange(54.0).reshape(18, 3)
    st = shardlab.distribute(x, mesh, [Shard(0)], [sizes])
    with shardlab.trace() as t:
        where = torch.nonzero(st > 40)  # (hits, 2): the row and column of each hit
        values = torch.masked_select(st, st > 40)  # (hits,)
    same = torch.equal(where.full_tensor(), torch.nonzero(x > 40)) and torch.equal(
        values.full_tensor(), torch.masked_select(x, x > 40)
    )
    return same, t.counts(), where.sharding


results = ranks.run(hits, SIZES)
for rank, (same, counts, where) in enumerate(results):
    print(f"rank {rank}: rows {SIZES[rank]}, hits {where.sizes_along(0)[rank]}, messages {counts}")
    assert same and counts == {"all_gather": 2}  # one count per rank, per op
print("the result's pieces:", results[0][2].sizes_along(0))
viz.plot_placements(results[0][2])

# %% [markdown]
# The last rows hold every hit, so the last rank holds most of the result and the first
# ranks hold none of it. A later op on `where` runs on these pieces, as on any other cut.

# %% [markdown]
# ## Your turn: the placement explorer
#
# Change the mesh (`4` or `2,2`), the placements (`Shard(0), Replicate()`), the shape
# and the sizes of every piece, and watch who owns what. Try sizes that do not add up,
# or a `Shard` of a dim the shape does not have: the error shows inside the widget.

# %%
viz.placement_explorer(mesh="4", placements="Shard(0)", shape="18,3", sizes="5,5,4,4")

# %% [markdown]
# Close the ranks.

# %%
ranks.close()
