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
# # 08 · Domain parallelism and FSDP on a 2-D mesh
#
# Two kinds of parallelism, one per mesh dim:
#
# - **`dp`** (data parallel, with FSDP): each row of the mesh trains on different
#   images. `fully_shard` cuts every parameter over the `dp` ranks, so between
#   steps each rank stores only `1/dp` of the model, and gathers it for the step.
#   (Here the whole model is one FSDP unit, gathered once; calling `fully_shard`
#   on each layer first gathers and frees layer by layer.)
# - **`domain`**: inside a row, each *image* is cut into bands of rows (notebook
#   06); the unchanged `nn.Conv2d` exchanges halos with the neighbours.
#
# ```
#  WORLD = 4    domain →
#         ┌──────────┬──────────┐
#  dp 0   │ rank 0   │ rank 1   │   images 0-1: rows split between ranks 0 and 1
#         ├──────────┼──────────┤
#  dp 1   │ rank 2   │ rank 3   │   images 2-3: rows split between ranks 2 and 3
#         └──────────┴──────────┘
# ```
#
# With 2 ranks the mesh is 2 x 1 (FSDP only, no halos); with 3 it is 1 x 3
# (domain only; FSDP over one rank moves nothing). We check one training step
# against the same model on one device.

# %%
import copy

import matplotlib.pyplot as plt
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Shard

import shardlab
from shardlab import viz

WORLD = 4  # try 2 or 3
DP = 2 if WORLD % 2 == 0 else 1  # mesh (DP, WORLD // DP)
BATCH, CHANNELS, H, W = 4, 3, 13, 10  # the global batch: 4 images of 13 x 10 pixels
ranks = shardlab.Ranks(WORLD)

# %% [markdown]
# The input on the 2-D mesh: the batch dim sharded over `dp`, the image rows
# over `domain` (13 rows do not split evenly: shardlab's sizes are exact).

# %%
viz.plot_placements(mesh_shape=(DP, WORLD // DP), placements=[Shard(0), Shard(2)],
                    global_shape=(BATCH, CHANNELS, H, W), dims=(0, 2),
                    title="input (N, C, H, W): N over dp, H over domain")

# %%
def model():
    return nn.Sequential(nn.Conv2d(CHANNELS, 8, 3, padding=1), nn.GELU(),
                         nn.Conv2d(8, 8, 3, padding=1), nn.GELU(),
                         nn.Conv2d(8, 2, 1)).double()


def data():
    torch.manual_seed(1)
    images = torch.randn(BATCH, CHANNELS, H, W, dtype=torch.float64)
    return images, images[:, :2].tanh()  # a target the model can learn


def one_step(dp):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    me = shardlab.this_rank()
    mesh = init_device_mesh(me.device.type, (dp, me.world_size // dp),
                            mesh_dim_names=("dp", "domain"))
    torch.manual_seed(0)
    reference = model()
    net = fully_shard(copy.deepcopy(reference), mesh=mesh["dp"])  # parameters: Shard(0) over dp
    images, target = data()

    # 1. single device: the whole batch
    F.mse_loss(reference(images), target).backward()
    torch.optim.SGD(reference.parameters(), lr=0.1).step()

    # 2. my images (dp) and my rows of them (domain)
    per_row = BATCH // dp
    mine = slice(mesh["dp"].get_local_rank() * per_row, (mesh["dp"].get_local_rank() + 1) * per_row)
    with shardlab.patched(), shardlab.trace() as t:
        x = shardlab.distribute(images[mine], mesh["domain"], [Shard(2)])  # (B/dp, C, H_local, W)
        y = shardlab.distribute(target[mine], mesh["domain"], [Shard(2)])
        loss = F.mse_loss(net(x), y)  # the mean over my dp row's images
        loss.backward()  # FSDP averages the gradients over dp: the mean over the whole batch
    pairs = list(zip(net.parameters(), reference.parameters()))
    same = all(torch.allclose(p.grad.full_tensor(), r.grad, rtol=1e-10, atol=1e-12)
               for p, r in pairs)  # the gradients: FSDP's shards, put together
    torch.optim.SGD(net.parameters(), lr=0.1).step()
    same &= all(torch.allclose(p.full_tensor(), r, rtol=1e-10, atol=1e-12) for p, r in pairs)
    groups = {(e.kind, tuple(e.group) if e.peer is None else (e.peer,)) for e in t.events}
    return same, net[0].weight.placements, t.counts(by="kind"), sorted(groups), t.events


results = ranks.run(one_step, DP)
assert all(same for same, *_ in results)  # gradients and parameters after one step: one device's
same, placements, counts, groups, _ = results[0]
print(f"conv weight placements: {placements}\nrank 0 messages: {counts}")
for kind, group in groups:
    where = "with rank" if kind in ("send", "recv") else "within ranks"
    print(f"  {kind:15} {where} {list(group)}")
for _, _, counts, _, _ in results:
    if DP > 1:  # FSDP: one gather of the parameters, one reduce-scatter of the gradients
        assert counts["all_gather"] == 1 and counts["reduce_scatter"] == 1
    if WORLD // DP > 1:  # domain: halos, and one all-reduce of weight + bias gradients per conv (3)
        assert counts["send"] > 0 and counts["recv"] > 0 and counts["all_reduce"] == 3

# %% [markdown]
# What happened on rank 0, by group:
#
# - `all_gather` over the `dp` group, once per step: FSDP gathers all parameters
#   before the forward and keeps them through the backward (the root unit is not
#   resharded after forward); `reduce_scatter` over `dp`: each rank gets the
#   dp-average of the gradient of its own parameter shard (FSDP divides by dp,
#   then reduce-scatters with a sum).
# - `send`/`recv` within the `domain` group: the halo rows of the convolutions,
#   forward and backward (a 1×1 conv needs none).
# - `all_reduce` within the `domain` group: the weight and bias gradients of each
#   convolution (one all-reduce for both), which every band of rows contributes to.
#   (The loss itself stays a partial sum until someone reads it: no message.)
#
# Neither kind of parallelism needs to know about the other: they meet only in
# the mesh. As a picture: the training step's messages on every rank (the
# events each rank's own trace recorded, put together):

# %%
step = shardlab.trace.Trace([e for *_, events in results for e in events])
fig, ax = plt.subplots(figsize=(15, 4))
_ = viz.plot_collectives(step, ax=ax)

# %%
ranks.close()
