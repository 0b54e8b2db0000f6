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

# %% [markdown]
# ## Neighborhood attention: the same halos, for attention
#
# Neighborhood attention (NATTEN's `na2d`, used by weather and high-resolution vision
# transformers) lets each pixel attend to the `k × k` pixels around it; at the image
# border the window shifts inward, so every pixel sees exactly `k × k` keys. On an
# image cut along H that is a halo op: a rank needs the K/V rows its queries see, never
# the whole image. Below: a 3 × 3 window of a query in the first row of rank 1 reaches
# into rank 0's last row.

# %%
import matplotlib.pyplot as plt  # noqa: E402

from shardlab.layout.neighborhood import neighbors  # noqa: E402
from shardlab.ops.neighborhood import na2d  # noqa: E402

H_IMG, W_IMG, K = sum(SIZES), 8, 3
q_row, q_col = SIZES[0], 4  # the first row of rank 1
fig, ax = plt.subplots(figsize=(4, 4))
owner = torch.repeat_interleave(torch.arange(WORLD), torch.tensor(SIZES))
ax.imshow(owner[:, None].expand(H_IMG, W_IMG), cmap="Pastel1", vmin=0, vmax=8)
for i in neighbors(H_IMG, K, 1, False)[q_row]:
    for j in neighbors(W_IMG, K, 1, False)[q_col]:
        ax.add_patch(plt.Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, lw=2))
ax.plot(q_col, q_row, "k*", ms=12)
ax.set_title("a 3×3 neighborhood crossing a shard boundary (colour: owner)")
ax.set_xlabel("W")
_ = ax.set_ylabel("H")


# %%
def run_na():
    me = shardlab.this_rank()
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, H_IMG, W_IMG, 2, 4, dtype=torch.float64) for _ in range(3))
    reference = na2d(q, k, v, K)  # plain tensors: the single-device result
    with shardlab.trace() as t:
        sharded = [shardlab.distribute(x, me.mesh, [Shard(1)], sizes=[SIZES]) for x in (q, k, v)]
        out = na2d(*sharded, K)
    rows = sum(e.bytes for e in t.events if e.kind == "recv") // (W_IMG * 2 * 8 * 8)
    return torch.allclose(out.full_tensor(), reference), rows


na = ranks.run(run_na)
assert all(same for same, _ in na)
print("K/V rows received per rank (K and V together):", [rows for _, rows in na])
assert [rows for _, rows in na] == [(r > 0) + (r < WORLD - 1) for r in range(WORLD)]

# %% [markdown]
# ## Your turn: the halo explorer
#
# Move the kernel size, stride, dilation and padding, or type uneven sizes, and watch which
# rows each rank receives from its neighbours and how many bytes move (the table below the
# figure). Try a shard smaller than the halo: the rows then come from two ranks away.

# %%
viz.halo_explorer(kernel=3, sizes="5,5,4,4")

# %%
ranks.close()
