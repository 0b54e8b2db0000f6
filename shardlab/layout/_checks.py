"""Argument checking shared by the layout modules.

Every error names the argument the user passed (``global_shape``, ``mesh_shape``,
``placements``, ``sizes``, ``local_shapes``, ...) and says what is supported.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

from torch import Size as _Size
from torch import SymInt as _SymInt
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from shardlab import _compat

SUPPORTED_PLACEMENTS = "Shard(dim), Replicate() or Partial(op)"


def as_int(name: str, value: object, minimum: int | None = None) -> int:
    """``value`` as a plain int (``bool`` refused), at least ``minimum`` if given."""
    if type(value) is int and (minimum is None or value >= minimum):
        return value  # the common case, without the abstract-class checks
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        said = f"{name} must be an int, got {type(value).__name__} {value!r}"
        if isinstance(value, _SymInt):  # a size traced symbolically (torch.compile)
            if _compat.compiled_autograd_on():  # a backward from a plain tensor
                raise NotImplementedError(f"{_compat.COMPILED_AUTOGRAD} ({said})")
            said += ": a layout holds numbers, never a size torch.compile made symbolic"
        raise TypeError(said)
    result = int(value)
    if minimum is not None and result < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {result}")
    return result


def int_tuple(name: str, value: object, minimum: int | None = 0) -> tuple[int, ...]:
    """A sequence of ints (each >= ``minimum`` unless None) as a tuple; ``name[i]`` in errors."""
    t = type(value)
    if (t is tuple or t is list or t is _Size) and all(
        type(v) is int and (minimum is None or v >= minimum) for v in value
    ):
        return tuple(value)  # the common case, without the abstract-class checks
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(f"{name} must be a sequence of ints, got {type(value).__name__}")
    return tuple(as_int(f"{name}[{i}]", v, minimum) for i, v in enumerate(value))


def check_mesh_shape(mesh_shape: object) -> tuple[int, ...]:
    """Mesh shapes with 1 or 2 dims, every size >= 1."""
    shape = int_tuple("mesh_shape", mesh_shape, minimum=1)
    if len(shape) not in (1, 2):
        raise ValueError(
            f"mesh_shape {shape} has {len(shape)} dims; only 1-D and 2-D meshes are supported"
        )
    return shape


def placement_str(placement: Placement) -> str:
    """``Shard(2)``, ``Replicate()``, ``Partial(sum)``: how a learner writes them."""
    if isinstance(placement, Shard):
        return f"Shard({placement.dim})"
    if isinstance(placement, Replicate):
        return "Replicate()"
    if isinstance(placement, Partial):
        return f"Partial({placement.reduce_op})"
    return repr(placement)


def normalise_placements(
    placements: object, mesh_ndim: int, tensor_ndim: int
) -> tuple[Placement, ...]:
    """One placement per mesh dim; ``Shard(-1)`` becomes ``Shard(tensor_ndim - 1)`` like torch."""
    if isinstance(placements, Placement):
        placements = (placements,)
    if type(placements) not in (tuple, list) and (
        isinstance(placements, (str, bytes)) or not isinstance(placements, Sequence)
    ):
        raise TypeError(
            f"placements must be a sequence of {SUPPORTED_PLACEMENTS}, "
            f"got {type(placements).__name__}"
        )
    if len(placements) != mesh_ndim:
        raise ValueError(
            f"placements has {len(placements)} entries but the mesh has {mesh_ndim} dims; "
            "give exactly one placement per mesh dim"
        )
    out: list[Placement] = []
    for m, p in enumerate(placements):
        if isinstance(p, Shard) and type(p) is Shard:
            dim = p.dim
            if not -tensor_ndim <= dim < tensor_ndim:
                raise ValueError(
                    f"placements[{m}] = Shard({dim}) is out of range for a tensor with "
                    f"{tensor_ndim} dims (valid: {-tensor_ndim} .. {tensor_ndim - 1})"
                )
            out.append(Shard(dim % tensor_ndim))
        elif isinstance(p, (Replicate, Partial)):
            out.append(p)
        elif isinstance(p, Placement):
            raise ValueError(
                f"placements[{m}] = {p!r} is not supported; use {SUPPORTED_PLACEMENTS}"
            )
        else:
            raise TypeError(
                f"placements[{m}] must be {SUPPORTED_PLACEMENTS}, got {type(p).__name__} {p!r}"
            )
    return tuple(out)


def mesh_dims_sharding(placements: Sequence[Placement], tensor_dim: int) -> list[int]:
    """Mesh dims whose placement is ``Shard(tensor_dim)``, outermost first."""
    return [m for m, p in enumerate(placements) if isinstance(p, Shard) and p.dim == tensor_dim]


def nested_outer(placements: Sequence[Placement], mesh_dim: int) -> int | None:
    """The outer mesh dim that shards the same tensor dim before ``mesh_dim``, if any.

    On a 2-D mesh with ``(Shard(d), Shard(d))`` mesh dim 1 nests inside mesh dim 0.
    """
    p = placements[mesh_dim]
    if not isinstance(p, Shard):
        return None
    outer = [m for m in mesh_dims_sharding(placements, p.dim) if m < mesh_dim]
    return outer[-1] if outer else None


def format_sizes(placement: Placement, sizes: Sequence | None, mesh_dim: int) -> str:
    """``Shard(2) sizes [5, 5, 4, 4] on mesh dim 0``; nested sizes print as a list of lists."""
    if sizes is None:
        return f"{placement_str(placement)} on mesh dim {mesh_dim}"
    shown = [list(s) if isinstance(s, Sequence) else s for s in sizes]
    return f"{placement_str(placement)} sizes {shown} on mesh dim {mesh_dim}"


def per_mesh_dim(sizes: Sequence | None, mesh_ndim: int) -> tuple[list, bool]:
    """User ``sizes`` as one entry per mesh dim, and whether it was a flat list on a 1-D mesh."""
    if sizes is None:
        return [None] * mesh_ndim, False
    if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence):
        raise TypeError(f"sizes must be None or a sequence, got {type(sizes).__name__}")
    if (
        mesh_ndim == 1
        and len(sizes) > 0
        and all(v is not None and not isinstance(v, Sequence) for v in sizes)
    ):
        return [list(sizes)], True
    if len(sizes) != mesh_ndim:
        raise ValueError(
            f"sizes has {len(sizes)} entries but the mesh has {mesh_ndim} dims; give one entry "
            "per mesh dim (None, a list of ints, or for nested Shard a list of lists)"
        )
    for m, entry in enumerate(sizes):
        if entry is not None and (
            isinstance(entry, (str, bytes)) or not isinstance(entry, Sequence)
        ):
            raise TypeError(f"sizes[{m}] must be None or a list, got {type(entry).__name__}")
    return list(sizes), False


def check_part(m: int, o: int | None, p: Placement, part: object, whole: int, ranks: int) -> None:
    """One size tuple of mesh dim ``m`` (inside piece ``o`` of the outer mesh dim, if nested)."""
    name = f"sizes[{m}]" if o is None else f"sizes[{m}][{o}]"
    where = "" if o is None else f" inside piece {o} of the outer mesh dim"
    if not isinstance(part, tuple) or not all(type(v) is int for v in part):
        raise TypeError(f"{name} must be a tuple of ints, got {part!r}")
    desc = format_sizes(p, part, m)
    if len(part) != ranks:
        raise ValueError(f"{name}: {desc} has {len(part)} sizes but mesh dim {m} has {ranks} ranks")
    if any(v < 0 for v in part):
        raise ValueError(f"{name}: {desc} has a negative size")
    if sum(part) != whole:
        raise ValueError(
            f"{name}: {desc} sum to {sum(part)} but tensor dim {p.dim} has {whole} elements{where}"
        )


def cached(fn):
    """Memoise a pure layout rule (layouts are hashable; list arguments become tuples).
    A training step asks the same questions every step."""
    import functools

    memo = functools.lru_cache(maxsize=8192)(fn)

    @functools.wraps(fn)
    def wrapper(*args):
        key = tuple(tuple(a) if isinstance(a, list) else a for a in args)
        try:
            hash(key)
        except TypeError:
            return fn(*args)
        return memo(*key)

    wrapper.cache_clear = memo.cache_clear
    return wrapper
