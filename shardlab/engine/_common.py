"""What every aten rule family needs: find the ShardTensors, move them, wrap results.

Rules run inside ``ShardTensor.__torch_dispatch__``, below autograd: they take and
return ShardTensors and never decide anything from a local shape (every rank takes the
same path, so collectives always match).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate

from shardlab._tree import tree_leaves, tree_map
from shardlab.comm import p2p
from shardlab.layout import ShardLayout
from shardlab.layout.dtensor import layout_of_dtensor
from shardlab.tensor import submesh

# the rules read these as c.<name> too (``c.as_shard``, ``c.tree_map``)
from shardlab.tensor.api import ShardTensor  # noqa: F401
from shardlab.tensor.create import as_shard, replicate_layout  # noqa: F401

aten = torch.ops.aten


def shards_in(tree) -> list:
    st = ShardTensor
    return [a for a in tree_leaves(tree) if isinstance(a, st)]


def the_mesh(shards):
    mesh = shards[0].device_mesh
    for s in shards[1:]:
        if s.device_mesh != mesh:
            raise ValueError(
                f"ShardTensors on different meshes in one op: {mesh} and {s.device_mesh}; "
                "redistribute them onto one mesh first"
            )
    return mesh


def me(mesh) -> tuple[int, ...]:
    return p2p.my_coord(mesh)


def local(x):
    return x._local_tensor if isinstance(x, ShardTensor) else x


def locals_of(tree):
    return tree_map(local, tree)


def wrap(t: torch.Tensor, mesh, layout: ShardLayout):
    """This rank's block ``t`` as a ShardTensor of ``layout`` (shapes must agree)."""
    want = layout.local_shape(me(mesh))
    if tuple(t.shape) != want:
        raise RuntimeError(
            f"shardlab internal error: a local result of shape {tuple(t.shape)} does not fit "
            f"{layout} (this rank needs {want}); please report it"
        )
    return ShardTensor._wrap(t, mesh, layout)


def move(x, layout: ShardLayout, cause: str):
    """ShardTensor ``x`` in ``layout`` (exact point-to-point moves / reductions)."""
    if x._layout == layout:
        return x
    out = p2p.redistribute_local(x._local_tensor, x._layout, layout, x.device_mesh, cause=cause)
    return ShardTensor._wrap(out, x.device_mesh, layout)


def block_in(t, mesh, layout: ShardLayout, cause: str, partial: str | None = None):
    """This rank's block of ``t`` laid out as ``layout``: a ShardTensor moved there (its
    Partial first summed, labelled ``partial``, where given), a plain tensor (whole on
    every rank) sliced to it, no message."""
    if not isinstance(t, ShardTensor):
        return t[tuple(slice(lo, hi) for lo, hi in layout.local_box(me(mesh)))]
    return move(reduced(t, partial) if partial else t, layout, cause)._local_tensor


def without_partial(layout: ShardLayout, mesh_dims=None) -> ShardLayout:
    """``layout`` with its Partial mesh dims (or only ``mesh_dims``) made Replicate."""
    places = tuple(
        Replicate() if isinstance(p, Partial) and (mesh_dims is None or m in mesh_dims) else p
        for m, p in enumerate(layout.placements)
    )
    return layout.replace(placements=places)


def write_partial(x, value: torch.Tensor) -> None:
    """Write ``value``, x's block laid out as ``without_partial(x._layout)``, into x while
    x keeps its layout: on a Partial(sum) mesh dim only coordinate 0 holds it (the others
    zeros), on a max / min one every rank does. x's views and base share its block and
    their layouts: they keep meaning what they hold (reducing x into a Replicate block
    in place would leave a Partial base summing it again)."""
    coord = me(x.device_mesh)
    for m, p in enumerate(x._layout.placements):
        if isinstance(p, Partial) and p.reduce_op == "sum" and coord[m] != 0:
            x._local_tensor.zero_()
            return
    x._local_tensor.copy_(value)


def reduced(x, cause: str, mesh_dims=None):
    """``x`` with its Partial values summed (max'ed ...) into Replicate."""
    if not any(isinstance(p, Partial) for p in x._layout.placements):
        return x
    return move(x, without_partial(x._layout, mesh_dims), cause)


