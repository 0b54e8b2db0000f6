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
# # 10 · A real decoder with its sequence sharded (context parallel)
#
# Tutorial 07 ran ring attention on bare tensors. Here the same ring runs inside a
# language model nobody here wrote: a Hugging Face `transformers` Llama (RoPE,
# grouped-query attention, RMSNorm), small and with random weights, **unchanged**.
# Only its inputs change: `input_ids`, the padding mask and the labels are cut
# along the sequence by `shardlab.lm.shard_batch`.

# %%
import matplotlib.pyplot as plt
import torch
import transformers

import shardlab
from shardlab import viz
from shardlab.trace import Trace

WORLD = 4  # try 2 or 3 (the 2-D mesh at the end needs 4)
ranks = shardlab.Ranks(WORLD)
S = 11  # tokens per sequence, cut unevenly over the ranks


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


def batch():
    """Two sequences; the first is left-padded (its first 3 tokens are padding)."""
    ids = torch.randint(0, 64, (2, S), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    labels = ids.masked_fill(mask == 0, -100)  # no loss on padding
    return ids, mask, labels


# %% [markdown]
# ## One training step, sharded, against one device
#
# `shard_batch` gives each rank its tokens. By default it hands the model exactly what
# one device would get, cut along the sequence, and the model makes its positions and
# masks itself: right for any model (BERT, OPT, ...), but a padding mask then becomes a
# whole `S × S` mask on every rank. A Llama is a *causal* decoder whose positions are
# `0..S-1`, so `causal=True` does better: each rank gets its tokens' **global**
# positions (RoPE reads them) and only its rows of the causal + padding mask,
# `(B, 1, S_local, S)`. The model call is the one you would write on one device.


# %%
def step(sizes):
    from shardlab.lm import shard_batch

    mesh = shardlab.this_rank().mesh
    model = tiny_llama()
    ids, mask, labels = batch()
    ref = model(input_ids=ids, attention_mask=mask, labels=labels)
    ref.loss.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    with shardlab.patched(), shardlab.trace() as t:
        sharded = shard_batch(mesh, ids, mask, labels, sizes=sizes, causal=True)
        out = model(**sharded)  # unchanged transformers code
        out.loss.backward()
    same = torch.allclose(out.logits.full_tensor(), ref.logits) and all(
        torch.allclose(p.grad, want[n], rtol=1e-5, atol=1e-7) for n, p in model.named_parameters()
    )
    return (
        same,
        float(out.loss.detach().full_tensor()),
        sharded["attention_mask"].to_local().shape,
        t.events,
    )


SIZES = [S // WORLD + (1 if r < S % WORLD else 0) for r in range(WORLD)]
results = ranks.run(step, SIZES)
assert all(same for same, *_ in results)
print(
    "tokens per rank:",
    SIZES,
    "| loss",
    results[0][1],
    "| mask rows on rank 0:",
    tuple(results[0][2]),
)

# %% [markdown]
# ## The ring, on the real model
#
# Every message of that step: in each attention layer the K and V blocks go round
# the ring (forward), and again in backward with the dK/dV accumulators coming home.

# %%
trace = Trace([e for *_, events in results for e in events])
ring = Trace([e for e in trace.events if "sdpa" in e.label])
print(ring.counts(rank=0))
assert ring.counts(rank=0)["recv"] >= WORLD - 1  # every other rank's K and V
fig, ax = plt.subplots(figsize=(12, 3.6))
_ = viz.plot_collectives(ring, ax=ax)

# %% [markdown]
# ## The label shift crosses the shards
#
# A causal LM predicts token `t + 1` at position `t`: the model shifts the labels by
# one (`labels[..., 1:]`). With the sequence cut, the last position of each rank needs
# the **first label of its right neighbour**: one number per boundary, moved point to
# point (the `redistribute` messages above that are not the ring).


# %%
def draw_shift(sizes):
    fig, ax = plt.subplots(figsize=(9, 1.8))
    colors = plt.get_cmap("tab10").colors
    start = 0
    for r, n in enumerate(sizes):
        for i in range(start, start + n):
            ax.add_patch(plt.Rectangle((i, 0), 0.9, 0.9, color=colors[r], alpha=0.5))
            ax.text(i + 0.45, 0.35, str(i), ha="center", fontsize=9)
        if r < len(sizes) - 1:  # the neighbour's first label comes back one step
            ax.annotate(
                "",
                xy=(start + n - 0.55, 1.0),
                xytext=(start + n + 0.45, 1.0),
                arrowprops=dict(arrowstyle="->", color="k"),
            )
        ax.text(start + n / 2, -0.45, f"rank {r}", ha="center", fontsize=9)
        start += n
    ax.set_xlim(-0.2, start + 0.2)
    ax.set_ylim(-0.7, 1.4)
    ax.axis("off")
    ax.set_title("positions and their owners; arrows: the label each rank gets from its right")
    return fig


_ = draw_shift(SIZES)
shift = [e for e in trace.events if e.kind == "recv" and "sdpa" not in e.label]
print("non-ring messages received (rank, bytes):", [(e.rank, e.bytes) for e in shift])

# %% [markdown]
# ## Causal load balance: head-tail
#
# With a causal mask, the rank holding the first tokens has almost nothing to do and
# the last rank the most. Cut the sequence in `2N` chunks and give rank `r` chunks
# `r` and `2N-1-r`: every rank gets the same work. `shard_batch(head_tail=True)`
# permutes tokens, positions, labels and mask alike; the result is the same.

# %%
from shardlab.ops.attention import head_tail_order, head_tail_sizes  # noqa: E402

L = 64
contig = torch.arange(L)
bal = head_tail_order(L, WORLD)
parts = (
    lambda order, sizes: [  # noqa: E731  (query, key) pairs each rank computes
        int((order[None, :] <= order[s : s + n, None]).sum())
        for s, n in zip(torch.tensor([0, *sizes]).cumsum(0).tolist(), sizes)
    ]
)
even = [L // WORLD] * WORLD
fig, ax = plt.subplots(figsize=(6, 2.6))
x = torch.arange(WORLD)
ax.bar(x - 0.2, parts(contig, even), 0.4, label="contiguous")
ax.bar(x + 0.2, parts(bal, head_tail_sizes(L, WORLD)), 0.4, label="head-tail")
ax.set_xticks(x.tolist(), [f"rank {r}" for r in range(WORLD)])
ax.set_ylabel("attention pairs")
ax.legend()


def balanced():
    from shardlab.lm import shard_batch
    from shardlab.ops.attention import unbalance

    mesh = shardlab.this_rank().mesh
    model = tiny_llama()
    ids, mask, labels = batch()
    ref = model(input_ids=ids, attention_mask=mask, labels=labels)
    with shardlab.patched():
        out = model(**shard_batch(mesh, ids, mask, labels, head_tail=True))
    logits = unbalance(out.logits.full_tensor(), mesh.size(), dims=(1,))  # back to order
    return torch.allclose(logits, ref.logits) and torch.allclose(
        out.loss.full_tensor(), ref.loss, rtol=1e-6
    )


assert all(ranks.run(balanced))
print("head-tail: logits and loss equal one device")

# %% [markdown]
# ## Two axes: sequence × tensor
#
# On a 2-D mesh `("seq", "tp")`, torch's own tensor parallelism shards the weights over
# `mesh["tp"]` (`parallelize_module`, unchanged) and shardlab shards the sequence over
# `mesh["seq"]`; the head's logits stay class-sharded and the loss is vocab-parallel.
# Every message names its mesh axis: the ring runs along `seq`, the row-wise layers'
# all-reduces and the loss's two small all-reduces along `tp`. (Needs 4 ranks.)


# %%
def two_d():
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from shardlab.lm import shard_batch

    mesh = init_device_mesh("cpu", (WORLD // 2, 2), mesh_dim_names=("seq", "tp"))
    model = tiny_llama()
    ref = copy.deepcopy(model)
    ids, _, labels = batch()
    ref_loss = ref(input_ids=ids, labels=labels).loss
    p = "model.layers.0."
    plan = {p + f"self_attn.{n}_proj": ColwiseParallel() for n in "qkv"}
    plan |= {
        p + "self_attn.o_proj": RowwiseParallel(),
        p + "mlp.down_proj": RowwiseParallel(),
        p + "mlp.gate_proj": ColwiseParallel(),
        p + "mlp.up_proj": ColwiseParallel(),
        "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    }
    parallelize_module(model, mesh["tp"], plan)
    with shardlab.patched(), shardlab.trace(mesh) as t:
        loss = model(**shard_batch(mesh, ids, labels=labels, mesh_dim=0)).loss
        loss.backward()
    axes = {}
    for e in t.events:
        name = mesh.mesh_dim_names[e.mesh_dim]
        axes.setdefault(name, set()).add(e.label)
    return torch.allclose(loss.full_tensor(), ref_loss, rtol=1e-6), axes


if WORLD >= 4 and WORLD % 2 == 0:
    res = ranks.run(two_d)
    assert all(ok for ok, _ in res)
    for axis, labels_ in sorted(res[0][1].items()):
        print(f"{axis}: {sorted(labels_)}")
else:
    print(f"the 2-D mesh needs 4 ranks (an even number >= 4); this run has {WORLD}")

# %%
ranks.close()
