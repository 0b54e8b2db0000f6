# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.7
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 15 · Predict, then measure: memory, messages, and a cluster
#
# Before a run on many GPUs, two questions: does it fit, and how long will its
# messages take? This notebook answers both with formulas, checks the formulas on the
# ranks at hand, then projects the steps of tutorials 09 (a U-Net, domain parallel) and
# 10 (a Llama, sequence parallel) onto a cluster of 8, 64 and 512 GPUs described by its
# published figures.
#
# 1. **Memory**: ZeRO's stages, the paper's formula against what each rank holds.
# 2. **Messages**: a latency + bandwidth model calibrated here, against a traced step.
# 3. **A cluster**: NVLink, InfiniBand and GPU throughput as named parameters; where
#    communication stops hiding behind compute.

# %%
import ast
import functools
import pathlib

import torch
import torch.nn as nn
import torch.nn.functional as F
import transformers
from IPython.display import display
from torch.distributed.tensor import Shard

import shardlab
from shardlab import cost, zero

WORLD = 4  # try 2 or 3
ranks = shardlab.Ranks(WORLD)

# %% [markdown]
# ## 1 · Memory: ZeRO's stages, formula against measured
#
# Ψ parameters, N ranks, Adam in float32 (4 bytes per parameter, 4 per gradient, 8 of
# optimizer state): stage 0 (DDP) keeps all 16 Ψ bytes on every rank, stage 1 cuts the
# optimizer state in N, stage 2 the gradients too, stage 3 the parameters as well.
# `zero.compare` builds each stage from torch's own pieces (DDP,
# `ZeroRedundancyOptimizer`, FSDP2), trains a small Llama two steps and counts what each
# rank holds (guide: `docs/guides/zero.md`).

# %%
llama = functools.partial(zero.llama, layers=1, hidden=32, vocab=64)
rows = zero.compare(ranks, llama, functools.partial(zero.tokens, vocab=64))
print(zero.table(rows))
for r in rows:
    assert abs(r.ratio("states") - 1) < 0.15, (r.stage, r.ratio("states"))
print("held / formula, per stage:", [round(r.ratio("states"), 3) for r in rows])
display(zero.plot(rows, title=f"a 1-block Llama on {WORLD} ranks"))

# %% [markdown]
# The bars agree because the formula counts exactly what a rank keeps between steps.
# The peak of a step (the black ticks) also holds the activations and the parameters
# FSDP gathers: the formula adds them, less exactly (the table's peak ratio).
#
# ## 2 · Messages: a model calibrated on these ranks
#
# One message costs `α + n·β` (latency, then bytes over bandwidth); a collective is a
# schedule of such messages (a ring all-reduce: `2(p-1)` of `n/p` bytes). `calibrate`
# times a few sizes of each kind here and fits `α`, `β` per kind (guide:
# `docs/guides/cost.md`).

# %%
model = cost.calibrate(ranks, repeats=3)
print(model)

# %% [markdown]
# ### Tutorial 09's U-Net, one training step
#
# The model is read from tutorial 09 itself; each rank holds a band of rows; Adam. We
# trace three steps after a warm-up and predict each message.

# %%
tree = ast.parse(pathlib.Path("09_capstone_unet.py").read_text())
keep = [n for n in tree.body if getattr(n, "name", "") in ("block", "UNet")]
source = ast.unparse(ast.Module(keep, type_ignores=[]))
namespace = {"nn": nn, "F": F, "torch": torch, "__name__": "__main__"}
exec(source, namespace)  # tutorial 09's block and UNet, as written there
UNet = namespace["UNet"]
SIZE = 32  # pixels per side; 4 images


