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
# # 13 · Pipeline parallelism, as it ran
#
# Pipeline parallelism cuts a model **by layers**: rank 0 holds the first layers, rank 1
# the next ones, and so on. A batch is cut into `m` *micro-batches*; a rank computes a
# micro-batch's forward through its layers, sends the hidden states to the next rank, and
# later gets back their gradient. While rank 0 starts micro-batch 1, rank 1 works on
# micro-batch 0: the ranks overlap, except at the start and the end of a step, the
# *bubble*.
#
# Everything here is torch's own `torch.distributed.pipelining` (`PipelineStage`, and the
# schedules `ScheduleGPipe`, `Schedule1F1B`, `ScheduleInterleaved1F1B`,
# `ScheduleInterleavedZeroBubble`) on an **unchanged** `transformers` Llama, small and
# with random weights. shardlab only records what each rank ran and draws it.

# %%
import matplotlib.pyplot as plt
import torch
import transformers

import shardlab
from shardlab import pipeline
from shardlab.trace import Trace

WORLD = 4  # try 3 (the 2-D mesh at the end needs 4)
ranks = shardlab.Ranks(WORLD)
LAYERS, S, M = 8, 32, 8  # decoder layers, tokens per sequence, micro-batches


def tiny_llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    cfg._attn_implementation = "sdpa"
    return transformers.LlamaForCausalLM(cfg).double()


def batch(m):
    """2 sequences per micro-batch: ids (2m, S); the labels are the ids (the loss shifts)."""
    return torch.randint(0, 64, (2 * m, S), generator=torch.Generator().manual_seed(1))


# %% [markdown]
# ## Stages, by module
#
# `pipeline.DecoderStage` holds a slice of the model's own modules (not copies) and runs
# them as the model's `forward` does: embedding on the first stage, then its decoder
# layers with the causal mask and rotary embeddings made the model's way, the final norm
# and the head on the last. With one stage per rank (GPipe, 1F1B):
#
# ```
# rank 0: embed_tokens, layers 0-1        -> hidden (2, S, 64) ->
# rank 1: layers 2-3                      -> hidden            ->
# rank 2: layers 4-5                      -> hidden            ->
# rank 3: layers 6-7, norm, lm_head       -> logits (2, S, 64), loss
# ```
#
# Interleaved schedules give each rank **two** stages, `r` and `r + p`: 8 stages of one
# layer, rank 0 holding layers 0 and 4.

# %%
for name in ("1F1B", "Interleaved1F1B"):
    per_rank = pipeline.SCHEDULES[name][1]
    cuts = pipeline.layer_ranges(LAYERS, WORLD * per_rank)
    owns = {
        r: [list(cuts[s]) for s in pipeline.stage_indices(r, WORLD, per_rank)]
        for r in range(WORLD)
    }
    print(f"{name:16s} layers per rank: {owns}")

# %% [markdown]
# ## One step of each schedule, against one device
#
# `pipeline.step` builds this rank's `PipelineStage`s, the schedule (its `loss_fn` the
# LM loss, in float64) and calls `schedule.step(ids, target=labels)`: the first stage
# gets the batch, the last the labels, the others what their neighbours send. It records
# each stage call (`pipeline.record`) and traces the messages. The gradients land in the
# model's own parameters: each rank has those of its stages, and together they must be
# one device's, every one of them. Each schedule runs twice: the first step pays for the
# shape exchange and first calls; the second is measured.


# %%
def body(schedule, m):
    model = tiny_llama()
    ids = batch(m)
    ref = tiny_llama()  # one device: the whole batch at once
    want = pipeline.lm_loss(ref(input_ids=ids).logits, ids)
    want.backward()
    grads = dict(ref.named_parameters())
    for _ in range(2):  # warm-up, then the step we keep
        model.zero_grad(set_to_none=True)
        out = pipeline.step(model, ids, ids, schedule=schedule, microbatches=m)
    err = {
        n: float((p.grad - grads[n].grad).abs().max())
        for n, p in model.named_parameters()
        if p.grad is not None
    }
    loss_err = None if out.loss is None else abs(out.loss - want.item())
    return out, err, loss_err


def measure(schedule, m=M):
    """Run on the ranks; assert one device's loss and gradients; (actions, events)."""
    res = ranks.run(body, schedule, m)
    owned = [set(err) for _, err, _ in res]
    assert sum(map(len, owned)) == len(set().union(*owned)) == len(list(tiny_llama().parameters()))
    assert max(max(err.values()) for _, err, _ in res) < 1e-12  # float64
    assert all(le is None or le < 1e-12 for *_, le in res)
    return [a for out, *_ in res for a in out.actions], [e for out, *_ in res for e in out.events]


SCHEDULES = ["GPipe", "1F1B", "Interleaved1F1B", "ZeroBubble"]
runs = {name: measure(name) for name in SCHEDULES}
print("loss and every gradient equal one device (float64, to 1e-12) for", SCHEDULES)

