"""Halo plans for a sliding-window op (conv, conv-transpose, pooling) along ONE sharded dim.

The input (..., L) is cut into ``sizes`` (any ints >= 0) over ranks 0..R-1. Every rank computes
exactly its own slice of the output after receiving the input rows its outputs' windows read
(the lower bound: nothing else), from any rank (multi-hop when shards are smaller than the halo).

Who owns which output (forward op: conv / pool; output j's window starts at padded position
j*stride; ``owner(i)`` is the rank holding input i)::

    output j  ->  owner(clamp(j * stride, 0, L - 1))

    input   [ r0: 0 1 2 | r1: 3 4 | r2: (empty) | r3: 5 6 7 ]    k=3, stride 1, padding 'same'
    output  [ r0: 0 1 2 | r1: 3 4 |              | r3: 5 6 7 ]    sizes kept; empty owns none
    rank 1 window = padded [3, 7) = inputs 2 3 4 5: receives row 2 from r0, row 5 from r3

Transposed conv: output o (a position of the full output cropped by ``padding[0]``) belongs to
``owner(clamp((o + padding[0]) // stride, 0, L - 1))``: kernel s, stride s multiplies sizes by s.

Caller contract for rank r (1-D; :mod:`.conv_nd` composes dims). Along the sharded dim::

    parts = [my_shard[start - my_offset : stop - my_offset] if src == r else received
             for (src, start, stop) in plan.blocks(r)]        # own runs + recvs(r), by start
    buf = cat(parts + [one row of pad value])                 # pad: 0 (conv, avg) / -inf (max)
    idx = plan.local_index(r), with PAD and OVERHANG replaced by len(buf) - 1
    window = buf.index_select(dim, idx)                       # len == window(r) stop - start
    forward:    y = op(window, stride, dilation, padding=0, ceil_mode=False)  # out_sizes[r]
    transposed: y = conv_transpose(window, stride, dilation, padding=0, output_padding=0)
                y = y[..., crop(r)[0] : crop(r)[1]]                           # out_sizes[r]

``window(r)`` is a range of PADDED positions (forward: padded position p is input p - pad_left)
or of input indices (transposed). ``index_map(r)`` gives each window position's global input
index, PAD (-1: zero padding, pooling's implicit padding, or a row none of r's outputs reads)
or OVERHANG (-2: past the padded end, only in a ceil_mode window; torch ignores it: max-pool
fills -inf, avg-pool divides by the count of non-OVERHANG positions of each window).

Backward uses the same plan in reverse: gradients of the received rows are sent back to their
owners and summed into their shards (autograd through cat/index_select does the local part).
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

from ._build import typed
from ._checks import as_int, int_tuple
from ._windows import OVERHANG, PAD, Rows, blocks_of, forward_window, transposed_window
from .shards import offsets

__all__ = [
    "OVERHANG", "PAD", "PADDING_MODES", "ConvPlan", "Rows", "conv_out_length", "conv_plan",
    "same_padding",
]  # fmt: skip

PADDING_MODES = ("zeros", "reflect", "replicate", "circular")


def same_padding(kernel_size: int, dilation: int = 1) -> tuple[int, int]:
    """torch's ``padding='same'``: total ``dilation*(k-1)``, the odd one out on the right."""
    total = as_int("dilation", dilation, 1) * (as_int("kernel_size", kernel_size, 1) - 1)
    return total // 2, total - total // 2


def conv_out_length(
    length: int,
    kernel_size: int,
    stride: int = 1,
    dilation: int = 1,
    pad_left: int = 0,
    pad_right: int = 0,
    transposed: bool = False,
    output_padding: int = 0,
    ceil_mode: bool = False,
) -> int:
    """Global output length, torch's formulas (conv, conv_transpose, pooling with ceil_mode).

    Raises ValueError when torch would (fewer than one output).
    """
    length, kernel_size = as_int("length", length, 1), as_int("kernel_size", kernel_size, 1)
    stride, dilation = as_int("stride", stride, 1), as_int("dilation", dilation, 1)
    pad_left, pad_right = as_int("pad_left", pad_left, 0), as_int("pad_right", pad_right, 0)
    span = dilation * (kernel_size - 1)  # the window covers span + 1 padded positions
    if transposed:
        out = (length - 1) * stride - pad_left - pad_right + span + output_padding + 1
    elif ceil_mode:  # torch pooling: round up, but the last window must start inside the
        out = (length + pad_left + pad_right - span - 1 + stride - 1) // stride + 1
        if (out - 1) * stride >= length + pad_left:  # input or the left padding
            out -= 1
    else:
        out = (length + pad_left + pad_right - span - 1) // stride + 1
    if out < 1:
        raise ValueError(
            f"the output would have {out} elements: input length {length}, kernel_size "
            f"{kernel_size}, stride {stride}, dilation {dilation}, padding "
            f"({pad_left}, {pad_right}){', transposed' if transposed else ''}; the window "
            "must fit in the padded input"
        )
    return out


