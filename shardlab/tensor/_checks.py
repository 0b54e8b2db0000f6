"""The arguments of the constructors (``from_local``, ``distribute``, ``scatter_tensor``),
checked alike on every rank: the mesh, the placements, the device, every rank's local
shape (one all-gather of a fixed-size row, so ranks that disagree all raise)."""

from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from shardlab import _compat
from shardlab.runtime import this_rank
from shardlab.trace import label

__all__ = ["build_sizes"]


def build_sizes(sizes) -> list:
    """Canonical ``ShardLayout.sizes`` in the form ``from_local`` / ``build`` take."""
    return [
        None if e is None else list(e[0]) if len(e) == 1 else [list(s) for s in e] for e in sizes
    ]


def _mesh(mesh):
    if mesh is None:
        return this_rank().mesh
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"device_mesh must be a DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim not in (1, 2):
        raise ValueError(f"only 1-D and 2-D meshes are supported, got a {mesh.ndim}-D mesh")
    return mesh


def _placements(placements, mesh) -> tuple:
    if placements is None:
        return (Replicate(),) * mesh.ndim
    placements = tuple(placements)
    if len(placements) != mesh.ndim:
        raise ValueError(
            f"placements must have one entry per mesh dim: the mesh is {tuple(mesh.shape)} "
            f"({mesh.ndim}-D), got {len(placements)}: {list(placements)}"
        )
    for p in placements:
        if not isinstance(p, Shard | Replicate | Partial):
            raise TypeError(f"placements must be Shard(d), Replicate() or Partial(), got {p!r}")
    return placements


def _check_device(t: torch.Tensor, mesh, name: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != mesh.device_type:
        raise ValueError(
            f"{name} is on {t.device}, but the mesh is on {mesh.device_type}: "
            f"move it with .to('{mesh.device_type}')"
        )


_MAX_NDIM = 32
_DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64,
    torch.complex128, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8,
    torch.bool,
]  # fmt: skip


def _gather_shapes(local: torch.Tensor, mesh) -> dict:
    """Every coordinate's local shape, checked for agreement in ndim and dtype.

    One all-gather of 2 + 32 int64 per rank along each mesh dim (last first), so
    every rank of the mesh -- and only those -- sees every row and raises alike.
    """
    row = torch.full((2 + _MAX_NDIM,), -1, dtype=torch.int64, device=local.device)
    row[0] = local.ndim if local.ndim <= _MAX_NDIM else -1
    row[1] = _DTYPES.index(local.dtype) if local.dtype in _DTYPES else len(_DTYPES)
    row[2 : 2 + min(local.ndim, _MAX_NDIM)] = torch.tensor(
        local.shape[:_MAX_NDIM], dtype=torch.int64
    )
    grid = row
    with label("from_local.shapes"):
        for m in reversed(range(mesh.ndim)):  # rows of my line of mesh dim m, then up
            n = mesh.shape[m]
            out = torch.empty(n * grid.numel(), dtype=torch.int64, device=local.device)
            _compat.all_gather_single(out, grid.reshape(-1), group=mesh.get_group(m))
            grid = out.view(n, *grid.shape)
    rows = {coord: grid[coord].tolist() for coord in _coords(mesh)}
    ndims = sorted({r[0] for r in rows.values()})
    if -1 in ndims:
        raise ValueError(f"from_local: local tensors may have at most {_MAX_NDIM} dims")
    if len(ndims) != 1:
        raise ValueError(
            "from_local: local tensors have different numbers of dims across ranks: "
            + ", ".join(f"{c}: {r[0]}" for c, r in rows.items())
        )
    dtypes = {r[1] for r in rows.values()}
    if len(dtypes) != 1:
        names = [str(_DTYPES[r[1]]) if r[1] < len(_DTYPES) else "other" for r in rows.values()]
        raise ValueError(
            "from_local: local tensors have different dtypes across ranks: "
            + ", ".join(f"{c}: {n}" for c, n in zip(rows, names))
        )
    return {coord: tuple(r[2 : 2 + r[0]]) for coord, r in rows.items()}


def _coords(mesh):
    import itertools

    return [tuple(c) for c in itertools.product(*(range(n) for n in mesh.shape))]


def _global_shape_from_local(local_shape, placements, sizes, mesh) -> list[int]:
    """Global shape from this rank's local shape and explicit ``sizes`` (no communication)."""
    entries = [sizes] if mesh.ndim == 1 and sizes and isinstance(sizes[0], int) else list(sizes)
    if len(entries) != mesh.ndim:
        raise ValueError(f"sizes must have one entry per mesh dim ({mesh.ndim}), got {sizes!r}")
    shape, seen = list(local_shape), set()
    for m, p in enumerate(placements):
        if isinstance(p, Shard):
            entry = entries[m]
            if p.dim in seen or entry is None:
                if entry is None and p.dim not in seen:
                    raise ValueError(
                        f"sizes[{m}] is None for Shard({p.dim}): pass shape= or all sizes"
                    )
                seen.add(p.dim)
                continue
            seen.add(p.dim)
            if not all(isinstance(x, int) for x in entry):
                raise TypeError(f"sizes[{m}] must be a list of ints, got {entry!r}")
            shape[p.dim] = sum(entry)
    return shape
