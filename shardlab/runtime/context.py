"""What a rank knows about itself: rank, world size, device, default mesh, namespace.

Inside code run by :class:`shardlab.Ranks` (``ranks.run(fn)`` or a ``%%ranks``
cell), and in a process started by ``torchrun``, :func:`this_rank` returns the
rank's :class:`RankContext`. It is set up once per process, when the process
group is created, and lives until the process ends.
"""

from __future__ import annotations

import atexit
import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from shardlab import _compat

__all__ = ["RankContext", "this_rank"]

_CONTEXT: RankContext | None = None  # one per process: this process *is* the rank


@dataclass
class RankContext:
    """One rank of a pool, as :func:`this_rank` returns it on that rank.

    Attributes:
        rank: this rank's number, ``0 … world_size - 1``.
        world_size: the number of ranks.
        local_rank: the rank's number on its machine (its GPU index with nccl).
        backend: ``"gloo"`` or ``"nccl"``.
        device: the ``torch.device`` the rank's tensors live on.
        mesh: a 1-D :class:`~torch.distributed.device_mesh.DeviceMesh` over all ranks.
        ns: the rank's namespace: ``%%ranks`` cells run in it, and values put there by
            :meth:`Ranks.push` / read by :meth:`Ranks.pull` persist across calls.
    """

    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: Any  # torch.device
    mesh: Any  # torch.distributed.device_mesh.DeviceMesh, 1-D over all ranks
    ns: dict = field(default_factory=dict)
    _meshes: dict = field(default_factory=dict, repr=False)

    def mesh_for(self, shape: tuple[int, ...], names: tuple[str, ...] | None = None) -> Any:
        """The :class:`~torch.distributed.device_mesh.DeviceMesh` of ``shape`` over all
        ranks (``names``: its ``mesh_dim_names``), made the first time every rank asks for
        it and the same object after that.

        Each mesh of several dims made with ``init_device_mesh`` creates a process group per
        dim (with gloo: sockets and threads polling them) that lives until the process
        ends. A cell or a loop that makes its 2-D mesh again each run piles them up; ask
        for it here instead. Every rank must call it (the first call is a collective)::

            mesh = shardlab.this_rank().mesh_for((2, 2), names=("dp", "sp"))
        """
        from torch.distributed.device_mesh import init_device_mesh

        shape = tuple(int(s) for s in shape)
        names = None if names is None else tuple(names)
        if shape == (self.world_size,) and names is None:
            return self.mesh
        key = (shape, names)
        if key not in self._meshes:
            self._meshes[key] = init_device_mesh(self.device.type, shape, mesh_dim_names=names)
        return self._meshes[key]

    def __repr__(self) -> str:
        return (
            f"RankContext(rank={self.rank}, world_size={self.world_size}, "
            f"backend={self.backend!r}, device={self.device})"
        )


def this_rank() -> RankContext:
    """The context of the rank this code runs on (:class:`RankContext`).

    Raises ``RuntimeError`` outside a rank (for example in the notebook kernel
    that owns a :class:`shardlab.Ranks` pool): run the code with ``ranks.run``
    or in a ``%%ranks`` cell. Communicates nothing.

    Example::

        def where():
            me = shardlab.this_rank()
            return me.rank, me.world_size, str(me.device), me.mesh.shape

        ranks.run(where)   # [(0, 4, 'cpu', (4,)), (1, 4, 'cpu', (4,)), ...]
    """
    if _CONTEXT is None:
        raise RuntimeError(
            "this_rank() is only available on a rank: run the code with ranks.run(fn) "
            "or in a %%ranks cell, or start the script with torchrun"
        )
    return _CONTEXT


def rank_device_type(backend: str, device: str | None) -> str:
    """The device type the ranks' tensors live on: ``device`` checked against the
    backend (``None``: nccl's ``"cuda"``, gloo's ``"cpu"``; ``"auto"``: ``"cuda"``
    where torch sees a GPU). Looks for GPUs without initialising CUDA."""
    import torch

    if device is None:
        return "cuda" if backend == "nccl" else "cpu"
    if device == "auto":
        return "cuda" if backend == "nccl" or torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise ValueError(f"Ranks(device={device!r}): supported are 'cpu', 'cuda' and 'auto'")
    if device == "cpu" and backend == "nccl":
        raise ValueError("Ranks(backend='nccl', device='cpu'): nccl needs CUDA; use gloo on CPU")
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            "Ranks(device='cuda'): torch sees no GPU here (torch.cuda.is_available() is "
            "False); use device='cpu' or 'auto'"
        )
    return device