@dataclass(frozen=True)
class _RankPlan:
    out: tuple[int, int]  # global output range this rank computes
    window: tuple[int, int]  # padded positions (forward) / input indices (transposed)
    index_map: tuple[int, ...]  # per window position: global input index, PAD or OVERHANG
    blocks: tuple[Rows, ...]  # needed rows: own runs (rank == r) and received runs, by start
    crop: tuple[int, int]  # slice of the local op's output to keep


@dataclass(frozen=True)
class ConvPlan:
    """Exact halo exchange and local windows for every rank; see the module docstring."""

    in_sizes: tuple[int, ...]
    kernel_size: int
    stride: int
    dilation: int
    padding: tuple[int, int]
    padding_mode: str
    transposed: bool
    output_padding: int
    ceil_mode: bool
    out_length: int
    out_sizes: tuple[int, ...]
    ranks: tuple[_RankPlan, ...] = field(repr=False)

    def out_range(self, r: int) -> tuple[int, int]:
        """Global output indices ``[start, stop)`` rank r computes."""
        return self.ranks[r].out

    def window(self, r: int) -> tuple[int, int]:
        """Window rank r assembles: padded positions (forward) or input indices (transposed);
        ``(0, 0)`` when r owns no output."""
        return self.ranks[r].window

    def index_map(self, r: int) -> tuple[int, ...]:
        """Global input index (or PAD / OVERHANG) feeding each position of ``window(r)``."""
        return self.ranks[r].index_map

    def blocks(self, r: int) -> tuple[Rows, ...]:
        """What the caller concatenates, in order: runs of its own shard (``rank == r``) and
        received runs (``rank`` = source), sorted by global start; empty if r owns no output."""
        return self.ranks[r].blocks

    def recvs(self, r: int) -> tuple[Rows, ...]:
        """Rows r receives, ``Rows(src, start, stop)``, by start; a src owning non-contiguous
        needed rows (dilation, reflect/circular wrap) appears once per contiguous run."""
        return tuple(b for b in self.ranks[r].blocks if b.rank != r)

    def sends(self, r: int) -> tuple[Rows, ...]:
        """Mirror of :meth:`recvs`: ``Rows(dst, start, stop)`` that r sends, by dst then start."""
        return tuple(
            Rows(dst, b.start, b.stop)
            for dst in range(len(self.in_sizes))
            for b in self.recvs(dst)
            if b.rank == r
        )

    def own_rows(self, r: int) -> tuple[Rows, ...]:
        """Runs of r's own shard that its window reads (``Rows(r, start, stop)``, global)."""
        return tuple(b for b in self.ranks[r].blocks if b.rank == r)

    def bytes_per_element_sent(self, r: int) -> int:
        """Input rows r sends; times (product of the other dims) x itemsize = bytes."""
        return sum(b.stop - b.start for b in self.sends(r))

    def rows_received(self, r: int) -> int:
        """How many input rows rank ``r`` receives from other ranks (its halos)."""
        return sum(b.stop - b.start for b in self.recvs(r))

    def local_index(self, r: int) -> tuple[int, ...]:
        """``index_map(r)`` as indices into ``cat(blocks(r))``; PAD / OVERHANG kept negative
        (computed once per rank: plans are immutable and kept per signature)."""
        cache = self.__dict__.setdefault("_indices", {})
        hit = cache.get(r)
        if hit is None:
            hit = cache[r] = self._local_index(r)
        return hit

    def _local_index(self, r: int) -> tuple[int, ...]:
        blocks = self.ranks[r].blocks
        starts = [b.start for b in blocks]
        bases = offsets([b.stop - b.start for b in blocks])
        out = []
        for g in self.ranks[r].index_map:
            if g < 0:
                out.append(g)
            else:
                i = bisect.bisect_right(starts, g) - 1
                out.append(bases[i] + g - starts[i])
        return tuple(out)

    def crop(self, r: int) -> tuple[int, int]:
        """Slice of the local op's output that is r's ``out_sizes[r]`` outputs."""
        return self.ranks[r].crop

    def __str__(self) -> str:
        kind = "conv_transpose" if self.transposed else "window op"
        lines = [
            f"ConvPlan({kind} k={self.kernel_size} stride={self.stride} dilation="
            f"{self.dilation} padding={self.padding} {self.padding_mode}: in sizes "
            f"{list(self.in_sizes)} -> out sizes {list(self.out_sizes)})"
        ]
        for r in range(len(self.in_sizes)):
            recv = ", ".join(f"[{s}, {e}) from rank {q}" for q, s, e in self.recvs(r))
            (o0, o1), (w0, w1) = self.out_range(r), self.window(r)
            lines.append(
                f"  rank {r}: out [{o0}, {o1}), window [{w0}, {w1}), recv {recv or 'nothing'}"
            )
        return "\n".join(lines)


