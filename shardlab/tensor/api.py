"""ShardTensor: a DTensor that knows the exact size of every rank's shard.

::

    global (18, 3), mesh (4,), Shard(0) sizes [5, 5, 4, 4]

      rows 0-4   rows 5-9   rows 10-13  rows 14-17
      rank 0     rank 1     rank 2      rank 3        local (5, 3) (5, 3) (4, 3) (4, 3)

DTensor assumes ``torch.chunk`` sizes ([5, 5, 5, 3] here) and silently gets
``full_tensor()`` and ``mean()`` wrong for any other sizes. A ShardTensor carries
a :class:`~shardlab.layout.ShardLayout` and does its own collectives, so any
sizes (including empty shards) are right. Everything is differentiable.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from shardlab import _compat
from shardlab.layout import ShardLayout
from shardlab.tensor import comm, recompute, submesh, traced
from shardlab.tensor.losses import LOSSES, reduce_loss
from shardlab.tensor.recompute import fenced

__all__ = ["ShardTensor", "scatter_tensor", "distribute"]


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(stride))


def stride_like(template: Sequence[int], shape: Sequence[int]) -> tuple[int, ...]:
    """Dense strides for ``shape`` in the dim order of the strides ``template`` (a global
    tensor's, the same on every rank): how torch lays out the result of an op that
    follows its input's layout (SDPA's output follows the query's)."""
    if len(template) != len(shape):
        return _contiguous_stride(shape)
    order = sorted(range(len(shape)), key=lambda d: (-template[d], d))  # outer -> inner
    stride, acc = [0] * len(shape), 1
    for d in reversed(order):
        stride[d] = acc
        acc *= max(shape[d], 1)
    return tuple(stride)


def _grad_layout(layout: ShardLayout) -> ShardLayout:
    """Gradients of a Partial value are Replicate (d sum / d part = 1 on every rank)."""
    places = tuple(Replicate() if isinstance(p, Partial) else p for p in layout.placements)
    return layout.replace(placements=places)


class ShardTensor(DTensor):
    """A :class:`~torch.distributed.tensor.DTensor` with exact per-rank shard sizes.

    Build one with :meth:`from_local`, :func:`shardlab.scatter_tensor` or
    :func:`shardlab.distribute`; leave with :meth:`full_tensor`,
    :meth:`to_local` or :meth:`redistribute`. ``sharding`` holds the sizes.

    Example::

        def body():
            mesh = shardlab.this_rank().mesh                   # 1-D, 4 ranks
            x = torch.arange(36.0).reshape(18, 2)
            st = shardlab.distribute(x, mesh, [Shard(0)], sizes=[[5, 5, 4, 4]])
            st.to_local().shape                                # (5, 2) on rank 0, (4, 2) on 3
            st.mean().full_tensor()                            # 17.5, as on one device
            return st.redistribute(mesh, [Shard(1)]).to_local().shape
    """

    _layout: ShardLayout

    @staticmethod
    def _wrap(
        local: torch.Tensor, mesh, layout: ShardLayout, requires_grad=False, stride=None
    ) -> ShardTensor:
        """The ShardTensor holding ``local``. Its global ``stride`` (contiguous by default)
        must be the same on every rank: composite ops branch on it."""
        spec = _compat.dtensor_spec(
            mesh,
            layout.placements,
            layout.global_shape,
            _contiguous_stride(layout.global_shape) if stride is None else tuple(stride),
            local.dtype,
        )
        out = _compat.new_dtensor(ShardTensor, local.detach(), spec, requires_grad)
        out._layout = layout
        return out

    def _set_layout(self, layout: ShardLayout) -> None:
        """Change the layout of this tensor in place (same local shape): an in-place op
        that had to reduce a Partial value."""
        self._layout = layout
        self._spec = _compat.dtensor_spec(
            self.device_mesh, layout.placements, layout.global_shape, self.stride(), self.dtype
        )

    # -- torch.compile (shardlab.tensor.traced): torch's DTensor format --------
    def __tensor_flatten__(self):
        traced.prepare()  # dynamo (or AOTAutograd) is looking at a ShardTensor
        return DTensor.__tensor_flatten__(self)

    @staticmethod
    def __tensor_unflatten__(inner_tensors, flatten_spec, outer_size, outer_stride):
        d = DTensor.__tensor_unflatten__(inner_tensors, flatten_spec, outer_size, outer_stride)
        out = ShardTensor(d._local_tensor, d._spec, requires_grad=d.requires_grad)
        out._layout = None  # a traced stand-in: its ops run eagerly on the real tensor
        return out

    # -- torch.distributed.checkpoint: the real boxes (shardlab.tensor.checkpoint) ----
    def __create_write_items__(self, fqn: str, object):
        from shardlab.tensor import checkpoint

        return checkpoint.create_write_items(self, fqn)

    def __create_chunk_list__(self):
        from shardlab.tensor import checkpoint

        return checkpoint.create_chunk_list(self)

    def __get_tensor_shard__(self, index):
        from shardlab.tensor import checkpoint

        return checkpoint.get_tensor_shard(self, index)

    # -- what it is --------------------------------------------------------
    @property
    @traced.eager
    def sharding(self) -> ShardLayout:
        """Who holds what, as a :class:`~shardlab.layout.ShardLayout` (placements and the
        exact size of every piece). ``x.layout`` stays torch's (``torch.strided``)."""
        return self._layout

    @traced.eager
    def __repr__(self) -> str:
        lay = self._layout
        if lay is None:
            return f"ShardTensor(tracing stand-in, global {tuple(self.shape)}, {self.dtype})"
        from shardlab.layout import format_sizes

        places = ", ".join(
            format_sizes(p, lay.sizes_along(p.dim) if isinstance(p, Shard) else None, m)
            for m, p in enumerate(lay.placements)
        )
        coord = self.device_mesh.get_coordinate()
        where = f"rank {dist.get_rank()}" if dist.is_initialized() else "here"
        grad = ", requires_grad=True" if self.requires_grad else ""
        return (
            f"ShardTensor(global {tuple(lay.global_shape)}, "
            f"{str(self.dtype).replace('torch.', '')}, "
            f"mesh {tuple(lay.mesh_shape)}, [{places}], "
            f"local {tuple(self._local_tensor.shape)} on {where} at {tuple(coord or ())}{grad})"
        )

    __str__ = __repr__

    # -- constructors ------------------------------------------------------
    @staticmethod
    @traced.eager
    def from_local(
        local_tensor: torch.Tensor,
        device_mesh=None,
        placements: Sequence | None = None,
        sizes: Sequence | None = None,
        *,
        shape: Sequence[int] | None = None,
        stride: Sequence[int] | None = None,
        validate: bool = True,
    ) -> ShardTensor:
        """Wrap each rank's ``local_tensor`` as the pieces of one global tensor.

        Collectives: one small all-gather of every rank's (ndim, dtype, local shape).
        ``sizes=None`` infers the sizes from it, so any sizes work; explicit ``sizes``
        (as in :meth:`ShardLayout.build`) are checked against every rank's shape. Either
        way a disagreement (shapes, number of dims, dtypes) raises the same ValueError
        on every rank. ``validate=False`` (explicit ``sizes`` only) skips the all-gather
        and checks this rank's own shape only: for callers that know the sizes agree.
        ``stride``: the global strides (default contiguous), the same on every rank.

        Example::

            me = shardlab.this_rank()
            local = torch.randn(3 + me.rank, 8)                    # 3, 4, 5, 6 rows
            st = ShardTensor.from_local(local, me.mesh, [Shard(0)])
            st.shape                                               # (18, 8)
        """
        mesh = _mesh(device_mesh)
        placements = _placements(placements, mesh)
        _check_device(local_tensor, mesh, "local_tensor")
        if sizes is None or validate:
            shapes = _gather_shapes(local_tensor, mesh)
        if sizes is None:
            layout = ShardLayout.from_local_shapes(shape, tuple(mesh.shape), placements, shapes)
        else:
            if shape is None:
                shape = _global_shape_from_local(local_tensor.shape, placements, sizes, mesh)
            layout = ShardLayout.build(shape, tuple(mesh.shape), placements, sizes)
            coords = layout.coords() if validate else [comm.my_coord(mesh)]
            for coord in coords:
                have = shapes[coord] if validate else tuple(local_tensor.shape)
                want = layout.local_shape(coord)
                if tuple(have) != want:
                    raise ValueError(
                        f"from_local: local_tensor has shape {tuple(have)} on the rank at "
                        f"mesh coordinate {coord}, but {layout} gives that rank {want}"
                    )
        return _FromLocal.apply(local_tensor, mesh, layout, stride)

    # -- leaving -----------------------------------------------------------
    @traced.eager
    def to_local(self, *, grad_placements=None) -> torch.Tensor:
        """This rank's block (differentiable).

        ``grad_placements`` says what the gradient of the block means, as in
        DTensor: e.g. ``[Partial()]`` for a replicated weight used on local
        rows, whose per-rank gradients must be summed.

        Example::

            st.to_local()                                          # rank 2: its (4, 2) block
        """
        if getattr(self, "_whole_to_local", False) and grad_placements is None:
            return self  # after a sub-mesh redistribute (a torch TP hook), see there
        grad_layout = self._layout
        if grad_placements is not None:
            places = _placements(grad_placements, self.device_mesh)
            for p, q in zip(places, self._layout.placements):
                if (isinstance(p, Shard) or isinstance(q, Shard)) and p != q:
                    raise ValueError(
                        "grad_placements may only change Replicate/Partial, got "
                        f"{list(places)} for {list(self._layout.placements)}"
                    )
            grad_layout = self._layout.replace(placements=tuple(places))
        return _ToLocal.apply(self, grad_layout)

    @traced.eager
    def redistribute(
        self, device_mesh=None, placements=None, *, sizes=None, async_op: bool = False, **_
    ) -> ShardTensor:
        """The same global tensor with new ``placements`` and ``sizes`` (default chunk).

        Collectives: an all-reduce per Partial mesh dim that is resolved, then
        point-to-point messages carrying exactly the boxes that change owner.

        Example::

            cols = st.redistribute(mesh, [Shard(1)])               # rows -> columns
            whole = st.redistribute(mesh, [Replicate()])           # an all-gather of the rows
        """
        mesh = self.device_mesh
        sub = device_mesh if device_mesh is not None and device_mesh != mesh else None
        if sub is None and placements is not None and len(tuple(placements)) < mesh.ndim:
            sub = submesh.hook_sub_mesh(mesh)  # torch's TP hooks: placements of mesh["tp"]
        if sub is not None:
            return self._redistribute_on(sub, placements, sizes)
        placements = _placements(placements, mesh)
        dst = ShardLayout.build(
            self._layout.global_shape, self._layout.mesh_shape, placements, sizes
        )
        return _Redistribute.apply(self, dst)

    def _redistribute_on(self, sub, placements, sizes) -> ShardTensor:
        """Redistribute over the mesh dims of sub-mesh ``sub`` only; the other mesh dims
        keep their placements and sizes. The result's ``to_local()`` returns it whole: a
        torch TP hook (``to_local()`` after its own redistribute) keeps the other dims
        sharded, and the model code sees global shapes, as on one device."""
        mesh = self.device_mesh
        dims = submesh.sub_mesh_dims(sub, mesh)
        if dims is None:
            raise ValueError(
                f"redistribute: device_mesh must be the tensor's own mesh {mesh} or a "
                f"sub-mesh of it (named dims of the same ranks), got {sub}"
            )
        places = list(self._layout.placements)
        new = _placements(placements, sub)
        want = build_sizes(self._layout.sizes)
        for i, d in enumerate(dims):
            places[d] = new[i]
            want[d] = None if sizes is None else sizes[i]
        dst = ShardLayout.build(self._layout.global_shape, self._layout.mesh_shape, places, want)
        out = _Redistribute.apply(self, dst)
        out._whole_to_local = True
        return out

    @traced.eager
    def full_tensor(self, *, grad_placements=None) -> torch.Tensor:
        """The whole global tensor on every rank (differentiable).

        Its gradient is taken as the same on every rank (Replicate); pass
        ``grad_placements=[Partial()]`` when each rank's gradient is a part of it.

        Example::

            st.full_tensor().shape                                 # the global shape, every rank
        """
        replicate = [Replicate()] * self.device_mesh.ndim
        return self.redistribute(self.device_mesh, replicate).to_local(
            grad_placements=grad_placements
        )

    @classmethod
    @traced.entry
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if traced.tracing() is not None:  # under torch.compile: eagerly, a graph break
            return _EAGER_TF[0](cls, func, types, args, kwargs)
        if func not in _OWN_CALLS and (not kwargs or _scalar_kwargs(kwargs)):
            # the common case in one pass: ShardTensors of one mesh (no stand-in) and
            # scalars; nothing to lift, nothing of ours above aten
            mesh = _one_mesh(args)
            if mesh is not None and mesh is not _MIXED:
                return _disabled_torch_function(func, types, args, kwargs or _NO_KWARGS)
        traced.check(func, args, kwargs)  # dynamo's stand-ins: a graph break
        kwargs = kwargs or {}
        if func is torch.Tensor.backward or func is torch.autograd.backward:
            run = recompute.tensor_backward if func is torch.Tensor.backward else recompute.backward
            return run(*args, **kwargs)  # with __torch_function__ on (recomputation)
        args, kwargs = _lift_trainable(args, kwargs)
        if func in LOSSES or func is torch.nn.functional.cross_entropy:  # exact means
            from shardlab.ops.registry import device_type
            from shardlab.tensor.autocast import autocast_call

            def loss(*a, **k):
                return reduce_loss(func, a, k)

            out = autocast_call(func.__name__, func, loss, args, kwargs, device_type(args, kwargs))
            if out is not NotImplemented:
                return out
        if func is torch.Tensor.unfold and isinstance(args[0], ShardTensor):  # halo windows
            from shardlab.ops.unfold import tensor_unfold

            out = tensor_unfold(*args, **kwargs)
            if out is not NotImplemented:
                return out
        return torch._C._disabled_torch_function_impl(func, types, args, kwargs)

    @classmethod
    @traced.entry
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if traced.tracing() is not None:  # under torch.compile: eagerly, a graph break
            return _EAGER_TD[0](cls, func, types, args, kwargs)
        return (_DISPATCH or _dispatch())[0](func, args, kwargs or {})  # checks stand-ins


# the two entry points again, as traced.eager makes them for a call under dynamo
_EAGER_TF = [traced.eager(ShardTensor.__torch_function__.__func__)]
_EAGER_TD = [traced.eager(ShardTensor.__torch_dispatch__.__func__)]


def from_layout(local: torch.Tensor, mesh, layout: ShardLayout, stride=None) -> ShardTensor:
    """This rank's block ``local`` as a ShardTensor of any ``layout`` (strided dims too),
    differentiably: the sharded ops build their results with it."""
    want = layout.local_shape(comm.my_coord(mesh))
    if tuple(local.shape) != want:
        raise RuntimeError(
            f"shardlab internal error: a local block of shape {tuple(local.shape)} does not fit "
            f"{layout} (this rank needs {want}); please report it"
        )
    return _FromLocal.apply(local, mesh, layout, stride)


def _dispatch_rule(cls, func, types, args=(), kwargs=None):
    """torch 2.11 routes ShardTensor ops here (see ``_compat.route_dispatch``)."""
    return (_DISPATCH or _dispatch())[0](func, args, kwargs or {})


_DISPATCH: list = []


def _dispatch() -> list:
    """``[shardlab.tensor.dispatch.dispatch]`` (imported on first use: it imports us)."""
    from shardlab.tensor.dispatch import dispatch

    _DISPATCH[:] = [dispatch]
    return _DISPATCH


_compat.route_dispatch(ShardTensor, _dispatch_rule)


_SCALARS = (bool, int, float, complex, str, type(None), torch.dtype, torch.device)
_NO_KWARGS: dict = {}


def _one_mesh(args, mesh=None):
    """The mesh when ``args`` are ShardTensors of one mesh (no traced stand-in), scalars
    and lists or tuples of those (cat's, a view's sizes); None when there is no
    ShardTensor; :data:`_MIXED` when anything else is there."""
    for a in args:
        t = type(a)
        if t is ShardTensor:
            if a._layout is None or (mesh is not None and a._spec.mesh is not mesh):
                return _MIXED
            mesh = a._spec.mesh
        elif t is list or t is tuple:
            mesh = _one_mesh(a, mesh)
            if mesh is _MIXED:
                return _MIXED
        elif t not in _SCALARS:
            return _MIXED
    return mesh


def _scalar_kwargs(kwargs) -> bool:
    """Only scalars among the keyword arguments (``scale=``, ``dim=``, ``dtype=`` …)."""
    for v in kwargs.values():
        if type(v) not in _SCALARS:
            return False
    return True


_MIXED = object()
_disabled_torch_function = torch._C._disabled_torch_function_impl
# what ShardTensor.__torch_function__ does itself rather than pass on to aten
_OWN_CALLS = frozenset(
    [torch.Tensor.backward, torch.autograd.backward, torch.Tensor.unfold,
     torch.nn.functional.cross_entropy, *LOSSES]
)  # fmt: skip


def _lift_trainable(args, kwargs):
    """Plain tensors that require grad (parameters) next to a ShardTensor become
    replicated ShardTensors *differentiably*, so their ``.grad`` is a plain tensor
    holding the full gradient (summed over ranks), as on one device. DTensors on a
    sub-mesh (torch TP weights on ``mesh["tp"]``) are read on the whole mesh, and their
    gradients go back to the sub-mesh (:mod:`shardlab.tensor.submesh`)."""
    mesh, trained = None, []
    for i, a in enumerate(args):  # the common case, flat: ShardTensors of one mesh,
        t = type(a)  # scalars, plain tensors (the trainable ones lifted): one pass
        if t is ShardTensor and a._layout is not None:
            if mesh is None:
                mesh = a._spec.mesh
            elif a._spec.mesh is not mesh:
                break
        elif t is torch.Tensor or t is torch.nn.Parameter:
            if a.requires_grad and a.ndim > 0:
                trained.append(i)
        elif t not in _SCALARS:
            break
    else:
        if not kwargs and mesh is not None:
            if not trained:
                return args, kwargs
            args = list(args)
            for i in trained:
                args[i] = _replicated(args[i], mesh)
            return tuple(args), kwargs
    from torch.utils._pytree import SUPPORTED_NODES, tree_leaves, tree_map

    from shardlab.tensor.aten._common import tree_leaves as simple_leaves
    from shardlab.tensor.aten._common import tree_map as simple_map

    leaves = simple_leaves((args, kwargs))  # lists, tuples, dicts: the common case, fast
    mapped = simple_map
    if any(type(a) in SUPPORTED_NODES for a in leaves):
        leaves = tree_leaves((args, kwargs))  # other containers pytree opens (ModelOutput …)
        mapped = tree_map
    shards = [a for a in leaves if isinstance(a, ShardTensor)]
    if not shards:  # the ShardTensor sits in a container pytree does not open
        return args, kwargs
    mesh = max((a.device_mesh for a in shards), key=lambda m: m.ndim)
    plain = any(
        isinstance(a, torch.Tensor) and not isinstance(a, DTensor) and a.requires_grad
        for a in leaves
    )
    sub = any(isinstance(a, DTensor) and a.device_mesh != mesh for a in leaves)
    if not plain and not sub:
        return args, kwargs

    def lift(a):
        if isinstance(a, DTensor):
            return submesh.embed(a, mesh) if sub else a
        if isinstance(a, torch.Tensor) and a.requires_grad and a.ndim > 0:
            return _replicated(a, mesh)
        return a

    return mapped(lift, args), mapped(lift, kwargs)


_REPLICATED: dict = {}  # (mesh id, shape) -> (mesh, the Replicate layout)


def _replicated(tensor: torch.Tensor, mesh) -> ShardTensor:
    """A plain tensor every rank holds alike (a parameter) as a Replicate ShardTensor, a
    view of it (nothing copied), differentiably: its ``.grad`` is the full gradient,
    summed over the ranks (:func:`distribute`'s, without its checks or its copy)."""
    _check_device(tensor, mesh, "tensor")
    key = (id(mesh), tuple(tensor.shape))
    hit = _REPLICATED.get(key)
    if hit is None or hit[0] is not mesh:
        layout = ShardLayout.build(
            key[1], tuple(mesh.shape), [Replicate()] * mesh.ndim
        )  # fmt: skip
        if len(_REPLICATED) >= 512:
            del _REPLICATED[next(iter(_REPLICATED))]
        _REPLICATED[key] = hit = (mesh, layout)
    return _Lift.apply(tensor, mesh, hit[1])


@fenced
class _Lift(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, mesh, layout):
        ctx.mesh, ctx.sharding = mesh, layout
        return ShardTensor._wrap(tensor.view_as(tensor), mesh, layout, stride=tensor.stride())

    @staticmethod
    def backward(ctx, grad):
        return _local_of(grad, ctx.sharding, ctx.mesh), None, None


# -- autograd ---------------------------------------------------------------
@fenced
class _FromLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local, mesh, layout, stride):
        ctx.mesh, ctx.sharding = mesh, layout
        return ShardTensor._wrap(local.view_as(local), mesh, layout, stride=stride)

    @staticmethod
    def backward(ctx, grad):
        return _local_of(grad, _grad_layout(ctx.sharding), ctx.mesh), None, None, None


