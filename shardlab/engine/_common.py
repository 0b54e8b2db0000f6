"""What every aten rule family needs: find the ShardTensors, move them, wrap results.

Rules run inside ``ShardTensor.__torch_dispatch__``, below autograd: they take and
return ShardTensors and never decide anything from a local shape (every rank takes the
same path, so collectives always match).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate

from shardlab._tree import tree_leaves, tree_map
from shardlab.comm import p2p, traced
from shardlab.engine import decisions
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


def local_call(func, args, kwargs, mesh, layout: ShardLayout, moves=None, cause=""):
    """The op on the local blocks, wrapped in ``layout``: for rules whose result is exactly
    ``func(*blocks)`` once the ShardTensor arguments moved to ``moves`` (one entry per
    positional, then keyword, argument: a layout, or None to keep it as it is). The result
    carries how it was made, so :mod:`shardlab.engine.dispatch` can keep the decision for
    the signature (:mod:`shardlab.engine.decisions`)."""
    st = ShardTensor
    values = (*args, *kwargs.values())
    moves = [None] * len(values) if moves is None else list(moves)

    def block(a, mv):
        if isinstance(a, st):
            return (a if mv is None else move(a, mv, cause))._local_tensor
        return a

    n = len(args)
    out = wrap(
        func(*[block(a, moves[i]) for i, a in enumerate(args)],
             **{k: block(v, moves[n + j]) for j, (k, v) in enumerate(kwargs.items())}),
        mesh, layout,
    )  # fmt: skip
    decisions.decided(out, func, moves, mesh, layout, cause)
    return out


def keep_moves(func, args, kwargs, used: dict, results, mesh, layouts, cause: str) -> None:
    """Keep a rule's decision for the signature (:func:`local_call`'s mark, for rules that
    move and call themselves): ``used`` maps the position of each tensor argument moved
    (positional, then keyword values; absent: its block as it is) to what the op ran on,
    moved with the label ``cause`` (a plain tensor: itself when used whole)."""
    st = ShardTensor
    values = (*args, *kwargs.values())
    moves = [None] * len(values)
    for i, u in used.items():
        g = values[i]
        if u is g or (not isinstance(g, st) and isinstance(u, st) and u._local_tensor is g):
            continue
        moves[i] = u._layout
    decisions.decided(results, func, moves, mesh, layouts, cause)


def move(x, layout: ShardLayout, cause: str):
    """ShardTensor ``x`` in ``layout`` (exact point-to-point moves / reductions)."""
    if x._layout == layout:
        return x
    out = p2p.redistribute_local(x._local_tensor, x._layout, layout, x.device_mesh, cause=cause)
    return ShardTensor._wrap(out, x.device_mesh, layout)


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


def meta_of(x):
    st = ShardTensor
    if isinstance(x, st):
        return torch.empty_strided(tuple(x.shape), x.stride(), dtype=x.dtype, device="meta")
    if isinstance(x, torch.Tensor):
        return torch.empty_strided(tuple(x.shape), x.stride(), dtype=x.dtype, device="meta")
    if isinstance(x, traced.SYMBOLIC):  # a scalar dynamo traces (a float argument that changed
        return _hint(x)  # between calls): its value now, read without a guard
    return x


def _hint(x):
    """A symbolic scalar's value in this call (no guard added: torch's checks on the
    meta copies see a plain number of the same type)."""
    hint = x.node.hint
    if hint is None:  # unbacked: any value of its type
        hint = {torch.SymInt: 1, torch.SymFloat: 1.0, torch.SymBool: True}[type(x)]
    return hint


class _NoMeta(Exception):
    pass


_META_CACHE: dict = {}
_META_CACHE_SIZE = 4096


_ATOMS = frozenset({int, bool, str, type(None), torch.dtype})  # keyed by type and value


def _key(x):
    t = type(x)
    if t in _ATOMS:  # the common case first (sizes, dims, flags)
        return (t, x)
    if t is tuple or t is list:
        return (t, *(_key(v) for v in x))
    if isinstance(x, torch.Tensor):
        return ("T", tuple(x.shape), x.stride(), x.dtype, x.requires_grad)
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, *(_key(v) for v in x))
    if isinstance(x, dict):
        return ("D", *((k, _key(v)) for k, v in sorted(x.items())))
    if isinstance(x, float) and x != x:
        return ("nan",)
    if isinstance(x, traced.SYMBOLIC):
        raise TypeError("a symbolic scalar: no cached meta result")
    hash(x)  # anything unhashable: no caching
    return (type(x).__name__, x)


def meta_call(func, args, kwargs):
    """``func`` on shape-only copies of the global tensors: torch's own argument errors,
    raised alike on every rank, and the global output shapes. None when torch has no
    meta kernel for it (or the output size depends on the data). Cached by the
    arguments' shapes, strides and dtypes (a training step repeats them)."""
    try:
        key = (func, _key(args), _key(kwargs))
        hit = _META_CACHE.get(key)
    except TypeError:  # unhashable: a symbolic size in a shape, say
        return _meta_call(func, args, kwargs)
    if hit is None:
        try:
            hit = ("ok", _meta_call(func, args, kwargs))
        except Exception as exc:  # torch's own error: the same for the same arguments
            hit = ("error", exc)
        if len(_META_CACHE) >= _META_CACHE_SIZE:
            _META_CACHE.clear()
        _META_CACHE[key] = hit
    if hit[0] == "error":
        raise hit[1]
    return hit[1]