def _kept(plan):
    """``plan`` kept per arguments (a plan is immutable): every call of a sharded conv,
    pool or window op plans its exchange, and a training step repeats the same few."""
    table: dict = {}

    @functools.wraps(plan)
    def conv_plan(*args, **kwargs):
        try:  # typed, as ShardLayout.build: True and 1.0 are refused where 1 is not
            key = (typed(args), typed(tuple(sorted(kwargs.items()))))
            hit = table.get(key)
        except TypeError:  # a list among the arguments: planned every time
            return plan(*args, **kwargs)
        if hit is None:
            hit = plan(*args, **kwargs)
            if len(table) > 4096:
                table.clear()
            table[key] = hit
        return hit

    return conv_plan


def _plan_conv(
    sizes: Sequence[int],
    kernel_size: int,
    stride: int = 1,
    dilation: int = 1,
    padding: int | str | tuple[int, int] = (0, 0),
    padding_mode: str = "zeros",
    transposed: bool = False,
    output_padding: int = 0,
    ceil_mode: bool = False,
    shift: int = 0,
) -> ConvPlan:
    """Plan a 1-D window op over an input cut into ``sizes``; see the module docstring.

    ``padding``: int, ``(left, right)``, ``'same'`` (stride 1) or ``'valid'``. For transposed
    conv it crops the full output like torch's ``padding`` (``(left, right)`` allowed).
    ``shift`` (forward ops): an output goes to the rank owning the padded position
    ``shift`` before its window's, not the window's own. ``F.pad`` (a window of 1) passes
    its left pad: each row stays where it is and the edge ranks grow.
    """
    sizes = int_tuple("sizes", sizes)
    length = sum(sizes)
    if not sizes or length == 0:
        raise ValueError(f"sizes {list(sizes)} hold no input rows; need a non-empty input")
    k = as_int("kernel_size", kernel_size, 1)
    st = as_int("stride", stride, 1)
    dl = as_int("dilation", dilation, 1)
    op = as_int("output_padding", output_padding, 0)
    pad = _check_padding(padding, k, st, dl, transposed)
    if padding_mode not in PADDING_MODES:
        raise ValueError(f"padding_mode must be one of {PADDING_MODES}, got {padding_mode!r}")
    if transposed and (padding_mode != "zeros" or ceil_mode):
        raise ValueError("transposed conv supports only padding_mode='zeros' and no ceil_mode")
    if transposed and not (op < st or op < dl):
        raise ValueError(f"output_padding {op} must be smaller than stride {st} or dilation {dl}")
    if not transposed and op:
        raise ValueError("output_padding is only meaningful for transposed=True")
    if transposed and shift:
        raise ValueError("shift is only meaningful for a forward op (transposed=False)")
    limit = {"reflect": length - 1, "circular": length}.get(padding_mode)
    if limit is not None and max(pad) > limit:
        raise ValueError(
            f"padding {pad} is too large for padding_mode={padding_mode!r} on a global input "
            f"of length {length}: torch needs padding {'<' if limit < length else '<='} {length}"
        )
    n_out = conv_out_length(length, k, st, dl, pad[0], pad[1], transposed, op, ceil_mode)

    def first_output(x: int) -> int:  # first output whose anchor input index is >= x
        j = x * st - pad[0] if transposed else -(-(x + shift) // st)
        return min(max(j, 0), n_out)

    nonempty = [r for r, n in enumerate(sizes) if n > 0]
    starts = offsets(sizes)
    bounds = [0] + [first_output(starts[r]) for r in nonempty[1:]] + [n_out]
    out = {r: (bounds[i], bounds[i + 1]) for i, r in enumerate(nonempty)}
    ranks, prev = [], 0
    for r in range(len(sizes)):
        lo, hi = out.get(r, (prev, prev))
        prev = hi
        geometry = transposed_window if transposed else forward_window
        window, index_map, crop = geometry(lo, hi, length, k, st, dl, pad, padding_mode)
        ranks.append(_RankPlan((lo, hi), window, index_map, blocks_of(r, index_map, sizes), crop))
    out_sizes = tuple(p.out[1] - p.out[0] for p in ranks)
    return ConvPlan(
        sizes, k, st, dl, pad, padding_mode, transposed, op, ceil_mode, n_out, out_sizes,
        tuple(ranks),
    )  # fmt: skip


conv_plan = _kept(_plan_conv)
conv_plan.__name__ = conv_plan.__qualname__ = "conv_plan"


def _check_padding(padding: object, k: int, st: int, dl: int, transposed: bool) -> tuple[int, int]:
    if padding == "valid":
        return (0, 0)
    if padding == "same":
        if st != 1 or transposed:
            raise ValueError("padding='same' needs stride 1 and a forward (non-transposed) op")
        return same_padding(k, dl)
    if isinstance(padding, str):
        raise ValueError(
            f"padding must be 'same', 'valid', an int or (left, right), got {padding!r}"
        )
    if not isinstance(padding, (tuple, list)):
        padding = (padding, padding)
    pad = int_tuple("padding", padding)
    if len(pad) != 2:
        raise ValueError(f"padding must be an int or a (left, right) pair, got {padding!r}")
    return pad  # type: ignore[return-value]
