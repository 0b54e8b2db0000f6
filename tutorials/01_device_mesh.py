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
# # 01 · DeviceMesh and placements: Shard, Replicate, Partial
#
# A **DeviceMesh** arranges the ranks in a grid: 1-D (a row of ranks) or N-D
# (a grid, one dimension per kind of parallelism). A **DTensor** is one global
# tensor spread over a mesh; for each mesh dim it has a *placement*:
#
# | placement | each rank of that mesh dim holds | global value |
# |---|---|---|
# | `Shard(d)` | one block of tensor dim `d` | the blocks put together |
# | `Replicate()` | the whole tensor | any one copy |
# | `Partial()` | a tensor of the full shape | the **sum** of the ranks' tensors |
#
# This notebook builds meshes, places one tensor in each way and checks every
# result against the plain tensor on one device.

# %%
import torch
from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

import shardlab
from shardlab import viz

WORLD = 4  # try 2 or 3
ROWS = 2 if WORLD % 2 == 0 else 1  # the 2-D mesh below is ROWS x (WORLD // ROWS)
ranks = shardlab.Ranks(WORLD)

# %% [markdown]
# ## Meshes
#
# Every rank calls `init_device_mesh` with the same shape. A 2-D mesh with names
# lets each rank ask for its **coordinate** and for the sub-mesh along one named
# dim: the ranks it talks to for that kind of parallelism. Collectives on a
# sub-mesh only involve the ranks of that group.
#
# Each mesh of two dims made this way opens a process group per dim, which lives
# as long as the ranks do: run the cell again and the ranks hold two sets. In a
# cell you rerun, `shardlab.this_rank().mesh_for((rows, cols), names=("dp", "tp"))`
# makes the mesh once and returns the same one after that.

# %%
def make_meshes(rows):
    from torch.distributed.device_mesh import init_device_mesh

    me = shardlab.this_rank()
    mesh2d = init_device_mesh(me.device.type, (rows, me.world_size // rows),
                              mesh_dim_names=("dp", "tp"))
    return (mesh2d.mesh.tolist(), mesh2d.get_coordinate(),
            mesh2d["tp"].mesh.tolist(), mesh2d["dp"].mesh.tolist())


meshes = ranks.run(make_meshes, ROWS)
for rank, (_, coord, tp_group, dp_group) in enumerate(meshes):
    print(f"rank {rank}: coordinate {coord}, tp group {tp_group}, dp group {dp_group}")
    assert tuple(coord) == divmod(rank, WORLD // ROWS)  # row-major: rank = row * cols + col

# %%
from _helpers import plot_mesh

_ = plot_mesh(meshes[0][0], names=("dp", "tp"),
              title=f"init_device_mesh(({ROWS}, {WORLD // ROWS}))")

# %% [markdown]
# ## `Shard(0)`: each rank holds a block of rows
#
# `distribute_tensor(x, mesh, [Shard(0)])` cuts dim 0 like `torch.chunk` and
# keeps one block per rank. `full_tensor()` puts the blocks back together.

# %%
X = torch.arange(48.0).reshape(8, 6)  # the global tensor, the same on every rank


def place(placements):
    mesh = shardlab.this_rank().mesh  # the 1-D mesh over all ranks
    d = distribute_tensor(X, mesh, placements)
    return d.to_local(), torch.equal(d.full_tensor(), X)


for rank, (block, same) in enumerate(ranks.run(place, [Shard(0)])):
    print(f"rank {rank} holds a block of shape {tuple(block.shape)}")
    assert torch.equal(block, torch.chunk(X, WORLD)[rank]) and same  # torch.chunk's blocks

viz.plot_placements(mesh_shape=(WORLD,), placements=[Shard(0)], global_shape=(8, 6))

# %% [markdown]
# ## `Replicate()`: every rank holds all of it

# %%
for block, same in ranks.run(place, [Replicate()]):
    assert torch.equal(block, X) and same
viz.plot_placements(mesh_shape=(WORLD,), placements=[Replicate()], global_shape=(8, 6))

# %% [markdown]
# ## `Partial()`: the global value is a sum
#
# `Partial` is what you get *before* an all-reduce. It appears by itself when
# a computation sums over a sharded dim. Shard the columns of `A` and the rows
# of `B`: each rank multiplies its own pieces, and `A @ B` is the **sum** of the
# ranks' products. DTensor says so: the result is `Partial()`, and
# `full_tensor()` performs the sum.

# %%
def partial_matmul():
    mesh = shardlab.this_rank().mesh
    torch.manual_seed(0)
    A, B = torch.randn(4, 12, dtype=torch.float64), torch.randn(12, 3, dtype=torch.float64)
    a = distribute_tensor(A, mesh, [Shard(1)])  # (4, 12 / N): some columns of A
    b = distribute_tensor(B, mesh, [Shard(0)])  # (12 / N, 3): the matching rows of B
    c = a @ b  # (4, 3) on every rank: a partial sum
    local = c.to_local()
    return c.placements, local, torch.allclose(c.full_tensor(), A @ B)


results = ranks.run(partial_matmul)
for rank, (placements, local, same) in enumerate(results):
    assert placements == (Partial(),) and same
torch.manual_seed(0)  # the same A and B, here on one device
A, B = torch.randn(4, 12, dtype=torch.float64), torch.randn(12, 3, dtype=torch.float64)
assert torch.allclose(sum(local for _, local, _ in results), A @ B)  # the ranks' sum is A @ B
print("placements of a @ b:", results[0][0])
print("rank 0 alone holds", results[0][1][0].tolist(), "...")
viz.plot_placements(mesh_shape=(WORLD,), placements=[Partial()], global_shape=(4, 3))

# %% [markdown]
# You can also build a `Partial` DTensor from values you computed yourself with
# `DTensor.from_local(local, mesh, [Partial()])`: it records that the global
# value is the sum of the locals, without moving anything.
#
# ## Two mesh dims: one placement each
#
# On the 2-D mesh a DTensor has two placements. `[Shard(0), Shard(1)]` cuts the
# rows over `dp` and the columns over `tp`: a grid of blocks (with 3 ranks the
# mesh is 1 x 3, and only the columns are cut; with 2 it is 2 x 1).
# `[Replicate(), Shard(1)]` cuts only the columns; each `dp` row of the mesh
# holds a copy.

# %%
def place_2d(rows, placements):
    from torch.distributed.device_mesh import init_device_mesh

    me = shardlab.this_rank()
    mesh2d = init_device_mesh(me.device.type, (rows, me.world_size // rows))
    d = distribute_tensor(X, mesh2d, placements)
    return tuple(d.to_local().shape), torch.equal(d.full_tensor(), X)


for placements in ([Shard(0), Shard(1)], [Replicate(), Shard(1)]):
    results = ranks.run(place_2d, ROWS, placements)
    cols = WORLD // ROWS
    for rank, (shape, same) in enumerate(results):
        r, c = divmod(rank, cols)
        rows_here = torch.chunk(X, ROWS)[r] if placements[0] == Shard(0) else X
        assert shape == tuple(torch.chunk(rows_here, cols, dim=1)[c].shape) and same
    display(viz.plot_placements(mesh_shape=(ROWS, cols), placements=placements, global_shape=(8, 6),
                                title=f"{placements} on a {ROWS}x{cols} mesh"))

# %% [markdown]
# Next: `02_redistribute` changes placements and measures what each change costs.

# %%
ranks.close()