def init_rank(
    rank: int,
    world_size: int,
    backend: str,
    timeout: float,
    store: Any = None,
    local_rank: int | None = None,
    device: str | None = None,
) -> RankContext:
    """Create the process group and the default 1-D mesh for this process.

    ``store`` is a c10d store (the pool passes a TCPStore client); ``None``
    uses the ``env://`` rendezvous of torchrun. ``timeout`` (seconds) bounds
    every collective, also on sub-groups created later (for 2-D meshes).
    ``device``: see :func:`rank_device_type`; on CUDA, rank r uses GPU
    ``local_rank % count`` (several gloo ranks may share one).
    """
    global _CONTEXT
    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    from torch.distributed.device_mesh import init_device_mesh

    local_rank = rank if local_rank is None else local_rank
    if rank_device_type(backend, device) == "cuda":
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    td = timedelta(seconds=timeout)
    # sub-groups (DeviceMesh dims of a 2-D mesh) read this default at creation
    c10d.default_pg_timeout = td
    if not dist.is_initialized():
        kwargs: dict[str, Any] = {"backend": backend, "timeout": td}
        if store is not None:
            kwargs.update(store=store, rank=rank, world_size=world_size)
        if backend == "nccl":
            kwargs["device_id"] = device
        dist.init_process_group(**kwargs)
        # gloo aborts the process at exit if its group is still alive
        atexit.register(_destroy_group)
    mesh = init_device_mesh(device.type, (world_size,))
    _CONTEXT = RankContext(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        backend=backend,
        device=device,
        mesh=mesh,
    )
    return _CONTEXT


_MESH_GROUPS: dict = {}  # DeviceMesh's sub-group arguments -> the group (a pool's rank)


def reuse_mesh_groups() -> None:
    """In a rank of a :class:`shardlab.Ranks` pool: a ``DeviceMesh`` whose dims group the
    same ranks as an earlier mesh's (the same shape, made again in each run of a cell)
    gets that mesh's process groups back instead of new ones. Each new gloo group holds
    sockets and threads that poll them until the process ends: 100 meshes of (2, 2) made
    605 threads per rank that burnt a fifth of a core each while idle. torch's own
    ``new_group`` is untouched; only the name ``torch.distributed.device_mesh`` calls is
    replaced, and the groups die with the rank (the pool's close or restart). A group
    someone destroyed is made anew."""
    import torch.distributed.device_mesh as device_mesh
    import torch.distributed.distributed_c10d as c10d

    made = device_mesh.new_group
    if getattr(made, "reuses_groups", False):
        return

    def new_group(*args, **kwargs):
        # (the description names the mesh dim: groups of the same ranks are shared)
        rest = tuple(sorted((k, v) for k, v in kwargs.items() if k != "group_desc"))
        key = (_key(args), _key(rest))
        hit = _MESH_GROUPS.get(key)
        if hit is not None and _alive(hit):
            return hit
        if _whole_world(args, kwargs):  # every rank, torch's defaults: the default group
            return c10d._get_default_group()
        group = made(*args, **kwargs)
        _MESH_GROUPS[key] = group
        return group

    new_group.reuses_groups = True  # type: ignore[attr-defined]
    device_mesh.new_group = new_group


def _whole_world(args, kwargs) -> bool:
    import torch.distributed as dist

    ranks = args[0] if args else kwargs.get("ranks")
    defaults = all(
        kwargs.get(k) is None for k in ("timeout", "backend", "pg_options")
    ) and not kwargs.get("use_local_synchronization", False)
    return len(args) <= 1 and defaults and list(ranks or ()) == list(range(dist.get_world_size()))


def _key(value):
    """``value`` as a dict key: lists as tuples, other unhashable objects by identity."""
    if isinstance(value, (list, tuple)):
        return tuple(_key(v) for v in value)
    try:
        hash(value)
    except TypeError:
        return ("id", id(value))
    return value


def _alive(group) -> bool:
    import torch.distributed.distributed_c10d as c10d

    return group is c10d.GroupMember.NON_GROUP_MEMBER or group in c10d._world.pg_map


def _destroy_group() -> None:
    """At exit: leave together, then destroy the groups and join their threads (else
    gloo may abort during interpreter finalization)."""
    global _CONTEXT
    import torch.distributed as dist

    if dist.is_initialized():
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()
            _CONTEXT = None
            _compat.release_process_groups()


def env_rank() -> tuple[int, int, int] | None:
    """(rank, world_size, local_rank) when torchrun/srun started this process."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        rank = int(os.environ["RANK"])
        return rank, int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", rank))
    return None