def replicated(x, cause: str):
    """The whole tensor on every rank (as a ShardTensor laid out Replicate everywhere)."""
    return move(x, replicate_layout(x.shape, x.device_mesh), cause)


def schema_args(func, args, kwargs) -> dict:
    """Every argument of an aten call by its schema name, defaults filled."""
    out = {}
    for i, spec in enumerate(func._schema.arguments):
        if i < len(args):
            out[spec.name] = args[i]
        elif spec.name in kwargs:
            out[spec.name] = kwargs[spec.name]
        else:
            out[spec.name] = spec.default_value if spec.has_default_value() else None
    return out


def op_name(func) -> str:
    return func.overloadpacket.__name__


def is_inplace(func) -> bool:
    """The op writes its first argument and returns it (``add_``, ``copy_`` ...)."""
    args = func._schema.arguments
    return bool(args) and args[0].alias_info is not None and args[0].alias_info.is_write


def written_args(func) -> list[int]:
    """Indices of the arguments the op writes (in-place ops, ``out=``)."""
    return [
        i
        for i, a in enumerate(func._schema.arguments)
        if a.alias_info is not None and a.alias_info.is_write
    ]


def adopt(tree):
    """Plain DTensors in an op's arguments become ShardTensors (chunk sizes are just one
    layout); everything else is left as it is."""
    st = ShardTensor
    meshes = [a.device_mesh for a in tree_leaves(tree) if isinstance(a, DTensor)]
    big = max(meshes, key=lambda m: m.ndim) if meshes else None

    def conv(a):
        if not isinstance(a, DTensor):
            return a
        lay = a._layout if isinstance(a, st) else layout_of_dtensor(a)
        if a.device_mesh != big:  # on a sub-mesh (torch TP weights on mesh["tp"])
            dims = submesh.sub_mesh_dims(a.device_mesh, big)
            if dims is not None:
                return st._wrap(a._local_tensor, big, submesh.embed_layout(lay, dims, big))
        if isinstance(a, st):
            return a
        return st._wrap(a._local_tensor, a.device_mesh, lay)

    return tree_map(conv, tree)


def rebuild(like, items: list):
    """A list/tuple/namedtuple/structseq of the same type as ``like`` holding ``items``."""
    if isinstance(like, list):
        return items
    if hasattr(type(like), "_fields"):  # namedtuple (torch.return_types in newer releases)
        return type(like)(*items)
    return type(like)(items)


# -- views that had to be copies ----------------------------------------------------
# A view on one device aliases its base: ``x[:, 0].mul_(2)`` changes ``x``. A ShardTensor
# view aliases its base's local block whenever no data had to move. When a rule did move
# data (a copy), the result carries a write-back: after any op writes it, the write-back
# carries the new values home (and on up, if the base is itself such a view).
def with_writeback(y, writeback):
    y._writeback = writeback
    return y


def written(x) -> None:
    """``x`` was just written by an op: update what it is a (copied) view of."""
    wb = getattr(x, "_writeback", None)
    if wb is not None:
        wb()


def moved_view(y, base, moved):
    """``y`` views ``moved``, ``base`` moved to another layout (a copy). The base's block
    and layout are read now: an in-place view of the base later (``base.t_()``) relayouts
    the base, not the memory this copy goes back to."""
    block, layout = base._local_tensor, base._layout

    def writeback():
        back = move(moved, layout, "write back")
        block.copy_(back._local_tensor)
        written(base)

    return with_writeback(y, writeback)


def copied_local(y, base):
    """``y``'s block is a reshaped copy of ``base``'s block (both blocks read now, as
    :func:`moved_view` reads them)."""
    block, copy = base._local_tensor, y._local_tensor

    def writeback():
        block.copy_(copy.reshape(block.shape))
        written(base)

    return with_writeback(y, writeback)


def broadcast_shapes(shapes) -> tuple[int, ...]:
    """``torch.broadcast_shapes`` for a few shapes (the same rules and error)."""
    ndim = max((len(s) for s in shapes), default=0)
    out = [1] * ndim
    for s in shapes:
        for i, n in enumerate(s, ndim - len(s)):
            if n != 1:
                if out[i] not in (1, n):
                    raise RuntimeError(
                        f"The size of tensor a ({out[i]}) must match the size of tensor b ({n}) "
                        f"at non-singleton dimension {i}"
                    )
                out[i] = n
    return tuple(out)
