"""Everything that differs between the torch releases shardlab supports, in one place.

Supported and tested: torch 2.11, 2.12, 2.13, 2.14 and 2.15 (``SUPPORTED``). Each shim
below names the versions and the difference. shardlab uses DTensor's public API where it
can; the private pieces it relies on are listed here and pinned by ``tests/test_compat.py``,
so a new torch release fails loudly in one place.
"""

from __future__ import annotations

import re

SUPPORTED = ((2, 11), (2, 15))  # oldest and newest minor release tested (pyproject agrees)


def _minor(version: str) -> tuple[int, int] | None:
    m = re.match(r"(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else None


def torch_version() -> tuple[int, int]:
    import torch

    return _minor(torch.__version__)


def check_torch_version() -> None:
    """One clear message at ``import shardlab`` when the installed torch is missing or
    outside the tested range (read from the package metadata: torch is not imported)."""
    from importlib import metadata

    lo, hi = SUPPORTED
    wanted = f"torch {lo[0]}.{lo[1]} to {hi[0]}.{hi[1]}"
    hint = f"pip install 'torch>={lo[0]}.{lo[1]},<{hi[0]}.{hi[1] + 1}'"
    try:
        have = metadata.version("torch")
    except metadata.PackageNotFoundError:
        raise ImportError(f"shardlab needs {wanted}, and torch is not installed: {hint}") from None
    minor = _minor(have)
    if minor is None or not lo <= minor <= hi:
        raise ImportError(
            f"shardlab supports {wanted} (each tested in CI); this environment has torch "
            f"{have}. Install a supported torch: {hint}"
        )


# -- torch.compile (shardlab.comm.traced) ------------------------------------------------
def traceable() -> bool:
    """torch 2.13 to 2.15 are the versions tried with the layout in DTensor's flatten format
    (2.11's format is another, and there a traced parameter lost its gradient): before 2.13
    every ShardTensor that dynamo rebuilds is a stand-in and each op runs eagerly."""
    return torch_version() >= (2, 13)


def saves_mesh_for_random_ops() -> bool:
    """torch 2.13-2.14: AOTAutograd saves the mesh (DTensor's opaque flatten attribute) as a
    tensor for the backward of a checkpointed region holding a random-tagged op (its RNG
    state is saved for the recomputation), and the first call fails ("expected all
    tensors_saved_with_vc_check to be Tensors"); fixed in 2.15."""
    return (2, 13) <= torch_version() < (2, 15)


# -- DTensor's spec objects (private; the fields are unchanged 2.11-2.15) ---------------
_SPECS: dict = {}


def dtensor_spec(mesh, placements, shape, stride, dtype):
    """DTensor's spec of a global tensor; one shared (immutable) object per description."""
    placements = placements if isinstance(placements, tuple) else tuple(placements)
    key = (id(mesh), placements, tuple(shape), tuple(stride), dtype)
    spec = _SPECS.get(key)
    if spec is None or spec.mesh is not mesh:  # this mesh object (an equal one is not it:
        # torch.compile tells meshes apart by identity)
        import torch
        from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

        meta = TensorMeta(torch.Size(shape), tuple(stride), dtype)
        spec = DTensorSpec(mesh, placements, tensor_meta=meta)
        if len(_SPECS) > 8192:
            _SPECS.clear()
        _SPECS[key] = spec
    return spec


def new_dtensor(cls, local, spec, requires_grad: bool = False):
    """``cls(local, spec, requires_grad=...)`` without ``DTensor.__init__`` (a
    dynamo-disabled Python no-op costing ~1 µs): torch's C++ constructor, 2.11-2.15,
    which sets ``_spec`` and ``_local_tensor`` itself. ``local`` must not require grad."""
    return (_NEW or dtensor_constructor())[0](cls, local, spec, requires_grad=requires_grad)


def dtensor_constructor() -> list:
    """``[f]``: what :func:`new_dtensor` calls, ``f(cls, local, spec, requires_grad=...)``
    (for the hottest callers, without new_dtensor's frame)."""
    if not _NEW:
        import torch

        _NEW.append(getattr(torch.Tensor, "_dtensor__new__", _new_fallback))
    return _NEW


def _new_fallback(cls, local, spec, requires_grad):
    return cls(local, spec, requires_grad=requires_grad)


_NEW: list = []


def strided_shard_parts(placement) -> tuple[int, int] | None:
    """``(dim, split_factor)`` of DTensor's ``_StridedShard`` (private), else None.
    2.11-2.14: a Python class; 2.15: a C++ class with the same ``dim``/``split_factor``."""
    from torch.distributed.tensor import placement_types

    cls = getattr(placement_types, "_StridedShard", None)
    if cls is not None and isinstance(placement, cls):
        return int(placement.dim), int(placement.split_factor)
    return None


# -- the dispatch of DTensor subclasses ------------------------------------------------
# 2.11: the C++ fast path (python_arg_parser.cpp ``is_dtensor``) takes every instance of a
# DTensor subclass to DTensor's own dispatch, even when the subclass overrides
# ``__torch_dispatch__``; results come back as plain DTensors. What it consults first is
# torch's per-(op, class) rule registry (``torch._library.simple_registry``), so there
# shardlab registers its dispatch as the rule of every operator for ShardTensor.
# 2.12+: ``is_dtensor`` checks that ``__torch_dispatch__`` is DTensor's own, so the
# subclass's method is called and nothing needs registering.
def subclass_dispatch_is_bypassed() -> bool:
    return torch_version() <= (2, 11)


_REGISTERED: set[str] = set()


def route_dispatch(cls, rule) -> None:
    """Make ``rule(cls, func, types, args, kwargs)`` the dispatch of ``cls`` on 2.11; new
    operators (registered after the first call) are added on the next call."""
    if not subclass_dispatch_is_bypassed():
        return
    import torch
    from torch._library.simple_registry import singleton

    names = torch._C._dispatch_get_all_op_names()
    if len(names) == len(_REGISTERED):
        return
    for name in names:
        if name not in _REGISTERED:
            _REGISTERED.add(name)
            holder = singleton.find(name).torch_dispatch_rules
            if holder.find(cls) is None:
                holder.register(cls, rule)


# -- torch's decompositions (private table; same layout 2.11-2.15) ----------------------
# op -> the first torch version whose Python decomposition equals the op. Before it:
# ``multilabel_margin_loss_forward`` counted the labels after a row's first -1 too
# (``[[0.1, 0.2, 0.4, 0.8]]``, target ``[[3, 0, -1, 1]]``: 2.05 where the op gives 0.85).
WRONG_DECOMPOSITIONS = {"aten.multilabel_margin_loss_forward.default": (2, 15)}


def decomposition(func):
    """torch's decomposition of ``func`` into simpler aten ops, or None: the Python
    table (``torch._decomp``, private), else the op's own CompositeImplicitAutograd
    kernel (ops that are composite in one release and a kernel in another, such as
    ``expand_as`` in 2.15). None for the decompositions known to differ from the op
    (:data:`WRONG_DECOMPOSITIONS`): the whole-tensor fallback runs the op itself."""
    import torch
    from torch._decomp import decomposition_table

    wrong_before = WRONG_DECOMPOSITIONS.get(str(func))
    if wrong_before is not None and torch_version() < wrong_before:
        return None
    found = decomposition_table.get(func)
    if found is not None:
        return found
    if torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd"):
        return func.decompose
    return None


# -- leaving ---------------------------------------------------------------------------
# ``destroy_process_group`` unregisters the groups, but every DeviceMesh keeps its own
# (``_pg_registry``, private, 2.11-2.15): while one is alive, so is each group's C++
# object with its gloo worker threads. They would then be torn down during interpreter
# finalization, where a worker thread that drops the last reference to a tensor owned by
# Python aborts the process ("terminate called without an active exception").
def release_process_groups() -> None:
    """After ``destroy_process_group``: drop the groups the live meshes still hold, so
    their worker threads are joined now, while the interpreter is whole."""
    import gc

    from torch.distributed.device_mesh import DeviceMesh

    for obj in gc.get_objects():
        if DeviceMesh in type(obj).__mro__:  # (isinstance would ask proxies' __class__)
            registry = getattr(obj, "_pg_registry", None)
            if isinstance(registry, dict):
                registry.clear()
    gc.collect()


# -- collectives ---------------------------------------------------------------------
# ``all_gather_into_tensor`` is deprecated in favour of ``all_gather_single`` where it
# exists (newer releases); both gather equal-sized tensors into one.
def all_gather_single(out, inp, group=None) -> None:
    import torch.distributed as dist

    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, inp, group=group)


COMPILED_AUTOGRAD = (
    "shardlab: compiled autograd (torch._dynamo.compiled_autograd, "
    "torch._dynamo.config.compiled_autograd=True) cannot trace a backward through "
    "ShardTensors; run this backward without it (within "
    "torch._dynamo.compiled_autograd._disable()): the backward of a "
    "torch.compile'd forward is compiled without it"
)


def compiled_autograd_on() -> bool:
    """Is torch's compiled autograd on (it traces whole backwards, on symbolic sizes)?
    Read from its module if imported: never imported here (not imported: not on)."""
    import sys

    ca = sys.modules.get("torch._dynamo.compiled_autograd")
    return bool(getattr(ca, "compiled_autograd_enabled", False))
