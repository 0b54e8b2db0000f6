"""shardlab's collectives as ops a compiled graph can hold.

Eagerly, a ShardTensor op calls ``torch.distributed`` on its blocks. Under
``torch.compile`` the blocks are *fake* (dynamo and AOTAutograd trace with tensors that
have shapes and no data): a ``dist.all_reduce`` on them sends nothing, and nothing of it
would be in the graph. So each collective here checks its tensor once:

    real block  ->  torch.distributed, as always (no extra copy)
    fake block  ->  one of the ops below (``torch.ops.shardlab.*``): a node of the graph
                    with a fake kernel (shapes only) for tracing and, when the compiled
                    graph runs, the same ``torch.distributed`` calls on real blocks

::

    all_reduce(t, op, group, token)          -> [t reduced over the group, token']
    all_gather(t, group, token)              -> [t of group rank 0, 1, ..., token']
    exchange(sends, to, recvs, from, token)  -> [the received tensors, token']

Groups travel by name (``ProcessGroup.group_name``; a message's: comma-separated, empty for
the default group): a graph holds strings and ints only.

**The token chain.** Each message of a traced graph takes the token (an empty tensor) the
message before it returned, and returns the next::

    empty() -> all_reduce(.., t0) -> t1 -> exchange(.., t1) -> t2 -> all_reduce(.., t2)

A compiler may reorder what does not depend on each other; with uneven shards each rank
compiles its own graph, and two ranks that ordered two messages differently would wait for
each other (a hang: inductor did so with a ResNet's halos and statistics). The chain makes
the order of the trace, the same on every rank, a data dependency. It runs through the
whole trace (AOTAutograd's forward and backward: the backward's first message takes the
forward's last token, which the forward saves).

**Messages are effectful ops.** They are also registered with torch's effect system (an
*ordered* effect, as ``print``): AOTAutograd wraps each in ``with_effects`` with an effect
token of its own (the forward's an input of the graph, the backward's a tangent), and its
partitioner treats them as what they are on every rank:

* **never dropped**: a send-only exchange has no output its rank uses, and the partitioner
  rebuilds the backward graph from what its outputs need (a backward that re-sent a saved
  block before any gradient op lost its send on one rank, not the receive on the other);
* **never recomputed, never moved**: a forward message's outputs are saved (the min-cut
  partitioner had re-run a forward receive in the backward of the rank that received), a
  backward message hangs on a tangent (it had moved a backward receive into one rank's
  forward).

Inductor orders an effectful op after the one before it but may still sink one whose
outputs nothing uses (a send-only exchange) to the end of the graph, after a message the
other rank posts later: the token chain above keeps it in place.
"""

from __future__ import annotations

import contextlib
import operator

import torch
import torch.distributed as dist
from torch._higher_order_ops.effects import _EffectType, _register_effectful_op
from torch.distributed.distributed_c10d import _resolve_process_group

from shardlab.comm import graphs, p2p, traced

__all__ = ["all_gather", "all_reduce_", "exchange", "is_traced", "sending"]

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
        "avg": dist.ReduceOp.AVG}  # fmt: skip


def is_traced(t: torch.Tensor) -> bool:
    """True for a fake block (under dynamo or AOTAutograd); a plain tensor is real."""
    if type(t) is torch.Tensor:
        return False
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(t)


def sending(t, group=None) -> None:
    """Called on every rank of a message's group before it is posted (also by a rank
    that sends and receives nothing), with the block ``t``: nothing for a real block.
    For a fake one under ``torch.compile`` on several ranks, no graph may hold the
    message: :func:`shardlab.comm.graphs.message_traced` breaks the graph or runs the
    frame eagerly (on every rank alike: the message's group decides, not the block)."""
    if type(t) is torch.Tensor or (group is not None and dist.get_world_size(group) == 1):
        return
    if graphs.breaks_on_messages():  # dynamo runs an op on cut blocks (check_ranks)
        traced.graph_break("a message between ranks")
    graphs.message_traced(t)


def _name(group) -> str:
    return (group if group is not None else dist.group.WORLD).group_name