class _ToLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, st, grad_layout):
        ctx.mesh, ctx.sharding = st.device_mesh, grad_layout
        return st._local_tensor.view_as(st._local_tensor)

    @staticmethod
    def backward(ctx, grad):
        return ShardTensor._wrap(grad, ctx.mesh, ctx.sharding), None


@fenced
class _Redistribute(torch.autograd.Function):
    """``_Redistribute.apply(st, layout, cause="redistribute")``: differentiable; ``cause``
    labels the messages (its backward's: "redistribute backward")."""

    @staticmethod
    def forward(ctx, st, dst, cause="redistribute"):
        ctx.mesh, ctx.src = st.device_mesh, st._layout
        local = comm.redistribute_local(st._local_tensor, st._layout, dst, st.device_mesh, cause)
        return ShardTensor._wrap(local, st.device_mesh, dst)

    @staticmethod
    def backward(ctx, grad):
        target = _grad_layout(ctx.src)
        return ShardTensor._wrap(_local_of(grad, target, ctx.mesh), ctx.mesh, target), None, None


def _local_of(grad, layout: ShardLayout, mesh) -> torch.Tensor:
    """This rank's block of ``grad`` in ``layout`` (redistributing if needed)."""
    if isinstance(grad, ShardTensor):
        return comm.redistribute_local(
            grad._local_tensor, grad._layout, layout, mesh, cause="redistribute backward"
        )
    if isinstance(grad, DTensor):  # e.g. from DTensor's own ops: chunk sizes
        from shardlab.tensor.aten._common import layout_of_dtensor

        return comm.redistribute_local(
            grad._local_tensor,
            layout_of_dtensor(grad),
            layout,
            mesh,
            cause="redistribute backward",
        )
    return grad