def _meta_call(func, args, kwargs):
    with traced.outside_modes():  # meta tensors, also while torch.compile traces (kept)
        return _meta_call_here(func, args, kwargs)


def _meta_call_here(func, args, kwargs):
    margs, mkwargs = tree_map(meta_of, (args, kwargs))
    if scalars_index(func) is not None:
        margs, mkwargs = _keep_cpu_scalars(func, args, kwargs, margs, mkwargs)
    if func in _HALF_ONLY_META:
        return _as_half_on_meta(func, margs, mkwargs)
    try:
        return func(*margs, **mkwargs)
    except (NotImplementedError, torch._subclasses.fake_tensor.DataDependentOutputException):
        return None
    except RuntimeError as exc:
        again = _with_cpu_scalars(func, margs, mkwargs)
        if again is not None:
            return again[0]
        text = str(exc)
        if "meta" in text.lower() and ("not implemented" in text or "backend" in text.lower()):
            return None
        if any(
            w in text
            for w in (
                "data-dependent",
                "Cannot copy out of meta",
                "cannot be called on meta tensors",
                "do not have strides",
            )
        ):
            return None
        raise


def _with_cpu_scalars(func, margs, mkwargs):
    """``(result,)`` of the meta call again with each 0-d tensor a CPU one, or None. torch
    takes a 0-d tensor beside a larger one as a scalar (``g.mul_(clip_coef)``, what
    ``clip_grad_norm_`` does per gradient), but a meta kernel written as a reference checks
    shapes strictly unless that tensor is on the CPU (``allow_cpu_scalar_tensors``)."""

    changed = []

    def cpu(a):
        if isinstance(a, torch.Tensor) and a.ndim == 0 and a.device.type == "meta":
            changed.append(a)
            return torch.zeros((), dtype=a.dtype)
        return a

    cargs, ckwargs = tree_map(cpu, (margs, mkwargs))
    if not changed:
        return None
    try:
        return (func(*cargs, **ckwargs),)
    except Exception:  # noqa: BLE001 (the first error is torch's answer)
        return None


_CPU_SCALARS: dict = {}  # op -> the index of its ``Tensor scalars`` argument, or None


def scalars_index(func):
    """The foreach ops' ``Tensor scalars`` (``_foreach_addcdiv_.Tensor``, which compiled
    optimizers call): their meta kernel wants that tensor on the CPU, as it is."""
    if func not in _CPU_SCALARS:
        where = [i for i, a in enumerate(func._schema.arguments)
                 if a.name == "scalars" and str(a.type) == "Tensor"]  # fmt: skip
        _CPU_SCALARS[func] = where[0] if where else None
    return _CPU_SCALARS[func]


def _keep_cpu_scalars(func, args, kwargs, margs, mkwargs):
    i = _CPU_SCALARS[func]
    if i < len(args):
        if type(args[i]) is torch.Tensor:
            margs = [*margs[:i], args[i], *margs[i + 1 :]]
    elif type(kwargs.get("scalars")) is torch.Tensor:
        mkwargs = {**mkwargs, "scalars": kwargs["scalars"]}
    return margs, mkwargs


# meta kernels that refuse dtypes the CPU kernel takes (torch 2.11-2.13: the meta of
# ``_grouped_mm``, MoE experts in transformers, wants bfloat16; the CPU kernel also takes
# float32 and float16): their shapes are read in bfloat16 and given the inputs' dtype
_HALF_ONLY_META = {torch.ops.aten._grouped_mm.default}


def _as_half_on_meta(func, margs, mkwargs):
    floats = {a.dtype for a in tree_leaves((margs, mkwargs))
              if isinstance(a, torch.Tensor) and a.is_floating_point()}  # fmt: skip
    if floats <= {torch.bfloat16} or len(floats) != 1 or mkwargs.get("out_dtype") is not None:
        return func(*margs, **mkwargs)  # bfloat16, mixed, or an out_dtype: torch's own words
    (dtype,) = floats

    def half(a):
        return a.to(torch.bfloat16) if isinstance(a, torch.Tensor) and a.dtype == dtype else a

    out = func(*tree_map(half, margs), **tree_map(half, mkwargs))

    def back(r):
        if isinstance(r, torch.Tensor) and r.dtype == torch.bfloat16:
            return torch.empty_strided(r.shape, r.stride(), dtype=dtype, device="meta")
        return r

    return tree_map(back, out)


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