def unet_setup():
    from shardlab.layout import chunk_sizes

    me = shardlab.this_rank()
    torch.manual_seed(0)
    net = UNet().double()
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)
    rows = [4 * k for k in chunk_sizes(SIZE // 4, me.world_size)]
    gen = torch.Generator().manual_seed(0)
    images = torch.randn(4, 1, SIZE, SIZE, dtype=torch.float64, generator=gen)
    labels = torch.randint(0, 3, (4, SIZE, SIZE), generator=gen)

    def step():
        with shardlab.patched():
            root = me.rank == 0
            x = shardlab.scatter_tensor(
                images if root else None, 0, me.mesh, [Shard(2)], sizes=[rows]
            )
            y = shardlab.scatter_tensor(
                labels if root else None, 0, me.mesh, [Shard(1)], sizes=[rows]
            )
            loss = F.cross_entropy(net(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()

    me.ns["step"] = step


def one_step():
    shardlab.this_rank().ns["step"]()


def traced_steps(setup, n=3):
    ranks.run(setup)
    ranks.run(one_step)  # warm-up
    traces = []
    for _ in range(n):
        with shardlab.trace() as t:
            ranks.run(one_step)
        traces.append(t)
    return traces


unet_traces = traced_steps(unet_setup)
unet = cost.predict(unet_traces, model)
print(unet)
assert unet.bytes == unet_traces[0].bytes()  # every traced byte, paired into messages once

# %% [markdown]
# The bytes are the trace's, exactly: the model predicts times, not bytes. The times are
# another matter on this machine: 2 CPU cores shared by the ranks and their gloo threads,
# where a message after some compute waits for its thread to be scheduled again. The model
# describes links; it has no term for a scheduler (measured on 2 cores: the model predicted
# 8-70 % of a step's communication, `docs/guides/cost.md`). So we print the ratio and
# assert only that both are there.

# %%
print(
    f"U-Net step: predicted {unet.predicted * 1e3:.1f} ms, measured {unet.measured * 1e3:.1f} ms,"
    f" ratio {unet.ratio:.2f}"
)
assert unet.predicted > 0 and unet.measured > 0

# %% [markdown]
# ### Tutorial 10's Llama, forward and backward
#
# The sequence is cut over the ranks; the ring carries K and V blocks.

# %%
S = 11


IDS = torch.randint(0, 64, (2, S), generator=torch.Generator().manual_seed(1))


def tiny_llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    cfg._attn_implementation = "sdpa"
    return transformers.LlamaForCausalLM(cfg).double()


def llama_setup():
    from shardlab.lm import shard_batch

    me = shardlab.this_rank()
    net, ids = tiny_llama(), IDS
    sizes = [S // me.world_size + (r < S % me.world_size) for r in range(me.world_size)]

    def step():
        net.zero_grad()
        with shardlab.patched():
            net(**shard_batch(me.mesh, ids, labels=ids, sizes=sizes, causal=True)).loss.backward()

    me.ns["step"] = step


llama_traces = traced_steps(llama_setup)
lm = cost.predict(llama_traces, model)
print(lm)
assert lm.bytes == llama_traces[0].bytes()
print(
    f"Llama step: predicted {lm.predicted * 1e3:.1f} ms, measured {lm.measured * 1e3:.1f} ms, "
    f"ratio {lm.ratio:.2f}"
)

# %% [markdown]
# ## 3 · A cluster, by its parameters
#
# `cost.Cluster` names each figure and where it came from: NVLink within a node,
# InfiniBand between nodes, the GPU's throughput for the compute. The latencies, the
# fraction of bandwidth a collective reaches and the fraction of peak FLOP/s a step
# reaches are **assumptions**, and say so.

# %%
cluster = cost.Cluster()
print("\n".join(cluster.assumptions()))

# %% [markdown]
# ### The recorded steps, as traffic with scaling rules
#
# `recorded_step` groups one rank's messages by dim, kind and label, and names the rule
# each scales by: a **halo** is a tile's edge (the same size whatever the domain degree),
# a **ring** block is a rank's tokens (one more message per extra rank), **gradients**
# are the parameters (all-reduced over every rank that holds the same ones), **stats**
# (BatchNorm) grow with the width, the batch's **input** scatter is left out (at scale
# each GPU reads its own data). Compute: the FLOPs of one device's step
# (`torch.utils.flop_counter`), split evenly over the ranks.


# %%
def unet_flops():
    net = UNet().double()
    x = torch.randn(4, 1, SIZE, SIZE, dtype=torch.float64)
    F.cross_entropy(net(x), torch.zeros(4, SIZE, SIZE, dtype=torch.long)).backward()


def llama_flops():
    tiny_llama()(input_ids=IDS, labels=IDS).loss.backward()


unet_step = cost.recorded_step(
    "U-Net (tutorial 09)",
    unet_traces[0],
    cost.Degrees(domain=WORLD),
    cost.count_flops(unet_flops) / WORLD,
)
llama_step = cost.recorded_step(
    "Llama (tutorial 10)",
    llama_traces[0],
    cost.Degrees(sequence=WORLD),
    cost.count_flops(llama_flops) / WORLD,
)
for t in unet_step.traffic:
    print(f"{t.dim:9} {t.kind:11} {t.rule:10} {t.count:3} x {t.nbytes:6} B  {t.label}")
print(f"U-Net: {unet_step.flops:.3g} FLOP per rank and step")

# %% [markdown]
# The Llama's tensor-parallel messages were not recorded (this run cuts the sequence
# only), so we add them by hand from Megatron-LM's count (Shoeybi et al., 2019): per
# layer, two all-reduces of a rank's activation forward and two backward. The row says
# `assumed=True`, and the figure says so.

# %%
tokens_per_rank = -(-S // WORLD)
megatron = cost.Traffic(
    "tensor",
    "all_reduce",
    "activation",
    nbytes=2 * tokens_per_rank * 16 * 8,
    count=4,
    label="Megatron-LM: 2 all-reduces per layer each way",
    assumed=True,
)
llama_step.traffic.append(megatron)

# %% [markdown]
# ### 8, 64 and 512 GPUs
#
# The recorded steps are tiny; a GPU would hold far more. `Growth` scales a rank's share
# (tokens or pixels, width, layers, bytes per element: bfloat16 against float64) to a
# size one GPU would train, and the degrees say how the GPUs are split. Tensor
# parallelism stays within a node (8 GPUs); the outer dims cross nodes.

# %%
SCALES = {
    "U-Net (tutorial 09)": (
        unet_step,
        {
            8: cost.Degrees(domain=8),
            64: cost.Degrees(domain=8, data=8),
            512: cost.Degrees(domain=8, data=64),
        },
        cost.Growth(tokens=1024, width=8, dtype=0.25),  # 256x1024 px tiles, 64 channels
    ),
    "Llama (tutorial 10)": (
        llama_step,
        {
            8: cost.Degrees(tensor=8),
            64: cost.Degrees(tensor=8, sequence=8),
            512: cost.Degrees(tensor=8, sequence=8, data=8),
        },
        # 4096 tokens per GPU, width 4096, 32 layers: by the width² rule ~9 B parameters
        cost.Growth(tokens=4096 / tokens_per_rank, width=256, layers=32, dtype=0.25),
    ),
}
for step, degrees, growth in SCALES.values():
    for d in degrees.values():
        print(cost.project(step, cluster, d, growth))

# %% [markdown]
# The U-Net's halos stay on NVLink (a domain of 8 is one node) and cost the same at every
# scale; its gradient all-reduce crosses InfiniBand from 64 GPUs on, and at 512 its ring
# of 1022 steps is latency: communication no longer hides. The Llama's tensor all-reduces
# sit on NVLink; its sequence ring crosses nodes (the tensor dim is inside each node).

# %%
for step, degrees, growth in SCALES.values():
    fig = cost.plot_projection(
        [cost.project(step, cluster, d, growth) for d in degrees.values()],
        notes=[f"{t.label} (assumed)" for t in step.traffic if t.assumed],
    )
    display(fig)

# %% [markdown]
# ## Your turn: the projection explorer
#
# Slow the InfiniBand down, change the GPU's FLOP/s or the fraction of it a step reaches,
# put 72 GPUs in a node: the bars and the verdict below each scale follow.

# %%
# NBVAL_IGNORE_OUTPUT
cost.projection_explorer(SCALES, cluster)

# %%
ranks.close()