# -- helpers ----------------------------------------------------------------
def build_sizes(sizes) -> list:
    """Canonical ``ShardLayout.sizes`` in the form ``from_local`` / ``build`` take."""
    return [
        None if e is None else list(e[0]) if len(e) == 1 else [list(s) for s in e] for e in sizes
    ]


def _mesh(mesh):
    if mesh is None:
        from shardlab.runtime import this_rank

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
    from shardlab.trace import label

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


@traced.eager
def scatter_tensor(tensor, src: int, device_mesh, placements, sizes=None) -> ShardTensor:
    """Split ``tensor``, which lives on global rank ``src`` only, over the mesh.

    Every other rank passes anything (``None``) and receives only its own block:
    one broadcast of the shape and dtype, then one message per receiving rank.
    Differentiable: the gradient is gathered back to ``src``.

    Args:
        tensor: the global tensor on rank ``src``; ignored elsewhere.
        src: the global rank that holds it.
        device_mesh, placements, sizes: as in :func:`shardlab.distribute`.

    Example::

        me = shardlab.this_rank()
        x = torch.arange(54.0).reshape(18, 3) if me.rank == 0 else None
        st = shardlab.scatter_tensor(x, 0, me.mesh, [Shard(0)], sizes=[[6, 4, 4, 4]])
        # rank 0 sent 3 messages; rank 1 received 4 x 3 x 4 = 48 bytes
    """
    mesh = _mesh(device_mesh)
    placements = _placements(placements, mesh)
    me = dist.get_rank()
    if me == src:
        _check_device(tensor, mesh, "tensor")
        meta = [tuple(tensor.shape), tensor.dtype, tensor.requires_grad]
    else:
        meta = [None, None, None]
    from shardlab.trace import label

    with label("scatter_tensor.meta"):
        _broadcast_in_mesh(meta, src, mesh)
    shape, dtype, requires_grad = meta
    layout = ShardLayout.build(shape, tuple(mesh.shape), placements, sizes)
    if me != src:
        tensor = torch.empty(0, dtype=dtype, device=mesh.device_type, requires_grad=requires_grad)
    return _Scatter.apply(tensor, src, mesh, layout)


