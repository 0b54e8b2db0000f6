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
# # 03 · Tensor parallelism: an MLP and an attention block
#
# Tensor parallelism cuts each **weight matrix** over the ranks, so a layer too
# large for one device fits on several. PyTorch describes the cut per module
# with a *plan* and applies it with `parallelize_module`:
#
# - `ColwiseParallel()`: `nn.Linear` whose **output features** are sharded
#   (weight `Shard(0)`). Input replicated, output sharded on its last dim.
# - `RowwiseParallel()`: `nn.Linear` whose **input features** are sharded
#   (weight `Shard(1)`). Each rank's product is a partial sum (notebook 01), so
#   the output needs one all-reduce.
#
# A column-wise layer followed by a row-wise one needs **no communication
# between them**: the sharded output of the first is exactly the sharded input
# of the second.

# %%
import copy

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Partial, Replicate, Shard

import shardlab
from shardlab import viz

WORLD = 4  # try 2 or 3
ranks = shardlab.Ranks(WORLD)
DIM, HEADS, T = 48, 12, 12  # 12 heads and 12 tokens: divisible by 1, 2, 3, 4 ranks


class MLP(nn.Module):
    def __init__(self, dim=DIM):
        super().__init__()
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):  # (B, T, dim)
        return self.down(F.gelu(self.up(x)))  # (B, T, 4 dim) in between

# %% [markdown]
# ## An MLP: column-wise, then row-wise
#
# Every rank builds the same model (same seed), keeps an unsharded copy as the
# single-device reference, and lets `parallelize_module` shard the weights.

# %%
def tensor_parallel_mlp():
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    mesh = shardlab.this_rank().mesh
    torch.manual_seed(0)
    reference = MLP().double()
    mlp = parallelize_module(copy.deepcopy(reference), mesh,
                             {"up": ColwiseParallel(), "down": RowwiseParallel()})
    x = torch.randn(2, T, DIM, dtype=torch.float64, requires_grad=True)  # replicated input
    x_ref = x.detach().clone().requires_grad_()
    reference(x_ref).square().sum().backward()

    with shardlab.trace() as forward:
        y = mlp(x)  # a plain tensor again, the same on every rank
    with shardlab.trace() as backward:
        y.square().sum().backward()
    grads_equal = all(torch.allclose(p.grad.full_tensor(), r.grad)
                      for p, r in zip(mlp.parameters(), reference.parameters()))
    return (torch.allclose(y, reference(x_ref)), grads_equal, torch.allclose(x.grad, x_ref.grad),
            forward.counts(), backward.counts(),
            mlp.up.weight.placements, mlp.down.weight.placements)


for rank, (same, grads, x_grad, fwd, bwd, up, down) in enumerate(ranks.run(tensor_parallel_mlp)):
    assert same and grads and x_grad
print(f"up.weight {up}, down.weight {down}")
print(f"forward: {fwd}, backward: {bwd}")
assert fwd == bwd == ({"all_reduce": 1} if WORLD > 1 else {})

# %% [markdown]
# One all-reduce forward (after `down`) and one backward (the gradient of the
# replicated input `x`, which each rank only has a share of). The weights as
# a picture: `up.weight` (4·dim × dim) is cut by rows, `down.weight` (dim × 4·dim)
# by columns, so rank r's slice of the hidden features meets its own slice of
# `down`.

# %%
viz.plot_placements(mesh_shape=(WORLD,), placements=[Shard(0)], global_shape=(4 * DIM, DIM),
                    title="up.weight: ColwiseParallel → Shard(0)")

# %%
viz.plot_placements(mesh_shape=(WORLD,), placements=[Shard(1)], global_shape=(DIM, 4 * DIM),
                    title="down.weight: RowwiseParallel → Shard(1)")

# %% [markdown]
# ## Attention: whole heads per rank
#
# Multi-head attention is parallel over heads. Column-wise `q`, `k`, `v` give
# each rank the features of `HEADS / N` heads; the attention of those heads is
# local; the row-wise `o` adds the ranks' contributions. `ColwiseParallel`
# returns plain local tensors by default (`use_local_output=True`): `q` is this
# rank's `(B, T, dim / N)`, so the module only has to say "as many heads as I
# have features" (`view(B, T, -1, head_dim)`).
#
# ## Sequence parallelism around it
#
# Between the blocks, the activations are replicated: every rank would hold the
# whole `(B, T, dim)` and run the same LayerNorm. `SequenceParallel()` keeps
# them **sharded on the sequence** instead (`Shard(1)`), and LayerNorm runs on
# each rank's tokens. Three settings move activations between the layouts:
#
# - `PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate())`
#   on the attention and the MLP: all-gather the tokens before the column-wise layers;
# - `RowwiseParallel(output_layouts=Shard(1))`: a **reduce-scatter** instead of
#   an all-reduce, back to sequence shards;
# - `PrepareModuleOutput` on the block: gather the sequence at the very end.

