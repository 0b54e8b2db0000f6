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
# # 06 · Domain-parallel convolution: halos
#
# An image too large for one device can be cut into bands of rows, one band
# per rank. A 3×3 convolution at the edge of a band needs one row that lives
# on the neighbouring rank: the **halo**. Each rank receives exactly those rows,
# then runs an ordinary convolution on its band.

# %%
import torch
from torch.distributed.tensor import Shard

import shardlab
from shardlab import viz

WORLD = 4  # try 2 or 3
ranks = shardlab.Ranks(WORLD)
SIZES = [3 + (r % 2) for r in range(WORLD)]  # rows per rank: [3, 4, 3, 4]
print("rows per rank:", SIZES)

# %% [markdown]
# ## Who needs which rows
#
# The picture comes from the same plan the convolution uses: each rank's own
# rows, the halo rows it receives (in the sender's colour), and the zero
# padding at the image border.

# %%
viz.plot_halos(SIZES, kernel_size=3, padding=1)

# %% [markdown]
# With a stride, a dilation or a larger kernel the halos change; try
# `viz.plot_halos(SIZES, kernel_size=5, dilation=2, padding=4)`: shards smaller
# than the halo get rows from ranks further away.

# %% [markdown]
# ## The unchanged `nn.Conv2d`
#
# Inside `shardlab.patched()`, `torch.nn.functional.conv2d` sends ShardTensors to
# the halo convolution; the module itself is untouched. We compare with the same
# convolution on one device, forward and backward.

# %%
def run_conv(sizes):
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 4, 3, padding=1).double()
    image = torch.randn(1, 3, sum(sizes), 8, dtype=torch.float64)
    reference = conv(image)
    mesh = shardlab.this_rank().mesh
    x = image.clone().requires_grad_()
    with shardlab.patched():
        sharded = shardlab.distribute(x, mesh, [Shard(2)], sizes=[sizes])  # (1, 3, H_local, 8)
        with shardlab.trace() as t:
            y = conv(sharded)  # (1, 4, H_local, 8), same sizes as the input
    y.full_tensor().sum().backward()
    image_ref = image.clone().requires_grad_()
    conv(image_ref).sum().backward()
    same = torch.allclose(y.full_tensor(), reference)
    same_grad = torch.allclose(x.grad, image_ref.grad)
    return same, same_grad, t.events


results = ranks.run(run_conv, SIZES)
assert all(same and same_grad for same, same_grad, _ in results)
print("forward and input gradient equal single device on every rank")

# %% [markdown]
# ## The messages
#
# The tracer recorded every message: one row (3 channels × 8 columns × 8 bytes
# = 192 bytes) to each neighbour, nothing else.

# %%
from shardlab.trace import Trace

trace = Trace([e for _, _, events in results for e in events])
print(trace.table())
assert all(e.bytes == 3 * 8 * 8 for e in trace)
viz.plot_collectives(trace)

# %%
ranks.close()