def _broadcast_in_mesh(objects: list, src: int, mesh) -> None:
    """``broadcast_object_list`` from global rank ``src`` to the ranks of ``mesh`` only, along
    its groups: last mesh dim first (src's row), then each earlier dim (every column)::

        step dim 1: (r0, c0) -> (r0, *)        step dim 0: (r0, c) -> (*, c) for every c
    """
    grid = mesh.mesh
    if src not in grid.flatten().tolist():
        raise ValueError(f"src={src} is not a rank of the mesh {grid.tolist()}")
    at = tuple(int(i) for i in (grid == src).nonzero()[0])  # src's coordinate
    me = comm.my_coord(mesh)
    for m in reversed(range(mesh.ndim)):
        if me[:m] != at[:m]:
            continue  # not on this step's lines through src: gets it at an earlier dim
        root = comm.rank_at(mesh, at[: m + 1] + tuple(me[m + 1 :]))
        dist.broadcast_object_list(objects, src=root, group=mesh.get_group(m))


@fenced
class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, src, mesh, layout):
        ctx.src, ctx.mesh, ctx.sharding = src, mesh, layout
        ctx.shape, ctx.is_src = tensor.shape, dist.get_rank() == src
        from shardlab.trace import label

        with label("scatter_tensor"):
            local = _scatter_blocks(tensor, src, mesh, layout)
        return ShardTensor._wrap(local, mesh, layout)

    @staticmethod
    def backward(ctx, grad):
        from shardlab.trace import label

        local = _local_of(grad, _grad_layout(ctx.sharding), ctx.mesh)
        with label("scatter_tensor backward"):
            full = _gather_blocks(local, ctx.src, ctx.mesh, ctx.sharding)
        return (
            (
                full
                if ctx.is_src
                else torch.zeros(ctx.shape, dtype=local.dtype, device=local.device)
            ),
            None,
            None,
            None,
        )