# %%
class Attention(nn.Module):
    def __init__(self, dim=DIM, heads=HEADS):
        super().__init__()
        self.head_dim = dim // heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x):  # (B, T, dim)
        B, T, _ = x.shape
        # (B, heads_local, T, head_dim): as many heads as this rank has features
        q, k, v = (f(x).view(B, T, -1, self.head_dim).transpose(1, 2)
                   for f in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, heads_local, T, head_dim)
        return self.o(y.transpose(1, 2).reshape(B, T, -1))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(DIM), Attention()
        self.norm2, self.mlp = nn.LayerNorm(DIM), MLP()

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


def block_plan():
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   RowwiseParallel, SequenceParallel)

    gather_tokens = PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate())
    return {
        "norm1": SequenceParallel(),
        "attn": gather_tokens,
        "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
        "attn.o": RowwiseParallel(output_layouts=Shard(1)),
        "norm2": SequenceParallel(),
        "mlp": gather_tokens,
        "mlp.up": ColwiseParallel(),
        "mlp.down": RowwiseParallel(output_layouts=Shard(1)),
    }

# %%
def tensor_and_sequence_parallel_block():
    from torch.distributed.tensor.parallel import (PrepareModuleInput, PrepareModuleOutput,
                                                   parallelize_module)

    mesh = shardlab.this_rank().mesh
    torch.manual_seed(0)
    reference = Block().double()
    block = parallelize_module(copy.deepcopy(reference), mesh, block_plan())
    # the whole block: replicated tokens in, of which each rank keeps its slice of the
    # sequence as a *plain* tensor (use_local_output=True): SequenceParallel reads a plain
    # input as this rank's shard, and the residual adds stay plain + plain; all tokens out
    parallelize_module(block, mesh, PrepareModuleInput(
        input_layouts=Replicate(), desired_input_layouts=Shard(1), use_local_output=True))
    parallelize_module(block, mesh, PrepareModuleOutput(
        output_layouts=Shard(1), desired_output_layouts=Replicate()))

    x = torch.randn(2, T, DIM, dtype=torch.float64)  # (B, T, dim), the same on every rank
    y_ref = reference(x)
    y_ref.square().sum().backward()
    with shardlab.trace() as forward, shardlab.trace.label("block", "forward"):
        y = block(x)  # (B, T, dim)
    with shardlab.trace() as backward, shardlab.trace.label("block", "backward"):
        y.square().sum().backward()
    grads_equal = all(torch.allclose(p.grad.full_tensor(), r.grad)
                      for p, r in zip(block.parameters(), reference.parameters()))
    return (torch.allclose(y, y_ref), grads_equal, forward.counts(), backward.counts(),
            block.norm1.weight.grad.placements)


results = ranks.run(tensor_and_sequence_parallel_block)
for same, grads, fwd, bwd, norm_grad in results:
    assert same and grads
print(f"forward: {fwd}\nbackward: {bwd}\nnorm1.weight.grad: {norm_grad}")
if WORLD > 1:
    assert all(ng == (Partial(),) for *_, ng in results)  # summed only when read
    assert fwd == {"all_gather": 3, "reduce_scatter": 2}
    assert bwd == {"all_gather": 2, "reduce_scatter": 2}

# %% [markdown]
# Forward: all-gather → attention → reduce-scatter, all-gather → MLP →
# reduce-scatter, and one all-gather for the block's output. An all-gather plus
# a reduce-scatter moves as many bytes as the all-reduce it replaces, but no
# rank ever holds or normalises all the tokens between the layers. Backward
# mirrors it. The LayerNorm weights are replicated but each rank saw only its
# tokens, so their gradients stay `Partial` until someone needs the sum
# (`full_tensor()` here; an optimizer step would all-reduce them).
#
# Forward and backward as collectives (the trace also saw the set-up and the
# checks; we keep what the block did):

# %%
with shardlab.trace() as t:
    ranks.run(tensor_and_sequence_parallel_block)
viz.plot_collectives(t.filter(label="block"))

# %%
ranks.close()
