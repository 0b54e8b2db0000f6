# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 11 · Explain a real model, layer by layer
#
# You ran a model sharded and it matched one device. What happened inside? For every
# module, in call order, forward and backward, `shardlab.explain` shows the layout that
# came in and went out (placements with the size of every piece), the messages and
# collectives the module caused (halos, all-reduces, the K/V ring), their bytes, and the
# time and peak memory of each rank.

# %%
import torch
import transformers
from torch.distributed.tensor import Shard

import shardlab

WORLD = 4  # try 2 or 3
ranks = shardlab.Ranks(WORLD)


def tiny_resnet():
    torch.manual_seed(0)
    cfg = transformers.ResNetConfig(
        embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic", num_labels=5
    )
    return transformers.ResNetForImageClassification(cfg)


# %% [markdown]
# ## A vision model on an image cut along H
#
# A `transformers` ResNet (small config, random weights), unchanged; the image's rows are
# cut unevenly over the ranks. `explain` runs one step (forward and the backward of the
# model's own loss) with hooks on every module, then removes them. `memory=True` asks for
# the memory column: on a GPU the allocator reports it for free (it is on by default
# there); on CPU a counter watches every op, which slows the step by about a fifth, so
# it is off unless asked for.


# %%
def explain_resnet():
    mesh = shardlab.this_rank().mesh
    model = tiny_resnet()
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    sizes = [32 // WORLD + (3 if r == 0 else 0) for r in range(WORLD)]
    sizes[-1] += 32 - sum(sizes)
    with shardlab.patched(), shardlab.trace() as t:
        ex = shardlab.explain(
            model,
            memory=True,
            pixel_values=shardlab.distribute(x, mesh, [Shard(2)], [sizes]),
            labels=torch.tensor([1, 3]),
        )
    events = [e for e in t.events if e.label != "explain gather"]
    return ex, (len(events), sum(e.bytes for e in events))


results = ranks.run(explain_resnet)
ex = results[0][0]
ex  # noqa: B018  the HTML table: one row per module and phase (numbers: the largest over the ranks)

# %% [markdown]
# Every message of the step belongs to exactly one module: the totals of the explanation
# equal what a tracer around the same step recorded, on every rank.

# %%
for rank, (_, (count, nbytes)) in enumerate(results):
    total = ex.totals(rank)
    assert total["messages"] + total["collectives"] == count and total["bytes"] == nbytes
print("rank 0:", ex.totals(0))

# %% [markdown]
# The same as a picture: modules down, ranks across, the colour is the bytes a rank
# moved for that module (m: point-to-point messages, c: collectives). The convolutions'
# halos and the batch norms' all-reduces light up; the element-wise layers move nothing.

# %%
ex.plot()

# %% [markdown]
# ## A decoder with its sequence sharded
#
# Now a `transformers` Llama, its tokens cut along the sequence. The attention layers
# carry the ring (K/V messages), the loss its one all-reduce, and the replicated weights'
# gradients one all-reduce for all of them when the backward ends (its own row,
# `(parameters' gradients)`).


# %%
def explain_llama():
    from shardlab.lm import shard_batch

    mesh = shardlab.this_rank().mesh
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
    model = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(2))
    with shardlab.patched():
        return shardlab.explain(model, **shard_batch(mesh, ids, labels=ids))


lm = ranks.run(explain_llama)[0]
attn = [r for r in lm.rows(0) if r.kind == "LlamaAttention"]
ring = [e for r in attn for e in r.events if "sdpa" in e[4]]
print(lm.table().splitlines()[0])
print("\n".join(line for line in lm.table().splitlines() if "self_attn |" in line))
assert ring and all(kind in ("send", "recv") for kind, *_ in ring)  # the ring: messages only

# %%
lm.plot()

# %% [markdown]
# ## What `torch.compile` does to a sharded model
#
# Cut over several ranks, dynamo compiles what sends nothing: plain-tensor code, and
# ShardTensor ops that each rank computes on its own block (element-wise ops, a `Linear` on
# rows). Every message (a halo, an all-reduce) is a *graph break*: the op that sends it runs
# eagerly, exactly as uncompiled, so no compiled graph holds a collective. The layout (shard
# sizes) travels with each ShardTensor into the graph, and dynamo guards on it: a call with
# other sizes compiles anew and never reuses a graph built for the old ones.
# `torch._dynamo.explain` shows the graphs and where they break:


