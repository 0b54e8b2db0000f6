"""Each ZeRO stage built from torch's own pieces, and what it holds on a rank, measured.

Run :func:`measure` on every rank (``ranks.run``, a ``%%ranks`` cell)::

    m = shardlab.zero.measure(model_fn, batch, stage=3)   # this rank's part of the batch
    m.params, m.grads, m.optim, m.peak                     # bytes on this rank
    m.messages                                             # {"all_gather": (6, 213_632), ...}

What each stage is built from (``stage``), and what it keeps on each of N ranks:

0. ``DistributedDataParallel`` and torch's Adam: whole parameters, gradients and optimizer
   state on every rank; one all-reduce of the gradients (DDP's buckets).
1. DDP and ``torch.distributed.optim.ZeroRedundancyOptimizer`` around Adam: the optimizer
   state of 1/N of the parameter *tensors* (whole tensors, dealt out greedily by size);
   after its step each owner broadcasts the tensors it updated.
2. FSDP2, ``fully_shard(unit, reshard_after_forward=False)`` on each block, then on the
   root: 1/N of every parameter between steps, all of them whole from the forward's
   all-gathers to the end of backward; gradients reduce-scattered (1/N each).
3. FSDP2, ``fully_shard(unit, reshard_after_forward=True)``: parameters whole only while
   their unit runs, all-gathered again in backward.

A step is ``opt.zero_grad()`` (gradients set to None), forward, backward, ``opt.step()``.
DDP keeps its gradients in its buckets (``gradient_as_bucket_view=True``: one copy, not
two) and all-reduces them through torch's own ``allreduce_hook`` (what DDP does without a
hook, but from Python, so that :func:`shardlab.trace` sees it).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from shardlab.runtime import this_rank
from shardlab.trace import trace
from shardlab.zero.memory import StateBytes, state_bytes, state_tensors

__all__ = ["Measured", "activation_bytes", "blocks", "llama", "measure", "tokens"]

STAGES = (0, 1, 2, 3)


@dataclass
class Measured:
    """What one rank held and sent for one ZeRO stage (bytes unless said otherwise).

    ``params``, ``grads``, ``optim``: the distinct storages under the parameters (a
    DTensor's local shard), their gradients and the optimizer's state, after the last
    step. ``other``: everything else made since the model was built and still alive
    (buffers, RoPE tables, FSDP's emptied all-gather buffers at 0 bytes, Adam's step
    counts). ``peak``: the most live bytes at once during the last step, all of it
    (model states, activations, message buffers, temporaries). ``activations``: the peak
    of one forward and backward of this rank's batch on a plain copy of the model whose
    gradients already exist: what a step adds that is not a model state.
    ``messages``: ``{kind: (count, bytes)}`` of the last step on this rank (bytes: what
    the rank hands to each collective, :class:`shardlab.trace.Event`).
    ``psi``: the number of parameters; ``units``: the number of parameters in each FSDP
    unit (the blocks, then the root's own).
    """

    stage: int
    ranks: int
    rank: int
    params: int
    grads: int
    optim: int
    other: int
    peak: int
    activations: int
    psi: int
    units: list[int]
    losses: list[float] = field(default_factory=list)
    messages: dict[str, tuple[int, int]] = field(default_factory=dict)

    @property
    def states(self) -> int:
        """params + grads + optim."""
        return self.params + self.grads + self.optim


def blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's blocks: the children of its longest ``nn.ModuleList`` (a
    ``transformers`` decoder's ``model.model.layers``)."""
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    if not lists:
        return []
    return list(max(lists, key=len))


def llama(layers: int = 6, hidden: int = 64, vocab: int = 256, seed: int = 0):
    """A small ``transformers`` Llama (random weights, float32, nothing downloaded):
    ``layers`` blocks of width ``hidden`` (4 query heads, 2 key/value heads, an MLP twice
    as wide), ``vocab`` tokens; the same weights on every rank (``seed``)."""
    if hidden % 4:
        raise ValueError(f"hidden must be a multiple of 4 (4 heads), got {hidden}")
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab,
        max_position_embeddings=64,
    )
    config._attn_implementation = "sdpa"
    return transformers.LlamaForCausalLM(config)


def tokens(rank: int, batch: int = 1, seq: int = 8, vocab: int = 256) -> dict:
    """Rank ``rank``'s batch for a causal LM: ``batch`` x ``seq`` random token ids (its
    own seed) as ``input_ids`` and ``labels``."""
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(rank))
    return {"input_ids": ids, "labels": ids}