def _op_name(op) -> str:
    for name, value in _OPS.items():
        if op == value:
            return name
    raise NotImplementedError(f"reduce op {op}: supported are {sorted(_OPS)}")


# -- the ops a graph holds ---------------------------------------------------------
@torch.library.custom_op("shardlab::all_reduce", mutates_args=())
def _all_reduce(t: torch.Tensor, op: str, group: str, token: torch.Tensor) -> list[torch.Tensor]:
    out = t.contiguous().clone()
    dist.all_reduce(out, _OPS[op], group=_resolve_process_group(group))
    return [out, token.new_empty(0)]


@_all_reduce.register_fake
def _(t, op, group, token):
    return [torch.empty_like(t, memory_format=torch.contiguous_format), token.new_empty(0)]


@torch.library.custom_op("shardlab::all_gather", mutates_args=())
def _all_gather(t: torch.Tensor, n: int, group: str, token: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t, memory_format=torch.contiguous_format) for _ in range(n)]
    dist.all_gather(out, t.contiguous(), group=_resolve_process_group(group))
    return [*out, token.new_empty(0)]


@_all_gather.register_fake
def _(t, n, group, token):
    out = [torch.empty_like(t, memory_format=torch.contiguous_format) for _ in range(n)]
    return [*out, token.new_empty(0)]


@torch.library.custom_op("shardlab::exchange", mutates_args=())
def _exchange(
    sends: list[torch.Tensor],
    to: list[int],
    recvs: list[torch.Tensor],
    sources: list[int],
    groups: str,
    token: torch.Tensor,
) -> list[torch.Tensor]:
    out = [torch.empty_like(r, memory_format=torch.contiguous_format) for r in recvs]
    gs = [_resolve_process_group(g) if g else None for g in groups.split(",")]
    ops = [dist.P2POp(dist.isend, t.contiguous(), p, g) for t, p, g in zip(sends, to, gs)]
    gs = gs[len(sends) :]
    ops += [dist.P2POp(dist.irecv, b, p, g) for b, p, g in zip(out, sources, gs)]
    p2p.run_p2p(ops)
    return [*out, token.new_empty(0)]


@_exchange.register_fake
def _(sends, to, recvs, sources, groups, token):
    out = [torch.empty_like(r, memory_format=torch.contiguous_format) for r in recvs]
    return [*out, token.new_empty(0)]


# a message is sent for its effect on another rank: never dropped, recomputed nor moved
for _op in (_all_reduce, _all_gather, _exchange):
    _register_effectful_op(_op._opoverload, _EffectType.ORDERED)


def _save_in_checkpointed_regions(joint_module) -> None:
    """A forward message inside an activation-checkpointed region (``torch.utils.checkpoint``
    under torch.compile: every op tagged *prefer recompute*) is saved, not recomputed.

    torch's partitioner saves an effectful op's outputs except there, where it lets a
    recomputation in the backward run it again. Its ``with_effects`` then needs the
    forward's effect token, which AOTAutograd saves but does not keep (a ``None`` at run
    time: ``expected all tensors_saved_with_vc_check to be Tensors``, on every rank), and
    the message would be sent twice. Its outputs (a halo, a reduced statistic, a token)
    are small next to the activations the region recomputes.
    """
    from torch._functorch._aot_autograd.utils import is_with_effects
    from torch.utils.checkpoint import CheckpointPolicy

    recompute = (CheckpointPolicy.PREFER_RECOMPUTE, CheckpointPolicy.MUST_RECOMPUTE)

    def save(node) -> None:  # the message as outside a region; its outputs saved
        node.meta.pop("recompute")
        for user in node.users:
            if user.target is operator.getitem:
                if isinstance(user.meta.get("val"), (tuple, list)):
                    save(user)
                else:
                    user.meta["recompute"] = CheckpointPolicy.MUST_SAVE

    for node in joint_module.graph.nodes:
        if (
            is_with_effects(node)
            and getattr(node.args[1], "namespace", None) == "shardlab"
            and node.meta.get("recompute") in recompute
        ):
            save(node)


