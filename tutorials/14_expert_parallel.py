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
# # 14 · Expert parallelism: a mixture of experts spread over the ranks
#
# A mixture-of-experts (MoE) layer holds E expert MLPs and a **router** that sends each
# token to k of them. Expert parallelism puts E/p experts on each of p ranks and moves
# the *tokens* to their experts and the results back, with two all-to-alls. How many
# tokens go where is decided token by token: the splits are uneven by nature.
#
# Here an **unchanged** `transformers` Mixtral (small, random weights, nothing
# downloaded) runs with `shardlab.ExpertParallel` applied by torch's own
# `parallelize_module`: the router's choices, the token flow between ranks and the load
# per expert as pictures, what an unbalanced router costs (measured), and experts
# combined with sequence parallelism on a 2-D mesh. Every result is checked against one
# device.

# %%
import statistics

import matplotlib.pyplot as plt
import torch
import transformers
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import parallelize_module

import shardlab
from shardlab import viz
from shardlab.trace import Trace

WORLD = 4  # try 2 or 3 (the 2-D mesh at the end needs 4)
ranks = shardlab.Ranks(WORLD)
E, K = 2 * WORLD, 2  # two experts per rank, each token picks its top 2
PLAN = {"model.layers.*.mlp": shardlab.ExpertParallel()}  # every layer's MoE block


def mixtral(hidden=16, inter=32, dtype=torch.float64):
    """A 2-layer Mixtral, both layers MoE; its experts in transformers' eager loop."""
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(
        vocab_size=64,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        num_local_experts=E,
        num_experts_per_tok=K,
    )
    cfg._attn_implementation = "sdpa"
    model = transformers.MixtralForCausalLM(cfg)
    model.set_experts_implementation("eager")  # (its grouped_mm takes no float64 on CPU)
    return model.to(dtype)


def next_token_loss(logits, ids):  # in the logits' dtype (transformers' own upcasts)
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


SEQS = [2] + [1] * (WORLD - 1)  # sequences per rank: uneven
IDS = torch.randint(0, 64, (sum(SEQS), 8), generator=torch.Generator().manual_seed(3))
print("sequences per rank:", SEQS, "| input_ids", tuple(IDS.shape))

# %% [markdown]
# ## One training step, expert-parallel, against one device
#
# `parallelize_module(model, mesh, PLAN)` keeps on rank r the experts
# `2r, 2r + 1` (their stacked weights become `Shard(0)` ShardTensors); the router,
# attention and norms stay whole on every rank. Each rank feeds its own sequences
# (`shardlab.distribute(..., [Shard(0)], sizes)`): the model call is the one-device
# call. Logits, loss and **every gradient** are compared with one device, in float64.


# %%
def step():
    mesh = shardlab.this_rank().mesh
    one = mixtral()
    ref_logits = one(input_ids=IDS).logits
    next_token_loss(ref_logits, IDS).backward()

    model = mixtral()
    parallelize_module(model, mesh, PLAN)
    chosen = []  # the router's top-k experts of this rank's tokens, per layer
    for layer in model.model.layers:
        layer.mlp.gate.register_forward_hook(lambda m, i, out: chosen.append(out[2]))
    with shardlab.patched(), shardlab.trace() as t:
        mine = shardlab.distribute(IDS, mesh, [Shard(0)], sizes=[SEQS])  # my sequences
        logits = model(input_ids=mine).logits  # unchanged transformers code
        loss = next_token_loss(logits, mine)
        loss.backward()

    rank, local = mesh.get_rank(), E // mesh.size()
    want = dict(one.named_parameters())
    worst = 0.0  # the largest gradient difference, every parameter
    for name, p in model.named_parameters():
        if ".experts." in name:  # my experts' gradients: my slice of one device's
            got, ref = p.grad.to_local(), want[name].grad[rank * local : (rank + 1) * local]
        else:
            got, ref = p.grad, want[name].grad
        worst = max(worst, (got - ref).abs().max().item())
    return {
        "logits": (logits.full_tensor() - ref_logits).abs().max().item(),
        "loss": (loss.full_tensor() - next_token_loss(ref_logits, IDS)).abs().item(),
        "grads": worst,
        "chosen": chosen[0],  # layer 0: (my tokens, k)
        "events": t.events,
    }