def _default_loss(model, batch):
    out = model(**batch)
    return out.loss if hasattr(out, "loss") else out


def activation_bytes(model_fn, batch: dict, *, loss=_default_loss, device=None) -> int:
    """Peak bytes of one forward and backward of ``batch`` on ``model_fn()`` whose
    gradients already exist (they accumulate in place): the activations and temporaries,
    the same on every rank of every stage that runs this batch. ``device``: where the
    model runs (None: where ``model_fn`` makes it)."""
    model = model_fn() if device is None else model_fn().to(device)
    loss(model, batch).backward()  # 1. the gradients made once, outside the count
    with StateBytes() as mem:  # 2. what one more forward and backward adds
        loss(model, batch).backward()
    return mem.peak


def _build(model, stage: int, optimizer, lr: float, units):
    """(the module to call, the module holding the parameters, the optimizer)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    mesh = this_rank().mesh
    if stage in (0, 1):
        group = mesh.get_group()
        net = DistributedDataParallel(model, process_group=group, gradient_as_bucket_view=True)
        net.register_comm_hook(group, allreduce_hook)  # DDP's own, from Python: traced
        if stage == 0:
            return net, model, optimizer(model.parameters(), lr=lr)
        zero = ZeroRedundancyOptimizer(
            model.parameters(), optimizer_class=optimizer, process_group=group, lr=lr
        )
        return net, model, zero
    for unit in units:  # bottom-up: the blocks first, the root takes what is left
        fully_shard(unit, mesh=mesh, reshard_after_forward=stage == 3)
    fully_shard(model, mesh=mesh, reshard_after_forward=stage == 3)
    return model, model, optimizer(model.parameters(), lr=lr)


def measure(
    model_fn,
    batch: dict,
    stage: int,
    *,
    optimizer=torch.optim.Adam,
    lr: float = 1e-3,
    steps: int = 2,
    units=blocks,
    loss=_default_loss,
) -> Measured:
    """Train ``model_fn()`` for ``steps`` steps as ZeRO ``stage`` on this rank's ``batch``
    and measure the last one (:class:`Measured`). Run it on every rank at once.

    Args:
        model_fn: makes the model (float32, the same on every rank: seed inside it).
        batch: this rank's inputs, keyword arguments of the model.
        stage: 0 (DDP), 1, 2 or 3 (see the module's table).
        optimizer: a ``torch.optim`` class (Adam: 8 bytes of state per float32 parameter).
        lr: its learning rate.
        steps: steps run; the last is measured (the first makes the optimizer's state).
        units: the modules FSDP gathers one at a time (stages 2, 3): ``units(model)``.
        loss: ``loss(model, batch)`` -> the scalar to minimise (the model's own ``.loss``).
    """
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {STAGES}, got {stage!r}")
    if steps < 2:
        raise ValueError(f"steps must be at least 2 (the first makes the state), got {steps}")
    ctx = this_rank()
    batch = {k: v.to(ctx.device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    activations = activation_bytes(model_fn, batch, loss=loss, device=ctx.device)
    losses = []
    with StateBytes() as mem:
        # 1. the model and the stage, counted from their first byte
        model = model_fn().to(ctx.device)
        psi = sum(p.numel() for p in model.parameters())
        parts = units(model)
        sizes = [sum(p.numel() for p in u.parameters()) for u in parts]
        net, holder, opt = _build(model, stage, optimizer, lr, parts if stage >= 2 else [])
        # 2. the steps; the last one traced, its peak counted from where it starts
        for i in range(steps):
            last = i == steps - 1
            if last:
                mem.follow(state_tensors(opt))  # (Adam's step counts: 4 bytes a tensor)
                mem.reset_peak()
            with trace() if last else contextlib.nullcontext() as t:
                opt.zero_grad()
                out = loss(net, batch)
                out.backward()
                opt.step()
            losses.append(out.item())
            del out
        # 3. what stays: the model states, and everything else still alive
        held = state_bytes(holder, opt)
        now, peak = mem.now, mem.peak
    messages: dict[str, tuple[int, int]] = {}
    for e in t.filter(rank=ctx.rank):
        count, nbytes = messages.get(e.kind, (0, 0))
        messages[e.kind] = (count + 1, nbytes + e.bytes)
    return Measured(
        stage=stage,
        ranks=ctx.world_size,
        rank=ctx.rank,
        **held,
        other=now - sum(held.values()),
        peak=peak,
        activations=activations,
        psi=psi,
        units=sizes + [psi - sum(sizes)],
        losses=losses,
        messages=messages,
    )
