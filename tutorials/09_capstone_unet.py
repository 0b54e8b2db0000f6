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
# # 09 · Capstone: train a U-Net domain-parallel
#
# Everything together: a small U-Net (convolutions, batch norm, pooling,
# transposed convolution, bilinear upsampling, skip connections) learns to
# segment synthetic images. Each image is cut into bands of rows, one per rank;
# rank 0 loads the data and `scatter_tensor` sends each rank its band. The
# model is written for one device and runs unchanged inside `shardlab.patched()`.
#
# The claim to check: **the loss curve is the single-device loss curve, step by
# step**, because every sharded op computes exactly what torch computes.

# %%
import matplotlib.pyplot as plt
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Shard
from tqdm.auto import tqdm

import shardlab
from shardlab import viz
from shardlab.layout import chunk_sizes

WORLD = 4  # try 2 or 3
STEPS, BATCH, SIZE = 30, 4, 32  # 30 steps of 4 images of 32 x 32 pixels
# row bands in multiples of 4, so that two 2x poolings halve every band exactly
ROWS = [4 * k for k in chunk_sizes(SIZE // 4, WORLD)]
ranks = shardlab.Ranks(WORLD)
print("rows per rank:", ROWS)

# %% [markdown]
# ## Data: shapes to find
#
# Each image holds a few discs and squares on a noisy background; the label of
# each pixel is 0 (background), 1 (disc) or 2 (square). Same seed, same data.

# %%
def make_batch(step, batch=BATCH, size=SIZE):
    """(images (B, 1, size, size) float64, labels (B, size, size) int64) for one step."""
    gen = torch.Generator().manual_seed(step)
    yy, xx = torch.meshgrid(torch.arange(size), torch.arange(size), indexing="ij")
    labels = torch.zeros(batch, size, size, dtype=torch.int64)
    for b in range(batch):
        for _ in range(3):
            cy, cx, r = (torch.randint(4, size - 4, (2,), generator=gen).tolist()
                         + [int(torch.randint(3, 7, (1,), generator=gen))])
            if torch.rand(1, generator=gen) < 0.5:
                labels[b][(yy - cy) ** 2 + (xx - cx) ** 2 <= r * r] = 1  # disc
            else:
                labels[b][((yy - cy).abs() <= r) & ((xx - cx).abs() <= r)] = 2  # square
    noise = torch.randn(batch, 1, size, size, generator=gen, dtype=torch.float64)
    images = labels.double().unsqueeze(1) * 0.6 + 0.3 * noise
    return images, labels


images, labels = make_batch(0)
fig, axes = plt.subplots(1, 4, figsize=(9, 2.4))
for ax, img, title in zip(axes, [images[0, 0], labels[0], images[1, 0], labels[1]],
                          ["image", "labels", "image", "labels"]):
    ax.imshow(img, cmap="gray") if title == "image" else ax.imshow(img, vmin=0, vmax=2)
    for edge in torch.tensor(ROWS).cumsum(0)[:-1]:
        ax.axhline(edge - 0.5, color="red", lw=1)  # where the ranks' bands meet
    ax.set_title(title)
    ax.axis("off")

# %% [markdown]
# The red lines are the band boundaries: every rank holds a band of every image
# (`Shard(2)` of `(N, C, H, W)`):

# %%
viz.plot_placements(mesh_shape=(WORLD,), placements=[Shard(2)], global_shape=(BATCH, 1, SIZE, SIZE),
                    sizes=[ROWS], dims=(2, 3))

# %% [markdown]
# ## The model, written for one device

# %%
def block(cin, cout):
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(),
        nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU())


class UNet(nn.Module):
    def __init__(self, width=8, classes=3):
        super().__init__()
        self.enc1, self.enc2 = block(1, width), block(width, 2 * width)
        self.bottom = block(2 * width, 2 * width)
        self.up = nn.ConvTranspose2d(2 * width, 2 * width, 2, stride=2)
        self.dec2, self.dec1 = block(4 * width, width), block(2 * width, width)
        self.head = nn.Conv2d(width, classes, 1)

    def forward(self, x):  # (N, 1, H, W)
        x1 = self.enc1(x)  # (N, w, H, W)
        x2 = self.enc2(F.max_pool2d(x1, 2))  # (N, 2w, H/2, W/2)
        x3 = self.bottom(F.max_pool2d(x2, 2))  # (N, 2w, H/4, W/4)
        y2 = self.dec2(torch.cat([x2, self.up(x3)], 1))  # (N, w, H/2, W/2)
        y1 = F.interpolate(y2, scale_factor=2, mode="bilinear", align_corners=False)
        return self.head(self.dec1(torch.cat([x1, y1], 1)))  # (N, classes, H, W)


def new_model_and_optimizer():
    torch.manual_seed(0)
    model = UNet().double()  # float64: the curves agree to ~1e-15, see below
    return model, torch.optim.Adam(model.parameters(), lr=3e-3)

# %% [markdown]
# ## One device
#
# The reference: plain PyTorch, in this notebook's process.

# %%
model, optimizer = new_model_and_optimizer()
single_device = []
for step in tqdm(range(STEPS), desc="one device"):
    images, labels = make_batch(step)
    loss = F.cross_entropy(model(images), labels)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    single_device.append(loss.item())
reference_model = model

# %% [markdown]
# ## Domain-parallel, on the ranks
#
# Each rank keeps its model and optimizer in its namespace (`this_rank().ns`).
# One training step, on every rank:
#
# 1. rank 0 makes the batch; `scatter_tensor` sends each rank its band of rows;
# 2. forward: a halo before every 3×3 convolution and the bilinear upsampling,
#    one all-reduce per batch norm for the exact mean and variance over all bands;
# 3. `F.cross_entropy` averages over all pixels of all bands (one all-reduce);
# 4. backward: halo gradients go back to their owners, one all-reduce per batch
#    norm (its input gradient needs sums over all bands too), and the weight
#    gradients are summed over the ranks, so every rank takes the same step.

# %%
def setup():
    ns = shardlab.this_rank().ns  # this rank's namespace: kept between calls
    ns["model"], ns["optimizer"] = new_model_and_optimizer()


def train_step(step, rows):
    me = shardlab.this_rank()
    model, optimizer = me.ns["model"], me.ns["optimizer"]
    images, labels = make_batch(step) if me.rank == 0 else (None, None)  # data on rank 0 only
    with shardlab.patched():
        x = shardlab.scatter_tensor(images, 0, me.mesh, [Shard(2)], sizes=[rows])  # (B, 1, H_r, W)
        y = shardlab.scatter_tensor(labels, 0, me.mesh, [Shard(1)], sizes=[rows])  # (B, H_r, W)
        loss = F.cross_entropy(model(x), y)  # the mean over every pixel of the batch
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return loss.full_tensor().item()


ranks.run(setup)
domain_parallel = []
for step in tqdm(range(STEPS), desc=f"{WORLD} ranks"):
    losses = ranks.run(train_step, step, ROWS)
    assert len(set(losses)) == 1  # every rank computed the same loss
    domain_parallel.append(losses[0])

# %% [markdown]
# ## The two loss curves

# %%
fig, ax = plt.subplots(figsize=(6, 3))
ax.plot(single_device, lw=4, alpha=0.4, label="one device")
ax.plot(domain_parallel, "k.--", lw=1, label=f"{WORLD} ranks, domain-parallel")
ax.set_xlabel("step")
ax.set_ylabel("cross-entropy")
ax.legend()
worst = max(abs(a - b) / abs(b) for a, b in zip(domain_parallel, single_device))
print(f"largest relative difference over {STEPS} steps: {worst:.1e}")
assert worst < 1e-12  # the sums are only ordered differently

# %% [markdown]
# The curves coincide to ~1e-15, the last digits of float64: sums taken in a
# different order, nothing more. (In float32 the same run agrees to about 1e-4:
# Adam divides each update by the root of its running mean of squared
# gradients, element by element, which magnifies rounding where gradients are
# small.) The weights agree too:

# %%
def weights():
    return {k: v.detach() for k, v in shardlab.this_rank().ns["model"].state_dict().items()}


trained = ranks.run(weights)
for name, value in reference_model.state_dict().items():
    for rank in range(WORLD):
        assert torch.allclose(trained[rank][name].double(), value.double(),
                              rtol=1e-10, atol=1e-12), name
print("every rank's weights and batch-norm statistics match the single-device model")

# %% [markdown]
# What the model learned, on a new batch (predicted on one device):

# %%
images, labels = make_batch(1000)
reference_model.eval()
with torch.no_grad():
    predicted = reference_model(images).argmax(1)
fig, axes = plt.subplots(1, 3, figsize=(7, 2.4))
shown = [images[0, 0], labels[0], predicted[0]]
for ax, img, title in zip(axes, shown, ["image", "labels", "predicted"]):
    ax.imshow(img, cmap="gray") if title == "image" else ax.imshow(img, vmin=0, vmax=2)
    ax.set_title(title)
    ax.axis("off")
print(f"pixel accuracy: {(predicted == labels).float().mean():.2f}")

# %%
ranks.close()