# %% [markdown]
# ## GPipe, as it ran
#
# Two clocks. Each rank records every stage call's wall-clock interval and the CPU time
# of its thread. On this machine (a few cores for 4 ranks) the wall clock says mostly
# *who got a core*: ranks computing at once slow each other down, so the raw timeline
# below is stretched and its "bubble" is large.
#
# The timeline we measure the bubble on is **the schedule replayed with one core per
# rank**: each action lasts its measured CPU time, each rank keeps the order it really
# ran, and each action that waited for a message (a traced `recv` that completed before
# it started) starts no earlier than the matching `send` was posted on the other rank
# (`pipeline.replay`). Messages cost nothing there: on one node they are cheap next to a
# layer, but on a real cluster they are not.

# %%
actions, events = runs["GPipe"]
ideal = pipeline.replay(actions, events)
fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(12, 5))
_ = pipeline.plot(ideal, ax=ax1, title="GPipe, replayed with one core per rank")
_ = pipeline.plot(actions, ax=ax2, title="GPipe, wall clock on this machine")
counts = Trace(events).counts(rank=1)
print("rank 1 messages:", counts)  # hidden states in, gradients out, both ways per micro-batch
assert counts["send"] >= 2 * M and counts["recv"] >= 2 * M

# %% [markdown]
# GPipe runs all forwards, then all backwards: rank `p-1` starts after `p-1` forwards and
# rank 0 waits `p-1` backwards at the end. With every action alike the idle share is
# `(p-1)/(m+p-1)` (27 % for `p = 4`, `m = 8`). Our stages are not alike: the first also
# embeds the tokens, the last also runs the head and the loss, and on a shared machine each
# rank runs at its own speed; with actions of a few milliseconds that shows (a stage 20 %
# slower than the others adds 6 points). The slowest stage sets the pace: each flow (the forwards
# down, the backwards up) takes one micro-batch's time through every stage plus `m - 1`
# times its slowest stage's (`pipeline.formula(p, m, times)`, with each stage's measured
# forward and backward). 1F1B has about the same bubble but alternates one
# forward and one backward once the pipe is full, so a rank keeps at most `p` micro-batches'
# activations instead of `m`. The interleaved schedules run `v = 2` smaller stages per
# rank: the ramp is `v` times shorter, the bubble about `(p-1)/(v m + p - 1)`, for twice
# the messages. Zero bubble splits each backward into **I** (the gradient of the input,
# which the previous stage waits for) and **W** (the weights' gradient, which nobody
# waits for) and fills the gaps with W.

# %%
def stage_times(acts):
    """Each rank's mean CPU seconds per forward and per backward: [(f, b), ...]."""
    per = {(a.rank, a.kind): [] for a in acts}
    for a in acts:
        per[a.rank, a.kind].append(a.cpu)
    mean = lambda r, k: sum(per[r, k]) / len(per[r, k])  # noqa: E731
    return [(mean(r, "F"), mean(r, "B")) for r in range(WORLD)]


p = WORLD
rows = []
for name in SCHEDULES:
    acts, evs = runs[name]
    measured = pipeline.bubble(pipeline.replay(acts, evs))
    rows.append((name, measured, pipeline.bubble(acts), len(Trace(evs).filter(kind="send"))))
    print(f"{name:16s} replayed {measured:5.1%}  wall {rows[-1][2]:5.1%}  sends {rows[-1][3]}")
textbook = pipeline.formula(p, M)
print(f"(p-1)/(m+p-1) = {textbook:.1%} for p = {p}, m = {M}, every stage alike")
for name, measured, *_ in rows[:2]:  # GPipe and 1F1B: the formula with their stages' times
    times = stage_times(runs[name][0])
    slowest = pipeline.formula(p, M, times)
    print(f"{name:16s} stages' times (ms, F/B):", [f"{f * 1e3:.1f}/{b * 1e3:.1f}" for f, b in times])
    print(f"{name:16s} formula with them: {slowest:5.1%}")
    assert measured > textbook - 0.03, (name, measured, textbook)  # never below: a bound
    assert abs(measured - slowest) < 0.07, (name, measured, slowest)

# %% [markdown]
# ## All four, side by side
#
# Hatched boxes are a rank's second stage. Zero bubble's backward is two colours: I
# (orange) as soon as the gradient comes, W (purple) where the rank would otherwise wait.

# %%
fig, axes = plt.subplots(len(SCHEDULES), 1, figsize=(12, 2.3 * len(SCHEDULES)))
for ax, name in zip(axes, SCHEDULES):
    _ = pipeline.plot(pipeline.replay(*runs[name]), ax=ax, title=name)
