"""What an op does on ShardTensors, decided once per signature and replayed.

Deciding an op (:mod:`shardlab.engine.dispatch`) costs tens of microseconds of Python:
torch's meta kernel on the global shapes, the rule's layout arithmetic, specs, strides.
All of it is a pure function of the op's *signature*::

    (op,  for every argument:
            ShardTensor   -> its spec (mesh, global shape, strides, dtype), its layout
                             (placements and every shard size), requires_grad
            plain tensor  -> shape, strides, dtype, device, requires_grad
            anything else -> its type and value (ints of a view, a dim, a dtype …))

(the op, each spec and each layout by identity, ``id``: C hashes, where a layout's own hash
is Python code. shardlab builds one spec and one layout object per value, so equal values
are the same objects; each decision holds the objects of its key alive, so an id in a kept
key can never be another object's), so it is computed once per signature and
kept (a bounded table, the oldest entry dropped first). A hit costs one pass over the
arguments to build the key, the local call and the wrap: no meta run, no rule, no spec
built. Anything the key cannot hold (a plain DTensor to adopt first, an unhashable
argument) takes the full path every time.

A decision replays exactly what the full path did: which inputs move to which layout
(moves are messages, and run again on every call, the same on every rank), then the op
on the local blocks (:class:`~.plans.LocalCall`; or what stands for it on the blocks: each
rank's own view, reshape, slice, expand or slice gradient, :class:`~.plans.LocalView` …),
then the result
wrapped in the layout and global strides the full path gave it. An op torch decomposes
replays its decomposition (:class:`~.plans.Decomposed`). A rule says its result is such a local
call with :func:`decided`; only a mark made for this op at this depth is kept (an op
inside a decomposition marks its own result, which is not the outer op's decision).
Every other op keeps deciding in full.
"""

from __future__ import annotations

import contextlib

from shardlab.tensor.api import ShardTensor

__all__ = [
    "BLOCKS", "clear", "decided", "deciding", "depth", "hold", "lookup", "named", "remember",
]  # fmt: skip

BLOCKS = "blocks"  # a move: a list of ShardTensors (cat's), each block as it is (and
# the empty 1-D tensors torch.cat skips)

_TABLE: dict = {}
_DEPTH = [0]  # full decisions under way (a rule's own ops are decided inside its op's)


@contextlib.contextmanager
def deciding():
    """Around the full path of one op: what its rule marks :func:`decided` at this depth
    is its own; a decision marked deeper is one of the ops its rule (or torch's
    decomposition) called, not to be kept for this op's signature."""
    _DEPTH[0] += 1
    try:
        yield
    finally:
        _DEPTH[0] -= 1


def depth() -> int:
    return _DEPTH[0]


def decided(out, func, moves, mesh, layouts, cause: str = "", local=None) -> None:
    """Mark ``out`` (a rule's result for ``func``) as the op on the blocks after
    ``moves``, giving ``layouts`` (a tuple for an op of several results): the decision
    can be kept for the signature (:class:`~.plans.LocalCall`; ``local``: what runs on the
    blocks instead of ``func``, :class:`~.plans.LocalView`)."""
    out._decided = (func, _DEPTH[0], moves, mesh, layouts, cause, local)


SIZE = 8192  # signatures kept; a training step repeats a few hundred


TABLES = [_TABLE]  # every table of kept decisions (:mod:`.nograd` adds its own)


def clear() -> None:
    for table in TABLES:
        table.clear()


def lookup(key):
    """The decision kept for ``key``, else None (also for a key that cannot be hashed)."""
    try:
        return _TABLE.get(key)
    except TypeError:  # an unhashable scalar somewhere
        return None


def remember(key, decision, table=_TABLE) -> None:
    try:
        hash(key)
    except TypeError:
        return
    if len(table) >= SIZE:
        del table[next(iter(table))]  # the oldest
    table[key] = decision


def named(args, kwargs) -> tuple:
    """The objects a key of a call on ``args``/``kwargs`` names by id besides the op:
    every ShardTensor's spec (its mesh in it) and layout."""
    st = ShardTensor
    out = []

    def visit(a):
        if type(a) is st:
            out.extend((a._spec, a._layout))
        elif type(a) in (list, tuple):
            for v in a:
                visit(v)

    for a in (*args, *kwargs.values()):
        visit(a)
    return tuple(out)


def hold(key, before, objects: tuple) -> None:
    """The decision kept for ``key`` since ``before`` (the one kept before the call, or
    None) holds ``objects`` alive: those its key names by id."""
    kept = lookup(key)
    if kept is not None and kept is not before:
        kept.anchors = (*kept.anchors, *objects)