@contextlib.contextmanager
def saved_in_checkpointed_regions():
    """:func:`_save_in_checkpointed_regions` before torch's own pass (the partitioners
    call ``force_save_effectful_ops``), while the scope is open; restored after."""
    from torch._functorch import partitioners

    torch_pass = getattr(partitioners, "force_save_effectful_ops", None)
    if torch_pass is None:  # (a torch without that pass: nothing to add to)
        yield
        return

    def both(joint_module) -> None:
        _save_in_checkpointed_regions(joint_module)
        torch_pass(joint_module)

    partitioners.force_save_effectful_ops = both
    try:
        yield
    finally:
        partitioners.force_save_effectful_ops = torch_pass


_CHAIN: list = [None, None]  # [the proxy mode tracing now, the last message's token]


def _token(like: torch.Tensor) -> torch.Tensor:
    """The token the last message of this trace returned (a new chain for a new trace;
    outside a trace, dynamo's run on fake blocks, nothing to order: a fresh one)."""
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    mode = get_proxy_mode()
    if mode is None or _CHAIN[0] is not mode:
        _CHAIN[0], _CHAIN[1] = mode, torch.empty(0, device=like.device)
    return _CHAIN[1]


def _chain(token: torch.Tensor) -> None:
    if _CHAIN[0] is not None:
        _CHAIN[1] = token


@contextlib.contextmanager
def _kept_in_place():
    """A message traced in the backward stays in the backward graph, one traced in the
    forward in the forward graph (AOTAutograd's partitioner tags). Otherwise the
    partitioner may move a backward message that needs no gradient on this rank (a rank
    that only receives) into the forward graph, where the other ranks do not post it."""
    from torch.fx import traceback as fx_traceback

    if not fx_traceback.has_preserved_node_meta():
        yield
        return
    meta = fx_traceback.current_meta
    was = meta.get("partitioner_tag")
    backward = was in ("is_backward", "must_be_in_backward")
    meta["partitioner_tag"] = "must_be_in_backward" if backward else "must_be_in_forward"
    try:
        yield
    finally:
        meta["partitioner_tag"] = was


# -- what shardlab calls -----------------------------------------------------------
def all_reduce_(t: torch.Tensor, op=dist.ReduceOp.SUM, group=None) -> torch.Tensor:
    """``dist.all_reduce(t, op, group)`` (in place), traced as ``shardlab::all_reduce``."""
    sending(t, group)
    if not is_traced(t):
        dist.all_reduce(t, op, group=group)
        return t
    with _kept_in_place():
        out, token = torch.ops.shardlab.all_reduce(t, _op_name(op), _name(group), _token(t))
    _chain(token)
    return t.copy_(out)


def all_gather(out: list, t: torch.Tensor, group=None) -> list:
    """``dist.all_gather(out, t, group)``, traced as ``shardlab::all_gather``."""
    sending(t, group)
    if not is_traced(t):
        dist.all_gather(out, t, group=group)
        return out
    with _kept_in_place():
        *got, token = torch.ops.shardlab.all_gather(t, len(out), _name(group), _token(t))
    _chain(token)
    for o, r in zip(out, got):
        o.copy_(r)
    return out


def exchange(ops: list) -> bool:
    """Point-to-point ``P2POp`` s (global peers) traced as one
    ``shardlab::exchange``: each receive buffer gets what arrived. False (nothing done)
    for real tensors: the caller posts them itself."""
    if not ops or not any(is_traced(op.tensor) for op in ops):
        return False
    sending(ops[0].tensor)
    sends = [op for op in ops if op.op is dist.isend]
    recvs = [op for op in ops if op.op is not dist.isend]
    with _kept_in_place():
        got = torch.ops.shardlab.exchange(
            [op.tensor for op in sends],
            [op.peer for op in sends],
            [op.tensor for op in recvs],
            [op.peer for op in recvs],
            ",".join(op.group.group_name if op.group is not None else "" for op in sends + recvs),
            _token(ops[0].tensor),
        )
    *got, token = got
    _chain(token)
    for op, r in zip(recvs, got):
        op.tensor.copy_(r)
    return True
