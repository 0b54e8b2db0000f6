"""Whole-tensor gathers are never silent.

A tensor is cut so that no rank has to hold it whole. When shardlab has no rule for an op
on a layout, it gathers the whole tensor onto every rank and computes it there (the
``whole-tensor fallback``), or first moves it to a layout that holds it whole (an
``auto-redistribute`` to Replicate). The answer is exact, but each rank then holds the
whole tensor: out of memory for an image cut over 8 GPUs because it fits on none of them.

So every such move, made where it is decided (:func:`shardlab.comm.p2p.redistribute_local`),
is reported here, by what the scope asks (:func:`gathers`):

- ``"warn"`` (the default): a :class:`GatherWarning` once per op and layout, on every
  rank: the op, the layout it met, the bytes each rank now holds, and that a rule is
  missing;
- ``"raise"``: a :class:`GatherError` on every rank instead, before anything is sent
  (runs that must never hold a whole tensor: ``shardlab.patched(gather="raise")``);
- ``"ignore"``: nothing (the tracer still labels the messages).

Every rank decides alike: the layouts are global, so all ranks warn or raise together.
"""

from __future__ import annotations

import contextlib
import contextvars
import warnings

from torch.distributed.tensor import Partial, Replicate

from shardlab.layout import ShardLayout

__all__ = ["GatherError", "GatherWarning", "gathers", "is_gather", "report"]

_MODES = ("warn", "raise", "ignore")
_MODE: contextvars.ContextVar[str] = contextvars.ContextVar("shardlab_gather", default="warn")
_SEEN: set = set()  # (op, layout, itemsize): warned once
_CAUSES = ("whole-tensor fallback for ", "auto-redistribute for ")


class GatherWarning(UserWarning):
    """An op gathered a whole tensor onto every rank: a rule is missing for its layout."""


class GatherError(RuntimeError):
    """A whole-tensor gather inside ``gathers("raise")`` (or ``patched(gather="raise")``)."""


@contextlib.contextmanager
def gathers(mode: str = "warn"):
    """Inside: what a whole-tensor gather does, ``"warn"`` (once per op and layout),
    ``"raise"`` (a :class:`GatherError` on every rank, before anything is sent) or
    ``"ignore"``. Scoped: the mode outside is restored on exit."""
    if mode not in _MODES:
        raise ValueError(f"gathers(mode): expected one of {list(_MODES)}, got {mode!r}")
    token = _MODE.set(mode)
    try:
        yield
    finally:
        _MODE.reset(token)


def is_gather(src: ShardLayout, dst: ShardLayout, cause: str) -> bool:
    """Is the move from ``src`` to ``dst`` labelled ``cause`` a gather for a missing rule:
    a fallback's or an auto-redistribute's move of a cut tensor to a layout every rank
    holds whole? (A Partial value summed is no gather: each rank held all of its size.)"""
    if not cause.startswith(_CAUSES) or not dst.is_whole() or src.is_whole():
        return False
    if 0 in src.global_shape:  # an empty tensor: nothing moves, nothing is held
        return False
    summed = tuple(Replicate() if isinstance(p, Partial) else p for p in src.placements)
    return not src.replace(placements=summed).is_whole()


def report(src: ShardLayout, dst: ShardLayout, cause: str, itemsize: int) -> None:
    """Called before the messages of a move that :func:`is_gather`: warn, raise or not."""
    mode = _MODE.get()
    if mode == "ignore":
        return
    op = cause.split(" for ", 1)[1]
    numel = 1
    for n in dst.global_shape:
        numel *= n
    what = (
        f"shardlab: {op} has no rule for {_describe(src)}: it gathered the whole tensor "
        f"{tuple(dst.global_shape)} onto every rank ({_bytes(numel * itemsize)} per rank, "
        f"{cause!r} in the tracer); a rule is missing"
    )
    if mode == "raise":
        raise GatherError(what + " (gathers are refused in this scope)")
    key = (op, src, itemsize)
    if key in _SEEN:
        return
    if len(_SEEN) >= 4096:
        _SEEN.clear()
    _SEEN.add(key)
    warnings.warn(what, GatherWarning, stacklevel=2)


def _describe(layout: ShardLayout) -> str:
    return str(layout).removeprefix("ShardLayout(").removesuffix(")")


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"
