"""Window ops sharded over several dims (H on mesh dim 0, W on mesh dim 1): products of 1-D plans.

A 2-D window is the product of a window along H and one along W (taps, padding and
reflect/replicate/circular maps all act per dim), so the plan factorises (any number of sharded
dims works the same way; one mesh dim per sharded dim). Rank (i, j)::

                                plan_w.blocks(j):  left      own       right
      plan_h.blocks(i):  above                     corner    edge      corner
                         own                       edge      OWN       edge
                         below                     corner    edge      corner

(each row / column of the grid is one run of ``plan.blocks``; there may be several per
neighbour, or none). Grid cell (a, b) comes from rank ``(plan_h.blocks(i)[a].rank,
plan_w.blocks(j)[b].rank)`` and covers ``rows x cols`` of those two runs: corners come from
diagonal ranks (or further away when shards are small), every needed element arrives exactly
once, and nothing else does.

Caller contract for rank ``coord`` (dims in plan order, e.g. H then W)::

    nh, nw = buffer_shape(coord)                   # the grid of blocks, packed
    buf = full((..., nh + 1, nw + 1), pad value)   # + one pad row and one pad column
    for b in blocks(coord):                        # own (b.local) or received from b.src
        buf[..., b.at[0] : b.at[0] + b.shape[0], b.at[1] : b.at[1] + b.shape[1]] = data of b
    idx_d = local_index(coord)[d] with negatives (PAD / OVERHANG) -> n_d, the pad row / column
    window = buf.index_select(H, idx_h).index_select(W, idx_w)
    y = op(window, padding=0)   (conv_transpose: then y[..., c0h:c1h, c0w:c1w] with crop(coord))

A dim with no blocks (the window reads only padding) gives ``n_d = 0``: the pad row alone.

Backward: the same blocks in reverse; gradients of received blocks are summed by their owners.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from .conv import ConvPlan, conv_plan
from .shards import offsets

Box = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Block:
    """Input ``box`` (global ``[start, stop)`` per sharded dim) held by mesh coordinate ``src``;
    it goes to ``at`` (start per dim) in the caller's buffer, cell ``grid`` of the block grid;
    ``local`` is True for the rank's own block."""

    src: tuple[int, ...]
    box: Box
    grid: tuple[int, ...]
    at: tuple[int, ...]
    local: bool

    @property
    def shape(self) -> tuple[int, ...]:
        """The block's extent along each sharded dim."""
        return tuple(stop - start for start, stop in self.box)

    @property
    def numel(self) -> int:
        """The number of positions in the block (product of :attr:`shape`)."""
        n = 1
        for start, stop in self.box:
            n *= stop - start
        return n


