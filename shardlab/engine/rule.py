"""What a rule is, and the :class:`Plan` it returns.

A rule is a function ``rule(func, args, kwargs)`` registered for aten ops
(:func:`shardlab.engine.aten.register`). It reads the *global* facts of its arguments
(each ShardTensor's layout, shape, strides, dtype; the values of the non-tensor
arguments) and returns one of three things:

- a :class:`Plan`: the decision, and nothing done yet. Which arguments move to which
  layout (the messages), what runs on each rank's blocks, the layouts of the results.
  :mod:`shardlab.engine.dispatch` executes it, and keeps it for the call's signature
  (:mod:`shardlab.engine.decisions`): the next call with the same signature runs the
  plan without asking the rule;
- ``NotImplemented``: not for these layouts (the dispatcher tries the next stage);
- the result itself, for the few rules that are algorithms of several steps over
  ShardTensors (the ring's, ``mean`` as ``sum / n``, an ``argmax``'s gather of the
  candidates): each op inside is dispatched, planned and kept on its own, as torch's
  decompositions are.

A plan never depends on the values of a tensor, nor on a local shape: every rank
derives the same plan, so every rank posts the same messages. (A result whose *size*
depends on the values, ``nonzero``, cannot be planned so: such a rule says so by
returning its result.)
"""

from __future__ import annotations

from shardlab.layout import ShardLayout

__all__ = ["BLOCKS", "Plan"]

BLOCKS = "blocks"  # a move: a list of ShardTensors (cat's), each block as it is (and
# the empty 1-D tensors torch.cat skips)


class Plan:
    """A rule's decision for one call::

        Plan(mesh, layouts, moves=None, cause="", local=None, inplace=False, otherwise=None)

    ``moves``: one entry per argument (positional, then keyword values in order; None:
    none moves), each

    - ``None``: the argument as it is (a scalar; a ShardTensor's block as it is; a
      plain tensor, whole);
    - a :class:`~shardlab.layout.ShardLayout`: the ShardTensor moved there first (a plain
      tensor: cut to it, a slice, no message), the messages labelled ``cause``;
    - ``((layout, cause), ...)``: moved in these steps, each labelled (a Partial summed
      first, then aligned);
    - :data:`BLOCKS`: a list of ShardTensors, each block as it is.

    ``layouts``: the result's layout, or a tuple of them for an op of several results
    (``native_layer_norm``'s output, mean and rstd). ``local``: what runs on the blocks
    instead of the op itself (:class:`~shardlab.engine.plans.LocalView` ...), called as
    ``local(block_args, block_kwargs)``. ``inplace``: the op writes its first argument
    (not moved) and returns it. ``otherwise``: what runs instead, as ``otherwise(func,
    args, kwargs)``, on a rank whose blocks the plan does not fit (``local`` raised
    :class:`~shardlab.engine.plans.Stale`: a block whose strides allow no view is
    copied, and the copy writes back); that call is not kept.
    """

    __slots__ = ("mesh", "layouts", "moves", "cause", "local", "inplace", "otherwise")

    def __init__(
        self, mesh, layouts, moves=None, cause="", local=None, inplace=False, otherwise=None
    ):
        self.mesh, self.layouts, self.cause = mesh, layouts, cause
        self.moves = None if moves is None else tuple(moves)
        self.local, self.inplace, self.otherwise = local, inplace, otherwise

    @property
    def many(self) -> bool:
        return isinstance(self.layouts, tuple)

    def __repr__(self) -> str:
        outs = self.layouts if self.many else (self.layouts,)
        moves = ", ".join(_move_str(m) for m in self.moves) if self.moves else "none move"
        local = f", local={type(self.local).__name__}" if self.local is not None else ""
        return f"Plan({moves} -> {', '.join(map(str, outs))}{local})"


def _move_str(m) -> str:
    if m is None:
        return "-"
    if isinstance(m, ShardLayout):
        return str(m)
    if m is BLOCKS:
        return "blocks"
    return " then ".join(str(lay) for lay, _ in m)
