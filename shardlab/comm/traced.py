"""ShardTensor under ``torch.compile``: a traceable subclass.

What dynamo and AOTAutograd see::

    user code        x = conv(x)          y = x.relu() * w         loss = y.mean()

    mesh of 1 rank   [torch's conv, relu, mul, mean on the blocks: one graph, no break]
    several ranks    conv (halos) | [relu, mul (w as it is)] | mean (all-reduce)
                                ^ break                   ^ break: a message

* **The layout travels with the tensor.** DTensor's flatten format carries a
  :class:`Placements` (DTensor's placements, holding the :class:`ShardLayout`): the
  ShardTensors that dynamo and AOTAutograd rebuild from fake blocks have their layout,
  and dynamo's guard on the spec compares layouts (other shard sizes, another graph).
* **On a mesh of one rank everything is traced.** dynamo puts the ops in the graph,
  AOTAutograd runs ``__torch_dispatch__`` on fake blocks (it decides as it always does
  and leaves torch's ops on the blocks in the graph); the patched ``torch.nn.functional``
  entry points take torch's own function there (:mod:`shardlab.patch`); parameters are
  taken as they are (:func:`one_rank`). Nothing is sent, so nothing is in the way.
* **Cut over several ranks, what sends nothing is traced; every message breaks the
  graph** (:func:`check_ranks`, :class:`sends_break`): the op that would post it runs
  eagerly, as do the patched entry points that send (halos, rings, exact means) and the
  public methods that read the layout (``to_local``, ``full_tensor``, ...: :func:`eager`).
  Parameters are taken as they are (``F.linear`` too: torch's, on the ShardTensors);
  their partial gradients leave the compiled backward and are summed with the others at
  the end of the backward (``shardlab.tensor.compiled_grads.route``). No compiled graph,
  forward or backward, holds a collective: with uneven shards the ranks' graphs differ,
  and a message inside one, ordered against eager messages outside, could pair rank 0's
  halo with rank 1's all-reduce (a hang). Traced anyway (``aot_function``, ``make_fx``),
  the collectives are graph nodes that send the same messages when the graph runs
  (:mod:`shardlab.comm.collectives`), never skipped.
* **Inside** :class:`messages_in_graphs` **(opt-in) the messages are in the graphs too**:
  ops that send are traced, a patched ``F`` call is one nonstrict-traced call, the
  messages of a graph are chained by a token (one order on every rank) and kept in their
  pass (forward or backward), and the ranks agree before a call breaks (:func:`agree`).
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch._C._dynamo.eval_frame import get_eval_frame_callback as _callback

from shardlab import _compat

__all__ = [
    "COMPILED", "TRACEABLE", "Placements", "SYMBOLIC", "check", "cpu_numbers", "eager",
    "entry", "faked", "graph_break", "layout_of", "outside_modes", "placements", "prepare",
    "tracing",
]  # fmt: skip

tracing = _callback  # ``tracing() is not None``: dynamo's frame callback is installed

TRACEABLE = _compat.traceable()  # before 2.13 each op runs eagerly (:func:`check`)


def graph_break(what: str):
    """Ask dynamo to run ``what`` eagerly: raises dynamo's ``Unsupported`` (a graph break
    while dynamo traces; a stand-in exists only while something traces)."""
    from torch._dynamo.exc import unimplemented

    unimplemented(
        gb_type="shardlab: a ShardTensor op",
        context=what,
        explanation=(
            "this ShardTensor call runs eagerly (shardlab.comm.traced); dynamo compiles "
            "the code around it"
        ),
        hints=["fullgraph=True cannot hold it: compile without fullgraph"],
    )


def eager(fn):
    """``fn`` and everything it calls run eagerly, also when called from compiled code:
    dynamo breaks the graph at the call and never traces inside.

    Outside ``torch.compile`` (no dynamo callback installed: every eager program) the
    call goes straight to ``fn``; only under dynamo does it pass through
    ``torch.compiler.disable`` (which costs ~1.5 µs, and an op on a ShardTensor passes
    several of these entry points). Both that wrapper and dynamo's import (~0.5 s) wait
    for the first call under dynamo."""
    disabled = []

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if _callback() is None:
            return fn(*args, **kwargs)
        if not disabled:
            prepare()
            disabled.append(torch.compiler.disable(fn, recursive=True))
        return disabled[0](*args, **kwargs)

    call._torchdynamo_disable = True  # dynamo never inlines it: a graph break, called as is
    call._torchdynamo_disable_msg = _reason(fn)  # (what dynamo says: ``fullgraph=True``)
    _skip(call.__code__)  # one code object for every wrapper
    return call


def _reason(fn) -> str:
    """Why dynamo leaves ``fn`` out of its graph, as its error with ``fullgraph=True``
    and ``torch._dynamo.explain`` say it."""
    name = f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', fn)}".lstrip(".")
    return (
        f"shardlab: {name} runs eagerly, never in a compiled graph (a ShardTensor cut "
        "over several ranks: it may send between ranks, or read the layout). "
        "fullgraph=True cannot hold it: compile without fullgraph, and dynamo compiles "
        "the code around it"
    )


def entry(fn):
    """:func:`eager` for the hottest entry points (``__torch_function__``,
    ``__torch_dispatch__``: every op passes both), without the wrapper's frame: ``fn``
    starts with ``if tracing() is not None: return <eager(fn)>(...)`` itself. Here dynamo
    is told never to inline ``fn`` and never to compile its frame."""
    fn._torchdynamo_disable = True
    fn._torchdynamo_disable_msg = _reason(fn)
    _skip(fn.__code__)
    return fn


_WRAPPER_CODE: list = []


def _skip(code) -> None:
    if code not in _WRAPPER_CODE:
        _WRAPPER_CODE.append(code)


COMPILED: list = []  # not empty once dynamo looked at a ShardTensor here (torch 2.13 on)


@functools.cache
def prepare() -> None:
    """Once dynamo is in use (``__tensor_flatten__``, or the first wrapper called under
    it): dynamo never compiles the frame of :func:`eager`'s wrapper itself; what it calls
    is disabled, or runs with no dynamo at all."""
    from torch._dynamo.eval_frame import skip_code

    if TRACEABLE:  # the traced paths (one rank, gradients fixed): 2.13 on
        COMPILED.append(True)
    for code in _WRAPPER_CODE:
        skip_code(code)


def check(func, args, kwargs) -> None:
    """A graph break when any argument is a stand-in, a ShardTensor that dynamo or
    AOTAutograd rebuilt for tracing (no layout). One pass, no allocation: every op on a
    ShardTensor runs this."""
    for a in args:
        if getattr(a, "_layout", 0) is None or (
            type(a) in (list, tuple) and any(getattr(x, "_layout", 0) is None for x in a)
        ):
            graph_break(getattr(func, "__name__", str(func)))
    if kwargs:
        for a in kwargs.values():
            if getattr(a, "_layout", 0) is None:
                graph_break(getattr(func, "__name__", str(func)))


class Placements(tuple):
    """DTensor's placements of a ShardTensor, holding its :class:`ShardLayout`: how the
    layout travels in DTensor's flatten format (dynamo, AOTAutograd) and how dynamo's guard
    on the spec sees shard sizes. Equal to another ``Placements`` only for the same layout;
    to plain placements as a tuple (torch's own checks compare them)."""

    def __new__(cls, layout):
        self = super().__new__(cls, layout.placements)
        self.layout = layout
        return self

    def __eq__(self, other):
        if isinstance(other, Placements):
            return self.layout == other.layout
        return tuple.__eq__(self, other)

    def __ne__(self, other):
        return not self.__eq__(other)

    __hash__ = tuple.__hash__

    def __reduce__(self):
        return Placements, (self.layout,)


def layout_of(flatten_spec):
    """The layout in DTensor's flatten context ``(placements, ...)``; None for plain
    placements and before torch 2.13 (:data:`TRACEABLE`)."""
    return getattr(flatten_spec[0], "layout", None) if TRACEABLE else None


def placements(layout) -> Placements:
    """The :class:`Placements` of ``layout``, one per layout object."""
    hit = layout.__dict__.get("_places")
    if hit is None:
        hit = Placements(layout)
        object.__setattr__(layout, "_places", hit)
    return hit


def outside_modes():
    """No dispatch mode (dynamo's fake tensors, AOTAutograd's tracing) inside: the meta
    runs whose results shardlab keeps between calls are plain meta tensors."""
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


def cpu_numbers():
    """For plain tensors of numbers that decisions read (positions on the CPU), also
    while torch.compile traces: :func:`outside_modes` when a mode is active (under a
    fake mode any op, on any tensor, would give a tensor without values)."""
    if torch._C._len_torch_dispatch_stack() == 0:
        return contextlib.nullcontext()
    return outside_modes()


def faked(args) -> bool:
    """True if the first ShardTensor among ``args`` holds a fake block (dynamo's or
    AOTAutograd's tracing)."""
    from torch._subclasses.fake_tensor import is_fake

    for a in args:
        if isinstance(a, torch.Tensor):
            return is_fake(a)
        if type(a) in (list, tuple):
            for x in a:
                if isinstance(x, torch.Tensor):
                    return is_fake(x)
    return False


SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)  # dynamo's symbolic scalars