def _scatter_blocks(tensor, src, mesh, layout):
    me = dist.get_rank()
    ops, mine = [], None
    for coord in layout.coords():
        r = comm.rank_at(mesh, coord)
        box = tuple(slice(a, b) for a, b in layout.local_box(coord))
        if me == src and r == me:
            mine = tensor.detach()[box].clone()
        elif me == src and layout.numel(coord):
            ops.append(dist.P2POp(dist.isend, tensor.detach()[box].contiguous(), r))
        elif r == me:
            mine = torch.empty(layout.local_shape(coord), dtype=tensor.dtype, device=tensor.device)
            if layout.numel(coord):
                ops.append(dist.P2POp(dist.irecv, mine, src))
    comm.run_p2p(ops)
    return mine


def _gather_blocks(local, src, mesh, layout):
    """Inverse of _scatter_blocks: every block to ``src`` (replicas: coordinate 0 sends)."""
    me = dist.get_rank()
    full = (
        torch.zeros(layout.global_shape, dtype=local.dtype, device=local.device)
        if me == src
        else None
    )
    ops, bufs = [], []
    for coord in layout.coords():
        if any(c and not isinstance(p, Shard) for c, p in zip(coord, layout.placements)):
            continue  # one copy of each block is enough
        r = comm.rank_at(mesh, coord)
        box = tuple(slice(a, b) for a, b in layout.local_box(coord))
        if r == src and me == src:
            full[box] = local
        elif me == src and layout.numel(coord):
            buf = local.new_empty(layout.local_shape(coord))
            ops.append(dist.P2POp(dist.irecv, buf, r))
            bufs.append((box, buf))
        elif r == me and layout.numel(coord):
            ops.append(dist.P2POp(dist.isend, local.contiguous(), src))
    comm.run_p2p(ops)
    for box, buf in bufs:
        full[box] = buf
    return full


