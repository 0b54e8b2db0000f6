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
# # 00 · Ranks: one program, many processes
#
# Distributed PyTorch runs **the same program in N processes**. Each process is a
# *rank*: it has a number `0 … N-1`, its own memory, and (on GPUs) its own device.
# Ranks cooperate only by sending tensors to each other: *collectives* such as
# `all_reduce`, and point-to-point `send`/`recv`.
#
# `shardlab.Ranks` starts N ranks from this notebook and keeps them alive, so
# every cell below can talk to them. Change `WORLD` and rerun: everything works
# for 1, 2, 3 or 4 ranks.

# %%
import torch

import shardlab

WORLD = 4  # the number of ranks: try 2 or 3
ranks = shardlab.Ranks(WORLD)  # gloo on CPU; backend="nccl" uses one GPU per rank
ranks

# %% [markdown]
# ## `%%ranks`: run a cell on every rank
#
# Load the extension once. A `%%ranks` cell runs on all ranks at the same time;
# what each rank prints comes back in rank order with a `[rank i]` prefix. Each
# rank starts with a few names: `rank`, `world_size`, `device`, `mesh` (a 1-D
# `DeviceMesh` over all ranks), `torch` and `dist` (`torch.distributed`).

# %%
# %load_ext shardlab

# %%
# %%ranks
print(f"I am rank {rank} of {world_size}, on {device}")

# %% [markdown]
# Every rank has its **own** variables: the same name holds a different value
# on each rank. Here each rank makes a tensor that depends on its rank.

# %%
# %%ranks
x = torch.full((2,), float(rank + 1))  # (2,) on every rank, different values
print(x)

# %% [markdown]
# ## One collective: `all_reduce`
#
# `dist.all_reduce(x)` sums `x` over all ranks and leaves the sum on every rank,
# in place. Every rank must call it, in the same order: a collective is a
# meeting, and a rank that does not come makes the others wait (shardlab stops
# them after a timeout and tells you which rank failed).
#
# `--pull before,after` copies those names back into this kernel as lists, one
# value per rank.

# %%
# %%ranks --pull before,after
before = x.clone()
after = x.clone()
dist.all_reduce(after)  # sum over ranks: 1 + 2 + ... + world_size

# %%
expected = sum(range(1, WORLD + 1))
assert all(torch.equal(a, torch.full((2,), float(expected))) for a in after)
print(f"every rank now holds {after[0].tolist()}")

# %% [markdown]
# As a picture: before, each rank holds its own value; after, every rank holds
# the sum.

# %%
from _helpers import plot_all_reduce

_ = plot_all_reduce(before, after)

# %% [markdown]
# ## Functions instead of cells
#
# `ranks.run(fn, *args)` runs a function on every rank and returns the results
# in rank order. The function may be defined right here in the notebook.
# `shardlab.this_rank()` tells it which rank it is on.

# %%
def mean_of_ranks(scale):
    import torch.distributed as dist

    me = shardlab.this_rank()
    t = torch.tensor([scale * me.rank])
    dist.all_reduce(t)
    return t.item() / me.world_size


results = ranks.run(mean_of_ranks, 2.0)
assert results == [2.0 * sum(range(WORLD)) / WORLD] * WORLD
results

# %% [markdown]
# ## When a rank fails
#
# An exception on any rank raises `shardlab.RankError` here, naming the rank and
# carrying its traceback. If the other ranks were left waiting in a collective,
# the pool restarts itself on the next call.

# %%
def fails_on_last_rank():
    me = shardlab.this_rank()
    if me.rank == me.world_size - 1:
        raise ValueError("something went wrong here")
    return "ok"


try:
    ranks.run(fails_on_last_rank)
except shardlab.RankError as err:
    print(f"rank {err.rank} raised {err.exc_type}: {err.message}")
    assert err.rank == WORLD - 1

# %%
assert ranks.run(lambda: shardlab.this_rank().rank) == list(range(WORLD))

# %% [markdown]
# Close the ranks when you are done (closing the notebook does it too).

# %%
ranks.close()
