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

A decision is the plan a rule returned (:class:`~shardlab.engine.rule.Plan`), as the
dispatcher runs it (:mod:`.plans`): which inputs move to which layout (moves are
messages, and run again on every call, the same on every rank), then the op on the
local blocks (:class:`~.plans.LocalCall`; or what stands for it on the blocks: each
rank's own view, reshape, slice, expand or slice gradient, :class:`~.plans.LocalView` …),
then the result wrapped in the layout and global strides the plan and torch's meta run
gave it. The first call of a signature runs the very same object. An op torch
decomposes replays its decomposition (:class:`~.plans.Decomposed`), a rule that is an
algorithm of several ops runs again (:class:`~.plans.Again`), each op inside replaying
its own plan. Nothing is learnt from a result, and nothing rides on a tensor.
"""

from __future__ import annotations

import contextlib

import torch

from shardlab.tensor.api import ShardTensor

__all__ = ["SCALARS", "clear", "deciding", "depth", "lookup", "named", "remember"]

# arguments kept in a key by type and value (and that nothing needs to prepare)
SCALARS = (bool, int, float, complex, str, type(None), torch.dtype, torch.device,
            torch.memory_format, torch.layout)  # fmt: skip

_TABLE: dict = {}
_DEPTH = [0]  # full decisions under way (a rule's own ops are decided inside its op's)


@contextlib.contextmanager
def deciding():
    """Around the full path of one op: the ops its rule (or torch's decomposition) calls
    run inside it (:func:`depth`; the no-grad replay learns nothing there)."""
    _DEPTH[0] += 1
    try:
        yield
    finally:
        _DEPTH[0] -= 1


def depth() -> int:
    return _DEPTH[0]


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