zb = runs["ZeroBubble"][0]
kinds = {k: sum(a.kind == k for a in zb) for k in "FBIW"}
print("zero bubble actions:", kinds)
assert kinds["B"] == 0 and kinds["I"] == kinds["W"] == kinds["F"] == 2 * WORLD * M
for name in SCHEDULES:  # every (rank, stage, micro-batch, kind) exactly once
    keys = [(a.rank, a.stage, a.microbatch, a.kind) for a in runs[name][0]]
    assert len(keys) == len(set(keys))

# %% [markdown]
# ## Explore
#
# Pick a schedule and the number of micro-batches: each choice runs once on the ranks
# (about a second) and is drawn replayed, with its bubble. More micro-batches shrink the
# bubble, at the price of smaller matrix products per call.

# %%
explorer = pipeline.explorer(measure, schedule="1F1B", microbatches=M, stages=WORLD)
explorer

# %% [markdown]
# ## Two axes: pipeline × tensor
#
# On a 2-D mesh `("pp", "tp")`, torch's tensor parallelism shards every layer's
# projections over `mesh["tp"]` (`parallelize_module`, unchanged), and the pipeline runs
# over `mesh["pp"]`: 2 stages of 4 layers, each stage on 2 ranks. The hidden states
# between stages are plain tensors (the row-wise layers' outputs are replicated over
# `tp`), so the schedule needs nothing special. Every message names its axis: the
# stages' sends and receives along `pp`, the row-wise layers' all-reduces along `tp`.
# (Needs 4 ranks.)


# %%
def two_d():
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    model = tiny_llama()
    ref = copy.deepcopy(model)
    ids = batch(4)
    want = pipeline.lm_loss(ref(input_ids=ids).logits, ids)
    want.backward()
    plan = {}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        plan |= {p + f"self_attn.{n}_proj": ColwiseParallel() for n in "qkv"}
        plan |= {p + f"mlp.{n}_proj": ColwiseParallel() for n in ("gate", "up")}
        plan |= {p + "self_attn.o_proj": RowwiseParallel(), p + "mlp.down_proj": RowwiseParallel()}
    parallelize_module(model, mesh["tp"], plan)
    out = pipeline.step(
        model, ids, ids, schedule="1F1B", microbatches=4, group=mesh["pp"].get_group(),
        trace_mesh=mesh,
    )  # fmt: skip
    refs = dict(ref.named_parameters())
    err = max(
        float((getattr(p.grad, "full_tensor", lambda: p.grad)() - refs[n].grad).abs().max())
        for n, p in model.named_parameters()
        if p.grad is not None
    )
    axes = {(mesh.mesh_dim_names[e.mesh_dim], e.kind) for e in out.events}
    return out.loss, want.item(), err, sorted(axes)


if WORLD == 4:
    res = ranks.run(two_d)
    assert all(err < 1e-12 for _, _, err, _ in res)
    assert all(abs(loss - want) < 1e-12 for loss, want, *_ in res if loss is not None)
    print("pp x tp: loss", res[-1][0], "= one device; messages by axis:", res[0][3])
else:
    print(f"the 2-D mesh needs 4 ranks; this run has {WORLD}")

# %% [markdown]
# ## Who sends what, per module
#
# `shardlab.explain` around the schedule's step lists, on each rank, every module of its
# stage in call order with the messages it caused. The stage's sends and receives are
# issued by the schedule between the stage's calls, not inside a module: they land in
# `(outside modules)`, under the phase that ran when each was posted; the
# layers themselves send nothing. (Explaining the 2-D run instead would show each
# row-wise layer's all-reduce along `tp` on its own row.)


# %%
def explain_stage():
    import torch.distributed as dist
    from torch.distributed import pipelining

    model = tiny_llama()
    ids = batch(4)
    rank = dist.get_rank()
    cuts = pipeline.layer_ranges(LAYERS, WORLD)
    stage_mod = pipeline.DecoderStage(model, rank, WORLD, cuts[rank])
    stage = pipelining.PipelineStage(stage_mod, rank, WORLD, torch.device("cpu"))
    sched = pipelining.Schedule1F1B(stage, 4, loss_fn=pipeline.lm_loss)
    args = (ids,) if rank == 0 else ()
    kwargs = {"target": ids} if rank == WORLD - 1 else {}
    with shardlab.explain(stage_mod) as ex:
        sched.step(*args, **kwargs)
    return ex.explanation


explanation = ranks.run(explain_stage)[0]
for r, rows in enumerate(explanation.ranks):
    busy = [
        (row.name, row.phase, [k for k, *_ in row.events].count("send"),
         [k for k, *_ in row.events].count("recv"), sum(b for _, b, *_ in row.events))
        for row in rows if row.events
    ]  # fmt: skip
    print(f"rank {r}: {len(rows)} module rows; with messages (name, phase, sends, recvs, bytes):")
    for item in busy:
        print("   ", item)
    assert all(name == "(outside modules)" for name, *_ in busy)

# %% [markdown]
# The explorer above runs each new choice on `ranks`, so this notebook leaves them open:
# `ranks.close()` frees them when you are done (the kernel's end does too).
