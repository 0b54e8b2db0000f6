"""ShardTensor under ``torch.compile``: graph breaks around every sharded op.

What dynamo sees::

    user code        x = conv(x)        y = x.relu() * 2       loss = y.mean()
                      |                   |                      |
    compiled graph   [plain-tensor code] [plain-tensor code]    [plain-tensor code]
                      ^ break             ^ break                ^ break
    eager            shardlab op on the real ShardTensor (its collectives, its cache)

dynamo traces ops on a DTensor subclass by running them on *stand-ins*: fake tensors
rebuilt by ``__tensor_unflatten__`` from torch's DTensor flatten format, which has no room
for shardlab's shard sizes (dynamo checks that format field by field). A stand-in has no
layout, so a sharded op on it cannot be decided; instead it asks dynamo for a graph break
(:func:`graph_break`): dynamo compiles the code before the op, runs the op eagerly on the
real ShardTensor (the decision cache, the collectives, autograd) and resumes compiling
after it. The public methods that read the layout (``to_local``, ``full_tensor``,
``redistribute``, ...) and the patched ``torch.nn.functional`` entry points run eagerly the
same way (:func:`eager`).

Nothing compiled ever holds a layout or a collective, so a graph cannot be reused for the
wrong shard sizes: what depends on the sizes runs eagerly every call, and the plain-tensor
graphs are guarded by torch on the local shapes they see.
"""

from __future__ import annotations

import functools

import torch
from torch._C._dynamo.eval_frame import get_eval_frame_callback as _callback

__all__ = ["check", "eager", "entry", "graph_break", "prepare", "tracing"]

tracing = _callback  # ``tracing() is not None``: dynamo's frame callback is installed


def graph_break(what: str):
    """Ask dynamo to run ``what`` eagerly: raises dynamo's ``Unsupported`` (a graph break
    while dynamo traces; a stand-in exists only while something traces)."""
    from torch._dynamo.exc import unimplemented

    unimplemented(
        gb_type="shardlab: a ShardTensor op",
        context=what,
        explanation=(
            "ShardTensor ops run eagerly (their layouts, collectives and halos are decided in "
            "Python); dynamo compiles the plain-tensor code around them"
        ),
        hints=[],
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
    _skip(call.__code__)  # one code object for every wrapper
    return call


def entry(fn):
    """:func:`eager` for the hottest entry points (``__torch_function__``,
    ``__torch_dispatch__``: every op passes both), without the wrapper's frame: ``fn``
    starts with ``if tracing() is not None: return <eager(fn)>(...)`` itself. Here dynamo
    is told never to inline ``fn`` and never to compile its frame."""
    fn._torchdynamo_disable = True
    _skip(fn.__code__)
    return fn


_WRAPPER_CODE: list = []


def _skip(code) -> None:
    if code not in _WRAPPER_CODE:
        _WRAPPER_CODE.append(code)


@functools.cache
def prepare() -> None:
    """Once dynamo is in use (``__tensor_flatten__``, or the first wrapper called under
    it): dynamo never compiles the frame of :func:`eager`'s wrapper itself; what it calls
    is disabled, or runs with no dynamo at all."""
    from torch._dynamo.eval_frame import skip_code

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