results = ranks.run(step)
for r, res in enumerate(results):
    print(f"rank {r}: |logits|, |loss|, |grads| vs one device:",
          f"{res['logits']:.1e} {res['loss']:.1e} {res['grads']:.1e}")  # fmt: skip
assert all(max(res["logits"], res["loss"], res["grads"]) < 1e-12 for res in results)

# %% [markdown]
# ## The router's choices and the load per expert
#
# Each token (across, coloured by the rank that holds it) picks its top 2 experts (down,
# grouped by the rank that holds them). The load per expert counts the (token, expert)
# pairs, by the rank they come from: the dashed line is the even share. A random
# router is not even: some experts, and so some ranks, get more.

# %%
TOKENS = [n * IDS.shape[1] for n in SEQS]  # tokens per rank
chosen = torch.cat([res["chosen"] for res in results])  # (all tokens, k), rank order
viz.plot_routing(chosen, E, sizes=TOKENS)

# %%
load = viz.expert_load(chosen, E, TOKENS)  # load[r][e]: rank r's pairs for expert e
per = E // WORLD  # experts per rank
received = [sum(sum(row[s * per : (s + 1) * per]) for row in load) for s in range(WORLD)]
print("pairs each rank's experts compute:", received, "| even share:", sum(TOKENS) * K // WORLD)
viz.plot_expert_load(load)

# %% [markdown]
# ## The token flow between ranks, from the tracer
#
# The dispatch all-to-all hands each token row to the rank of its expert. The tracer
# records, for each `all_to_all`, the bytes a rank hands each rank (`Event.splits`):
# the rank × rank matrix below is the first MoE layer's dispatch, read from the trace,
# in tokens (one row: 16 float64 = 128 bytes). The diagonal stays on its rank; row sums
# are what each rank sends (its tokens × k), column sums what each rank's experts get.
# It must be the load above, summed over each rank's experts.

# %%
trace = Trace([e for res in results for e in res["events"]])
ROW = 16 * 8  # bytes of one token row (hidden 16, float64)
flow = viz.token_flow(trace, "experts.dispatch forward", layer=0)
assert flow == [[sum(load[r][s * per : (s + 1) * per]) * ROW for s in range(WORLD)]
                for r in range(WORLD)]  # fmt: skip
viz.plot_token_flow(flow, row_bytes=ROW)

# %% [markdown]
# ## What the step sends, and nothing else
#
# Per MoE layer: forward, one small all-to-all of the E counts (`experts.counts`: the
# receivers size their buffers before the rows come), the **dispatch** and the
# **combine** all-to-alls; backward, their two transposes. Besides them the step sends
# the loss's one all-reduce (its mean over the cut batch) and the one all-reduce of
# every replicated gradient (attention, norms, embeddings, routers) at the end of the
# backward. Nothing gathers a whole tensor.

# %%
inventory = trace.counts(by="label", rank=0)
print(inventory)
layers = 2
assert trace.counts(rank=0) == {"all_to_all": 5 * layers, "all_reduce": 2}
assert inventory == {
    "experts.counts forward": layers,
    "experts.dispatch forward": layers,
    "experts.combine forward": layers,
    "experts.combine backward": layers,
    "experts.dispatch backward": layers,
    "cross_entropy forward": 1,
    "params backward": 1,
}
for r in range(WORLD):  # dispatch: this rank's tokens x k rows, in each MoE layer
    sent = [e.bytes for e in trace.filter(rank=r, label="experts.dispatch forward")]
    assert sent == [TOKENS[r] * K * ROW] * layers
print("bytes rank 0 hands to all-to-alls per step:", trace.bytes(0, kind="all_to_all"))

# %% [markdown]
# ## `shardlab.explain`: the messages, module by module
#
# `shardlab.explain` runs one step and attributes every message to the module whose
# forward (or backward) caused it: the all-to-alls belong to each layer's `experts`
# module, three forward and two backward; the gradients' all-reduce has a row of its own.


# %%
def explained():
    mesh = shardlab.this_rank().mesh
    model = mixtral()
    parallelize_module(model, mesh, PLAN)
    with shardlab.patched():
        mine = shardlab.distribute(IDS, mesh, [Shard(0)], sizes=[SEQS])
        return shardlab.explain(model, input_ids=mine, labels=mine)


ex = ranks.run(explained)[0]
for row in ex.rows(0):
    if row.events:
        print(f"{row.name:28} {row.phase:8}", ", ".join(e[4] for e in row.events))
moe = [r for r in ex.rows(0) if r.kind == "MixtralExperts"]
assert [sum(e[0] == "all_to_all" for e in r.events) for r in moe] == [3, 3, 2, 2]

# %% [markdown]
# ## What an unbalanced router costs
#
# A router that sends most tokens to one expert overloads the rank that holds it: that
# rank computes far more rows, every other rank waits for it at the combine all-to-all,
# and the bytes it receives grow. To see it, bias the routers' weights: raise expert 0's
# logit by about 2 along the direction the tokens have in common (their mean), in both
# layers. Then measure, on a larger model (hidden 128, 128 tokens per rank, float32), the
# rows each rank's experts compute, the bytes each rank receives from others, and the
# step time (forward and backward, median of 3, slowest rank).
#
# **Timings on this machine**: WORLD ranks share 2 CPU cores, so a step's time is
# mostly the ranks taking turns; an idle rank waiting in gloo frees its core for the
# busy one. The rows are exact; the times only show the direction and rough size.


# %%
def biased(model, ids, strength):
    """Raise expert 0's router logit by about ``strength`` for the tokens' mean direction."""
    for layer in model.model.layers:
        seen = []
        hook = layer.mlp.gate.register_forward_hook(lambda m, i, out, seen=seen: seen.append(i[0]))
        with torch.no_grad():
            model(input_ids=ids)
        hook.remove()
        u = seen[0].mean(0)  # (hidden,): what the tokens share
        with torch.no_grad():
            layer.mlp.gate.weight[0] += strength * u / u.norm() ** 2
    return model


def cost(strength, steps=3):
    import time

    mesh = shardlab.this_rank().mesh
    ids = torch.randint(0, 64, (2 * WORLD, 64), generator=torch.Generator().manual_seed(2))
    model = biased(mixtral(128, 512, torch.float32), ids, strength)
    parallelize_module(model, mesh, PLAN)
    mine = shardlab.distribute(ids, mesh, [Shard(0)])
    times = []
    for _ in range(steps + 1):  # the first: warm-up, traced
        torch.distributed.barrier()
        start = time.perf_counter()
        with shardlab.patched(), shardlab.trace() as t:
            next_token_loss(model(input_ids=mine).logits, mine).backward()
        times.append(time.perf_counter() - start)
        model.zero_grad()
        if len(times) == 1:
            events = t.events
    return statistics.median(times[1:]), events


ROW32 = 128 * 4  # one token row, hidden 128 in float32
measured = {}
for strength in (0.0, 2.0):
    res = ranks.run(cost, strength)
    t = Trace([e for _, events in res for e in events])
    flow = viz.token_flow(t, "experts.dispatch forward")  # both layers
    computed = [sum(row[s] for row in flow) // ROW32 for s in range(WORLD)]  # rows in
    from_others = [sum(row[s] for r, row in enumerate(flow) if r != s) for s in range(WORLD)]
    measured[strength] = dict(rows=computed, received=from_others,
                              ms=max(ms for ms, _ in res) * 1e3, flow=flow)  # fmt: skip
    print(f"bias {strength}: rows each rank's experts compute {computed}",
          f"(busiest / mean {max(computed) / statistics.mean(computed):.2f});",
          f"bytes received from others {[viz.human_bytes(b) for b in from_others]};",
          f"step {measured[strength]['ms']:.0f} ms")  # fmt: skip

# %% [markdown]
# The two layers' dispatch, in tokens: rank 0 holds expert 0 and gets most of every
# rank's rows. Left: the balanced router; right: the biased one.

# %%
fig, axes = plt.subplots(1, 2, figsize=(9.5, 1.6 + 0.8 * WORLD), layout="constrained")
for ax, strength in zip(axes, measured):
    viz.plot_token_flow(measured[strength]["flow"], ax=ax, row_bytes=ROW32,
                        title=f"tokens each rank hands each, bias {strength:g}")  # fmt: skip
busy = {s: max(m["rows"]) / statistics.mean(m["rows"]) for s, m in measured.items()}
rows = measured[2.0]["rows"]
assert rows[0] == max(rows) and busy[2.0] > busy[0.0]  # rank 0, with expert 0, is overloaded

# %% [markdown]
# Measured here (4 ranks on 2 cores): with the bias, rank 0 computed 2.3 times the mean
# number of rows (1.6 without: a random router is not even either) and received 450 KiB
# from the others instead of 160 KiB. Those are exact. The step times are not: two runs
# gave 220 → 540 ms and 280 → 180 ms (balanced → biased), because four ranks on two shared
# cores take turns, and the machine had other work. On real accelerators, one per rank, the
# whole step waits for the busiest rank: the cost tracks its rows. That is what the
# auxiliary load-balancing loss and a capacity factor are for
# (`ExpertParallel(capacity_factor=1.25)`: each rank sends an expert at most 1.25 times
# its even share of rows; the rest are dropped).
#
# ## Your turn: the expert explorer
#
# A simulated router over as many experts, ranks and tokens as you like: raise the bias
# towards expert 0 and watch the load pile up on rank 0 and the flow matrix turn into
# one column. The table gives each rank's rows against the mean and the bytes it sends
# to others (`row bytes`: one token's hidden state, e.g. 4096 × 2 bytes in bf16).

# %%
viz.expert_explorer(experts=8, top_k=2, ranks=4, tokens=64, bias=0.0)

# %% [markdown]
# ## Two axes: experts × sequence
#
# On a 2-D mesh `("ep", "sp")` the experts are spread over `ep` (the style takes
# `mesh["ep"]`), and the tokens are cut over both: each rank its own sequences along
# `ep` and its own positions along `sp` (sequence parallelism: `Shard(1)` of
# `input_ids`, the attention's ring runs over `sp`). The all-to-alls stay within `ep`;
# each expert's gradient is also summed over `sp` (`experts.weights backward`), every
# other gradient over both dims. Exact against one device, in float64. (Needs 4 ranks.)


# %%
def two_d():
    mesh = shardlab.this_rank().mesh_for((2, 2), names=("ep", "sp"))
    ids = torch.randint(0, 64, (3, 9), generator=torch.Generator().manual_seed(4))
    one = mixtral()
    ref_logits = one(input_ids=ids).logits
    next_token_loss(ref_logits, ids).backward()
    model = mixtral()
    parallelize_module(model, mesh["ep"], PLAN)
    with shardlab.patched(), shardlab.trace(mesh) as t:
        mine = shardlab.distribute(ids, mesh, [Shard(0), Shard(1)], sizes=[[2, 1], [5, 4]])
        logits = model(input_ids=mine).logits
        next_token_loss(logits, mine).backward()
    logits = logits.full_tensor()
    ep, local = mesh.get_coordinate()[0], E // 2
    want = dict(one.named_parameters())
    worst = max(
        (p.grad.to_local() - want[n].grad[ep * local : (ep + 1) * local]).abs().max().item()
        if ".experts." in n
        else (p.grad - want[n].grad).abs().max().item()
        for n, p in model.named_parameters()
    )
    axes = {}
    for e in t.events:
        axis = "both" if e.mesh_dim is None else mesh.mesh_dim_names[e.mesh_dim]
        axes.setdefault(axis, set()).add(e.label)
    return (logits - ref_logits).abs().max().item(), worst, axes


if WORLD == 4:
    res = ranks.run(two_d)
    assert all(max(d, g) < 1e-12 for d, g, _ in res)
    print(f"logits {res[0][0]:.1e}, gradients {res[0][1]:.1e} from one device")
    for axis, labels in sorted(res[0][2].items()):
        print(f"{axis}: {sorted(labels)}")
    assert {lab for lab in res[0][2]["ep"] if lab.startswith("experts.")} == {
        "experts.counts forward", "experts.dispatch forward", "experts.combine forward",
        "experts.combine backward", "experts.dispatch backward",
    }  # fmt: skip
else:
    print(f"the (2, 2) mesh needs 4 ranks; this run has {WORLD}")

# %% [markdown]
# Close the ranks.

# %%
ranks.close()