@dataclass(frozen=True)
class ConvPlanND:
    """One :class:`ConvPlan` per sharded dim; mesh dim d cuts sharded dim d."""

    plans: tuple[ConvPlan, ...]

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """The number of ranks along each sharded dim."""
        return tuple(len(p.in_sizes) for p in self.plans)

    def coords(self) -> list[tuple[int, ...]]:
        """Every mesh coordinate, row-major."""
        return list(itertools.product(*(range(n) for n in self.mesh_shape)))

    def blocks(self, coord: Sequence[int]) -> tuple[Block, ...]:
        """Grid cells, row-major (the order of the caller's concatenation)."""
        me = self._coord(coord)
        per_dim = [p.blocks(c) for p, c in zip(self.plans, me, strict=True)]
        cells = []
        bases = [offsets([r.stop - r.start for r in b]) for b in per_dim]
        for grid in itertools.product(*(range(len(b)) for b in per_dim)):
            rows = [per_dim[d][g] for d, g in enumerate(grid)]
            src = tuple(r.rank for r in rows)
            box = tuple((r.start, r.stop) for r in rows)
            at = tuple(bases[d][g] for d, g in enumerate(grid))
            cells.append(Block(src, box, grid, at, src == me))
        return tuple(cells)

    def buffer_shape(self, coord: Sequence[int]) -> tuple[int, ...]:
        """Per sharded dim, the rows of all blocks along it (the packed grid, without pad)."""
        me = self._coord(coord)
        return tuple(
            sum(r.stop - r.start for r in p.blocks(c)) for p, c in zip(self.plans, me, strict=True)
        )

    def recvs(self, coord: Sequence[int]) -> tuple[Block, ...]:
        """Blocks that come from other ranks (edges and corners)."""
        return tuple(b for b in self.blocks(coord) if not b.local)

    def sends(self, coord: Sequence[int]) -> tuple[tuple[tuple[int, ...], Box], ...]:
        """``(dst, box)`` for every block this rank sends (mirror of :meth:`recvs`)."""
        me = self._coord(coord)
        return tuple((dst, b.box) for dst in self.coords() for b in self.recvs(dst) if b.src == me)

    def local_index(self, coord: Sequence[int]) -> tuple[tuple[int, ...], ...]:
        """Per sharded dim, window position -> index into the buffer along that dim."""
        return tuple(p.local_index(c) for p, c in zip(self.plans, self._coord(coord), strict=True))

    def crop(self, coord: Sequence[int]) -> tuple[tuple[int, int], ...]:
        """Per sharded dim, the slice of the local op's output that is this rank's."""
        return tuple(p.crop(c) for p, c in zip(self.plans, self._coord(coord), strict=True))

    def out_box(self, coord: Sequence[int]) -> Box:
        """Global output ``[start, stop)`` per sharded dim computed by this rank."""
        return tuple(p.out_range(c) for p, c in zip(self.plans, self._coord(coord), strict=True))

    def elements_received(self, coord: Sequence[int]) -> int:
        """Elements per (batch, channel) plane received; times those dims x itemsize = bytes."""
        return sum(b.numel for b in self.recvs(coord))

    def elements_sent(self, coord: Sequence[int]) -> int:
        """How many positions (along the sharded dims) the rank at ``coord`` sends."""
        total = 0
        for _, box in self.sends(coord):
            n = 1
            for start, stop in box:
                n *= stop - start
            total += n
        return total

    def _coord(self, coord: Sequence[int]) -> tuple[int, ...]:
        c = tuple(coord)
        shape = self.mesh_shape
        if len(c) != len(shape) or not all(0 <= i < n for i, n in zip(c, shape, strict=True)):
            raise ValueError(f"coord {c} is not a coordinate of mesh {shape}")
        return c


def conv_plan_nd(
    sizes: Sequence[Sequence[int]],
    kernel_size: int | Sequence[int],
    stride: int | Sequence[int] = 1,
    dilation: int | Sequence[int] = 1,
    padding: int | str | Sequence = 0,
    padding_mode: str = "zeros",
    transposed: bool = False,
    output_padding: int | Sequence[int] = 0,
    ceil_mode: bool = False,
) -> ConvPlanND:
    """``sizes[d]``: the shard sizes of sharded dim d. Other arguments: one value for all dims
    or one per dim (padding per dim: an int or a (left, right) pair; or 'same' / 'valid')."""
    if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence) or not sizes:
        raise TypeError("sizes must be a non-empty list with one list of shard sizes per dim")
    ndim = len(sizes)
    args = {
        "kernel_size": kernel_size,
        "stride": stride,
        "dilation": dilation,
        "padding": padding,
        "output_padding": output_padding,
    }
    per_dim = {name: _per_dim(name, value, ndim) for name, value in args.items()}
    plans = tuple(
        conv_plan(
            sizes[d],
            padding_mode=padding_mode,
            transposed=transposed,
            ceil_mode=ceil_mode,
            **{name: values[d] for name, values in per_dim.items()},
        )
        for d in range(ndim)
    )
    return ConvPlanND(plans)


def _per_dim(name: str, value: object, ndim: int) -> list:
    if isinstance(value, (int, str)):
        return [value] * ndim
    if not isinstance(value, Sequence) or len(value) != ndim:
        raise ValueError(f"{name} must be one value or one per sharded dim ({ndim}), got {value!r}")
    return list(value)