# %%
def compile_a_step(messages_in_graphs=False):
    import contextlib

    import torch.nn.functional as F

    mesh = shardlab.this_rank().mesh
    torch._dynamo.reset()
    w = torch.randn(4, 3, 3, 3, generator=torch.Generator().manual_seed(4))
    x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(5))

    def step(img, w):
        scale = torch.sigmoid(w).mean() * 2  # plain tensors: compiled
        y = F.conv2d(img, w, padding=1)  # ShardTensor: the halo exchange, eagerly
        return (y.relu() * scale).mean()  # ShardTensor ops: eagerly

    sizes = [16 // WORLD + (2 if r == 0 else 0) for r in range(WORLD)]
    sizes[-1] += 16 - sum(sizes)
    img = shardlab.distribute(x, mesh, [Shard(2)], [sizes])
    scope = shardlab.messages_in_graphs() if messages_in_graphs else contextlib.nullcontext()
    with shardlab.patched(), scope:
        explained = torch._dynamo.explain(step)(img, w)
        with shardlab.trace() as t:
            compiled = torch.compile(step, backend="aot_eager")(img, w).full_tensor()
        eager = step(img, w).full_tensor()
    graph = explained.graphs[0].code.strip().splitlines()
    kinds = sorted({e.kind for e in t.events})
    counts = (explained.graph_count, explained.graph_break_count)
    return counts, graph, kinds, torch.equal(compiled, eager)


(graphs, breaks), graph, kinds, same = ranks.run(compile_a_step)[0]
assert same  # the compiled step equals the uncompiled one
print(f"explain: {graphs} graphs, {breaks} graph breaks")
print("the first graph:\n  " + "\n  ".join(graph))
print(f"messages and collectives of the compiled step (between graphs): {kinds}")

# %% [markdown]
# The first graph holds the plain-tensor code (`sigmoid`, `mean`, `* 2`). dynamo stops at
# the convolution on the ShardTensor (its halos are messages), which runs eagerly. The next
# graph holds `relu` and `* scale` on each rank's block. It stops at the exact global `mean`,
# whose all-reduce runs eagerly too. For a whole model the compiled step equals the eager
# one: `python benchmarks/bench_compile.py` measures both on the zoo's ResNet and Llama. On
# 2 ranks the Llama step costs about 0.85x the eager one; ResNet's, with one op or two
# between its messages, about 1x.
#
# In a model, a break inside a module's `forward` also breaks every frame above it (the
# layer, the model). torch's `torch._dynamo.config.nested_graph_breaks = True` makes dynamo
# resume in the frame that broke: the zoo's Llama on 2 ranks then compiles to 5 graphs with
# 3 breaks (its two rings and cross-entropy) instead of 9 graphs with 13 breaks, and its
# step costs about 0.75x the eager one. Set it in a scope, as
# `with torch._dynamo.config.patch(nested_graph_breaks=True):`.
#
# **Messages inside the graph.** Compiled inside `shardlab.messages_in_graphs()` (opt-in),
# the halos and the all-reduce are ops of the compiled graph instead of breaks: every rank
# posts them in one order (a token chains them), and the same step is one graph. The
# messages are the same; the Python around them is gone. The zoo's Llama then costs about
# 0.36x its eager step on 2 ranks and ResNet about 0.9x (`bench_compile.py
# --messages-in-graphs`). Why it is not the default: the compile guide.

# %%
(graphs_in, breaks_in), _, kinds_in, same_in = ranks.run(compile_a_step, True)[0]
assert same_in and kinds_in == kinds  # equal to eager; the same kinds of messages
print(f"inside messages_in_graphs(): {graphs_in} graph(s), {breaks_in} graph breaks")

# %% [markdown]
# On a mesh of **one** rank nothing is sent, and the whole step is traced: the ShardTensor
# carries its layout into the graph (dynamo guards on it), the patched `F` entry points hand
# dynamo torch's own function, and a model's forward and backward compile to one graph with
# no break (the zoo's Llama 0.37x and ResNet 0.55x the eager step with inductor, on this
# machine's CPU). Where several ranks break, the design and its limits: the compile guide
# (`docs/guides/compile.md`).

# %%
ranks.close()
