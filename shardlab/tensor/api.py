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
from shardlab.comm import graphs, p2p, traced
from shardlab.layout import ShardLayout, format_sizes
from shardlab.layout.strides import contiguous_stride
from shardlab.tensor import (
    checkpoint,
    compiled_grads,
    dtensors,
    entry,
    functions,
    submesh,
)
from shardlab.tensor._checks import (
    _check_device,
    _gather_shapes,
    _global_shape_from_local,
    _mesh,
    _placements,
    build_sizes,
)

__all__ = ["ShardTensor"]


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
    # torch.compile: a ShardTensor's global shape is part of its layout, never symbolic
    _dynamo_static_indices = range(64)

    @staticmethod
    def _wrap(
        local: torch.Tensor, mesh, layout: ShardLayout, requires_grad=False, stride=None
    ) -> ShardTensor:
        """The ShardTensor holding ``local``. Its global ``stride`` (contiguous by default)
        must be the same on every rank: composite ops branch on it."""
        spec = _compat.dtensor_spec(
            mesh,
            traced.placements(layout),
            layout.global_shape,
            contiguous_stride(layout.global_shape) if stride is None else tuple(stride),
            local.dtype,
        )
        out = _compat.new_dtensor(ShardTensor, local.detach(), spec, requires_grad)
        out._layout = layout
        return out

    @property
    def placements(self) -> tuple:
        """One placement per mesh dim, as DTensor gives them.

        A plain tuple, since the spec's own placements also hold the layout
        (``traced.Placements``), which makes them unequal for other shard sizes."""
        return tuple(self._spec.placements)

    # -- pickling (torch.save, copy.deepcopy) -----------------------------------
    def __getstate__(self):
        """What ``torch.save`` keeps besides the block: the layout; not this tensor's notes
        on how it was made (a pending write-back into a base), which
        cannot be pickled (an optimizer's ``exp_avg``, made by ``zeros_like``, failed)."""
        state = super().__getstate__()  # (the instance dict, and DTensor's slots)
        slots = None
        if isinstance(state, tuple):
            state, slots = state
        state = {k: v for k, v in (state or {}).items() if k not in NOTES}
        return state if slots is None else (state, slots)

    # -- torch.compile (shardlab.comm.traced): torch's DTensor format --------
    def __tensor_flatten__(self):
        traced.prepare()  # dynamo (or AOTAutograd) is looking at a ShardTensor
        node = _CURRENT_NODE()  # a compiled backward reading its gradient (a tangent):
        if node is not None and type(node).__name__ == "CompiledFunctionBackward":
            compiled_grads.route(node)  # its parameters' partial gradients: summed at the end
        return DTensor.__tensor_flatten__(self)

    @staticmethod
    def __tensor_unflatten__(inner_tensors, flatten_spec, outer_size, outer_stride):
        return compiled_grads.unflatten(inner_tensors, flatten_spec, outer_size, outer_stride)

    def _stable_hash_for_caching(self) -> str:
        return compiled_grads.stable_hash(self)

    def __coerce_tangent_metadata__(self):
        # AOTAutograd: a gradient may not be Partial (DTensor's rule, with our sizes)
        if self._layout is None or not any(isinstance(p, Partial) for p in self._layout.placements):
            return self
        with graphs.guessing():
            return functions.Redistribute.apply(
                self, functions.gradient_layout(self._layout), "tangent"
            )

    def __coerce_same_metadata_as_tangent__(self, flatten_spec, expected_type=None):
        # AOTAutograd: a runtime gradient in the layout the compiled backward was built for
        want = traced.layout_of(flatten_spec)
        if expected_type is not None or want is None or self._layout is None:
            return None
        if want == self._layout:
            return self
        return functions.Redistribute.apply(self, want, "tangent")

    # -- torch.distributed.checkpoint: the real boxes (shardlab.tensor.checkpoint) ----
    def __create_write_items__(self, fqn: str, object):
        return checkpoint.create_write_items(self, fqn)

    def __create_chunk_list__(self):
        return checkpoint.create_chunk_list(self)

    def __get_tensor_shard__(self, index):
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

        def shown(m, p):
            if not isinstance(p, Shard):
                return format_sizes(p, None, m)
            if lay.is_block(p.dim):
                return format_sizes(p, lay.sizes_along(p.dim), m)
            entry = lay.sizes[m]  # a strided dim (a flattened (B, S) cut along S)
            text = format_sizes(p, entry[0] if len(entry) == 1 else entry, m)
            return f"{text} (strided: {lay.describe_dim(p.dim)})"

        places = ", ".join(shown(m, p) for m, p in enumerate(lay.placements))
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

    def __format__(self, format_spec: str) -> str:
        """``f"{loss:.4f}"``: a 0-d ShardTensor formats its global value, as torch formats a
        0-d tensor's ``.item()`` (torch does that for plain tensors only; DTensor raises).
        ``.item()`` reads it: a collective when it is Partial, so every rank must format
        it then. Without a format spec ``f"{x}"`` is the repr, as ``print(x)`` (torch
        prints a 0-d tensor's value there); a spec on a tensor of more dims raises torch's
        TypeError."""
        if format_spec and self.dim() == 0:
            return self.item().__format__(format_spec)
        return super().__format__(format_spec)

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
            coords = layout.coords() if validate else [p2p.my_coord(mesh)]
            for coord in coords:
                have = shapes[coord] if validate else tuple(local_tensor.shape)
                want = layout.local_shape(coord)
                if tuple(have) != want:
                    raise ValueError(
                        f"from_local: local_tensor has shape {tuple(have)} on the rank at "
                        f"mesh coordinate {coord}, but {layout} gives that rank {want}"
                    )
        return functions.FromLocal.apply(local_tensor, mesh, layout, stride)

    @staticmethod
    def from_dtensor(dtensor: DTensor) -> ShardTensor:
        """A plain DTensor (``distribute_tensor``, ``parallelize_module``) as a ShardTensor:
        the same blocks (DTensor's ``torch.chunk`` sizes), nothing sent, differentiable
        (the DTensor gets its gradient back as a DTensor).

        The explicit way to let shardlab run torch's own DTensors: with the patch on, a
        call whose arguments are plain DTensors runs torch's code, which for example
        convolves an image cut along H block by block, without halos, and labels the
        result ``Replicate()``; the ShardTensor gets the halo convolution, exact.

        Example::

            x = distribute_tensor(img, mesh, [Shard(2)])           # torch's
            y = conv(ShardTensor.from_dtensor(x))                  # halos, exact
        """
        if not isinstance(dtensor, DTensor):
            raise TypeError(
                f"from_dtensor: dtensor must be a DTensor, got {type(dtensor).__name__}"
            )
        if isinstance(dtensor, ShardTensor):
            return dtensor
        return dtensors.from_dtensor(dtensor)

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
        return functions.ToLocal.apply(self, grad_layout)

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
        return functions.Redistribute.apply(self, dst)

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
        out = functions.Redistribute.apply(self, dst)
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

    # -- the two doors of every op (shardlab.tensor.entry) -------------------------------
    __torch_function__ = classmethod(entry.torch_function)
    __torch_dispatch__ = classmethod(entry.torch_dispatch)


# ``torch.load`` (``weights_only=True``, its default) takes a checkpoint holding ShardTensors
# as it takes DTensors: the classes a pickled ShardTensor names (torch lists DTensor's own)
torch.serialization.add_safe_globals([ShardTensor, ShardLayout, traced.Placements])

NOTES = {"_writeback"}  # per-process notes a ShardTensor may carry (a pending write-back)
_CURRENT_NODE = torch._C._current_autograd_node

_compat.route_dispatch(ShardTensor, entry.dispatch_rule)