@traced.eager
def distribute(tensor: torch.Tensor, device_mesh, placements, sizes=None) -> ShardTensor:
    """Every rank holds the same global ``tensor``: keep each rank's block (no communication).

    Differentiable: the gradient of ``tensor`` is the full gradient on every rank
    (one redistribute to Replicate in backward).

    Args:
        tensor: the global tensor, the same on every rank.
        device_mesh: the DeviceMesh (1-D or 2-D).
        placements: one ``Shard(d)`` / ``Replicate()`` / ``Partial()`` per mesh dim.
        sizes: per mesh dim, the size of every piece (``[[5, 5, 4, 4]]``), or None for
            ``torch.chunk``'s sizes (see ``ShardLayout.build``).

    Example::

        st = shardlab.distribute(img, mesh, [Shard(2)], sizes=[[30, 34, 32, 32]])
    """
    mesh = _mesh(device_mesh)
    placements = _placements(placements, mesh)
    _check_device(tensor, mesh, "tensor")
    layout = ShardLayout.build(tuple(tensor.shape), tuple(mesh.shape), placements, sizes)
    return _Distribute.apply(tensor, mesh, layout)


@fenced
class _Distribute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, mesh, layout):
        ctx.mesh, ctx.sharding = mesh, layout
        coord = comm.my_coord(mesh)
        box = tuple(slice(a, b) for a, b in layout.local_box(coord))
        local = tensor[box].clone()
        for m, p in enumerate(layout.placements):
            if isinstance(p, Partial) and coord[m] != 0:
                local.zero_()
        return ShardTensor._wrap(local, mesh, layout)

    @staticmethod
    def backward(ctx, grad):
        replicate = ShardLayout.build(
            ctx.sharding.global_shape,
            ctx.sharding.mesh_shape,
            [Replicate()] * len(ctx.sharding.mesh_shape),
        )
        return _local_of(grad, replicate, ctx.mesh), None, None
