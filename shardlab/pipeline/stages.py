"""A decoder cut into pipeline stages by module, and one training step of torch's own
schedules over them.

A :class:`DecoderStage` holds a slice of an unchanged ``transformers`` causal decoder
(Llama, Qwen2, Mistral: ``model.model.embed_tokens``, ``.layers``, ``.norm``,
``.rotary_emb``, ``model.lm_head``) and runs it the way the model's own ``forward`` does:
the first stage embeds the tokens; every stage makes the positions, the causal mask
(``transformers``' ``create_causal_mask``) and the rotary embeddings of its input and
runs its layers; the last applies the final norm and the head. The modules are the
model's own (not copied): the gradients land in the model's parameters, under their
names.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from shardlab.pipeline.timeline import _Table

__all__ = ["SCHEDULES", "DecoderStage", "Step", "layer_ranges", "lm_loss", "stage_indices"]
__all__ += ["step"]

SCHEDULES = _Table(
    "The schedules :func:`step` runs, by name: the ``torch.distributed.pipelining`` class "
    "and the stages each rank holds (1, or 2 for the interleaved and zero-bubble ones).",
    {
        "GPipe": ("ScheduleGPipe", 1),
        "1F1B": ("Schedule1F1B", 1),
        "Interleaved1F1B": ("ScheduleInterleaved1F1B", 2),
        "ZeroBubble": ("ScheduleInterleavedZeroBubble", 2),
        "ZBV": ("ScheduleZBVZeroBubble", 2),
    },
)


def layer_ranges(layers: int, stages: int) -> list[range]:
    """The decoder layers of each stage: ``layers`` cut in ``stages`` contiguous ranges,
    the first ones one longer where it does not divide."""
    base, extra = divmod(layers, stages)
    out, start = [], 0
    for s in range(stages):
        n = base + (1 if s < extra else 0)
        out.append(range(start, start + n))
        start += n
    return out


def stage_indices(rank: int, ranks: int, per_rank: int, style: str = "loop") -> list[int]:
    """The stages rank ``rank`` holds of ``ranks * per_rank``: ``"loop"`` (interleaved
    schedules: ``rank, rank + ranks, ...``) or ``"v"`` (ZBV: ``rank`` and
    ``2 * ranks - 1 - rank``)."""
    if style == "v":
        if per_rank != 2:
            raise ValueError("the V layout has 2 stages per rank")
        return [rank, 2 * ranks - 1 - rank]
    return [rank + k * ranks for k in range(per_rank)]


class DecoderStage(torch.nn.Module):
    """Stage ``index`` of ``stages`` of a causal decoder ``model`` (a ``transformers``
    ``...ForCausalLM``): its ``layers`` (a range of ``model.model.layers``), the embedding
    on stage 0, the final norm and head on the last. Takes token ids (stage 0) or hidden
    states ``(B, S, H)``; returns hidden states, or the logits ``(B, S, V)`` on the last."""

    def __init__(self, model, index: int, stages: int, layers: range):
        super().__init__()
        inner = model.model
        self.config = model.config
        self.first, self.last = index == 0, index == stages - 1
        self.embed_tokens = inner.embed_tokens if self.first else None
        self.layers = torch.nn.ModuleList(inner.layers[i] for i in layers)
        self.rotary_emb = inner.rotary_emb
        self.norm = inner.norm if self.last else None
        self.lm_head = model.lm_head if self.last else None

    def forward(self, x):
        from transformers.masking_utils import create_causal_mask

        hidden = self.embed_tokens(x) if self.first else x
        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        mask = create_causal_mask(
            config=self.config,
            inputs_embeds=hidden,
            attention_mask=None,
            cache=None,
            position_ids=positions,
        )
        rope = self.rotary_emb(hidden, position_ids=positions)
        for layer in self.layers:
            hidden = layer(hidden, attention_mask=mask, position_embeddings=rope,
                           position_ids=positions)  # fmt: skip
        if self.last:
            hidden = self.lm_head(self.norm(hidden))
        return hidden


def lm_loss(logits, labels):
    """A causal LM's loss as ``transformers`` computes it (position ``t`` predicts token
    ``t + 1``, labels ``-100`` ignored, the mean over the tokens), in the logits' dtype
    (``transformers`` computes it in float32)."""
    vocab = logits.shape[-1]
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, vocab), labels[:, 1:].reshape(-1), ignore_index=-100
    )


@dataclass
class Step:
    """What one rank did in :func:`step`: the mean loss over the micro-batches (``None``
    on ranks without the last stage), the stages it held, its recorded actions
    (:class:`~shardlab.pipeline.Action`) and its traced messages."""

    loss: float | None
    stages: list[int]
    actions: list = field(default_factory=list)
    events: list = field(default_factory=list)


def step(model, ids, labels, *, schedule: str = "1F1B", microbatches: int = 8,
         group=None, trace_mesh=None) -> Step:  # fmt: skip
    """One training step of ``model`` (a ``transformers`` causal decoder, the same on every
    rank) on ``ids``/``labels`` (B, S), pipelined over the ranks of ``group`` (default: the
    world) with torch's ``torch.distributed.pipelining`` schedule ``schedule`` (a key of
    :data:`SCHEDULES`). Each rank holds its stages (:func:`stage_indices`), runs the
    schedule with its actions recorded (:func:`~shardlab.pipeline.record`) and its
    messages traced, and leaves the gradients of its stages' parameters in ``model``
    (the loss :func:`lm_loss` of each micro-batch divided by ``microbatches`` before its
    backward, ``scale_grads=False``: the mean of the micro-batches' mean losses, one
    device's gradient for micro-batches with as many labelled tokens, to float64 rounding
    for any ``microbatches``). Call on every rank of ``group``.

    Communicates:
        The schedule's point-to-point messages: each micro-batch's hidden states
        (B/m, S, H) from stage s to s + 1, their gradients back, and once the shapes.
    """
    import torch.distributed as dist
    from torch.distributed import pipelining

    import shardlab
    from shardlab.pipeline.timeline import record

    if schedule not in SCHEDULES:
        raise ValueError(f"schedule {schedule!r}: one of {sorted(SCHEDULES)}")
    cls_name, per_rank = SCHEDULES[schedule]
    cls = getattr(pipelining, cls_name)
    rank = dist.get_rank(group)
    ranks = dist.get_world_size(group)
    n = ranks * per_rank
    cuts = layer_ranges(len(model.model.layers), n)
    mine = stage_indices(rank, ranks, per_rank, "v" if schedule == "ZBV" else "loop")
    device = ids.device
    stages = [
        pipelining.PipelineStage(DecoderStage(model, i, n, cuts[i]), i, n, device, group=group)
        for i in mine
    ]

    # The loss is divided by ``microbatches`` *before* backward (``scale_grads=False``),
    # not the gradients after it (torch's default, ``scale_grads=True``). Both are exact
    # in float64, but the model is not entirely float64: ``transformers``' RMSNorm casts
    # its input to float32 (a downcast for a float64 model), so every backward through it
    # rounds the gradient to float32. One device's mean loss carries the 1/m into that
    # rounding; torch's default rounds the unscaled gradient and divides afterwards, which
    # differs by ~1e-7 relative unless m is a power of two. Scaling the loss as one
    # device's backward does gives the same gradients as one device, to float64 rounding.
    def loss_fn(logits, target):
        return lm_loss(logits, target) / microbatches

    sched = cls(stages if per_rank > 1 else stages[0], microbatches, loss_fn=loss_fn,
                scale_grads=False)  # fmt: skip
    losses: list = []
    holds_first, holds_last = 0 in mine, n - 1 in mine
    args = (ids,) if holds_first else ()
    kwargs = {"target": labels, "losses": losses} if holds_last else {}
    with shardlab.trace(trace_mesh) as t, record(stages, dist.get_rank()) as actions:
        sched.step(*args, **kwargs)
    # each entry is a micro-batch's mean loss / m: their sum is the mean over micro-batches
    loss = float(torch.stack(losses).detach().sum()) if holds_last else None
    return Step(loss, mine, list(actions), list(t.events))
