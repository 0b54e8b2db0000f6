"""Which ops on a ShardTensor dynamo may put in its graph (:mod:`.traced` for the design).

On a mesh of one rank every op is traced (:func:`one_rank`); cut over several ranks, an
op that sends nothing is traced and one that would send breaks the graph
(:func:`check_ranks`), as does one whose backward would move or sum a gradient
(:func:`_local_backward`, :func:`_strided_slice`).
"""

from __future__ import annotations

import torch

from shardlab._tree import tree_leaves
from shardlab.comm import graphs
from shardlab.comm.traced import SYMBOLIC, TRACEABLE, graph_break
from shardlab.layout.views import clamp_index

__all__ = ["check_ranks", "cut_by_dynamo", "one_rank", "pooled_mean"]


def one_rank(args, kwargs) -> bool:
    """Every ShardTensor among ``args`` (and in their lists) lives on a mesh of one rank.
    Under ``torch.compile`` such a call takes no parameter lifting: AOTAutograd loses the
    gradient of a plain input that reaches a ShardTensor output through an autograd
    Function (the lift), while the op itself, traced with the plain tensor as it is,
    gives it its gradient (a ShardTensor there, whole on one rank, made plain after the
    backward by :mod:`shardlab.tensor.compiled_grads`)."""
    seen = False
    with torch._C.DisableTorchFunctionSubclass():
        for a in (*args, *(kwargs or {}).values()):
            for x in a if type(a) in (list, tuple) else (a,):
                mesh = getattr(x, "_spec", None)
                if mesh is not None and hasattr(x, "_local_tensor"):
                    if x._spec.mesh.size() != 1:
                        return False
                    seen = True
    return seen


def pooled_mean(func, args, kwargs):
    """``F.adaptive_avg_pool{1,2,3}d(x, 1)`` on a traced ShardTensor of one rank as
    ``x.mean(last dims, keepdim=True)``, else None.

    torch computes exactly that mean, then restrides it in place (``as_strided_``) when
    ``x`` looks channels-last: a transposed ``(B, L, C)`` before a pooler (Swin's). The
    values are the same, but a wrapper subclass cannot be functionalized through that
    in-place restride (DTensor fails there too), so compiled code takes the mean."""
    n = _POOLS.get(getattr(func, "__wrapped__", func))
    if n is None:
        return None
    x = args[0] if args else kwargs.get("input")
    size = args[1] if len(args) > 1 else kwargs.get("output_size")
    if len(args) + len(kwargs) != 2 or not isinstance(x, torch.Tensor):
        return None
    sizes = list(size) if isinstance(size, (list, tuple)) else [size]
    if sizes not in ([1], [1] * n) or x.ndim not in (n + 1, n + 2):
        return None
    if not (x.is_floating_point() or x.is_complex()):
        return None  # torch's own error
    return x.mean(tuple(range(-n, 0)), keepdim=True)


def _pools() -> dict:
    import torch.nn.functional as F

    return {torch.adaptive_avg_pool1d: 1, F.adaptive_avg_pool2d: 2, F.adaptive_avg_pool3d: 3,
            torch._C._nn.adaptive_avg_pool2d: 2, torch._C._nn.adaptive_avg_pool3d: 3}  # fmt: skip


_POOLS = _pools()


def cut_by_dynamo(args, kwargs) -> bool:
    """Some ShardTensor among the arguments holds one of dynamo's fake blocks and is on a
    mesh of several ranks."""
    from torch._subclasses.fake_tensor import FakeTensor

    return any(
        type(getattr(a, "_local_tensor", None)) is FakeTensor and a.device_mesh.size() != 1
        for a in tree_leaves((args, kwargs))
    )


def check_ranks(func, args, kwargs) -> bool:
    """While dynamo traces (its fake blocks, not AOTAutograd's functional ones): True
    for an op on a ShardTensor cut over several ranks, which dynamo may put in its graph
    if it sends nothing (the caller runs it under :class:`sends_break`); a graph break
    first (the op runs eagerly) where its backward could need a sum over ranks
    (:func:`_local_backward`) or a move (:func:`_strided_slice`), where it writes in
    place or draws random values (shardlab draws them for the global tensor, the same on
    any mesh), and before torch 2.13 (:data:`TRACEABLE`). On a mesh of one rank nothing is
    sent: every op stays in the graph (False)."""
    from torch._subclasses.fake_tensor import FakeTensor

    whole = bool(graphs._IN_GRAPHS)  # messages_in_graphs(): an op that sends is traced too
    dynamo, cut, symbolic = False, False, None  # dynamo's fake blocks; a symbolic scalar
    shaped = None  # a tensor of symbolic size
    leaves = tree_leaves((args, kwargs))
    for a in leaves:
        if type(getattr(a, "_local_tensor", None)) is FakeTensor:
            dynamo = True
            cut = cut or a.device_mesh.size() != 1
            if shaped is None and _symbolic_size(a):  # (``mark_dynamic`` on it)
                shaped = a
        elif isinstance(a, SYMBOLIC):
            symbolic = a
        elif type(a) is FakeTensor and shaped is None and _symbolic_size(a):
            shaped = a
    if cut:
        if (
            not TRACEABLE
            or (func._schema.is_mutable and not (whole and torch.Tag.pointwise in func.tags))
            # (written in place, a graph input came back from AOTAutograd's epilogue with
            # a gradient's strides of another block; inside messages_in_graphs() an
            # element-wise one is traced: ResNet's residual ``+=`` is exact, one graph; a
            # batch norm's running statistics failed the compile)
            or torch.Tag.nondeterministic_seeded in func.tags  # shardlab draws its own
        ):  # random values for the global tensor, the same on any mesh
            graph_break(f"{func} on a ShardTensor cut over several ranks")
        if not whole:  # a message in the backward breaks nothing there
            _local_backward(func, leaves)
            _strided_slice(func, args)
    if dynamo and graphs._SAVES_MESH and torch.Tag.nondeterministic_seeded in func.tags:
        if graphs._in_checkpointed_region():  # (attention's kernels are tagged so)
            graph_break(f"{func} in an activation-checkpointed region (torch < 2.15)")
    if dynamo and shaped is not None:
        # a plain tensor whose size dynamo made symbolic (it changed between calls, and
        # dynamo's automatic dynamic shapes recompiled: Llama's rotary ``cos`` for a new
        # sequence length), or a ShardTensor's global size marked dynamic by the user
        # (``mark_dynamic``): a layout holds numbers, so the op runs eagerly (it raised a
        # TypeError, in the meta call's cache or in a layout)
        graph_break(f"{func} with a tensor of symbolic size {tuple(shaped.shape)}")
    if dynamo and symbolic is not None and torch.Tag.pointwise not in func.tags:
        # an int dynamo made dynamic (``dynamic=True``, or a value that changed): a
        # layout holds numbers, so the op runs eagerly (a scalar of an element-wise op
        # changes no shape: it stays in the graph)
        graph_break(f"{func} with a symbolic argument ({symbolic})")
    return cut and not whole


def _symbolic_size(t) -> bool:
    return any(type(n) is torch.SymInt for n in t.shape)


def _strided_slice(func, args) -> None:
    """A slice along a cut dim sends nothing, but its backward (``slice_backward``) puts
    each rank's rows back between bounds it derives from the gradient's sizes, which are
    the input's only for a step of 1 where every rank keeps rows (``x[:, 1:]``, a label
    shift). Otherwise (Swin's patch merging ``x[:, 0::2]``, ``x[:, 1::2]``; ``x[:, 15:]``
    with the first rank's rows all cut off) gradients of one input come back in other
    layouts, and summing them would move rows inside the compiled backward (a hang
    against another rank's eager messages). Such a slice breaks the graph: it runs
    eagerly, and so does its backward."""
    if func not in _SLICES or not torch.is_grad_enabled():
        return
    x = args[0]
    lay = getattr(x, "_layout", None)
    if lay is None or not getattr(x, "requires_grad", False):
        return
    dim = (args[1] if len(args) > 1 else 0) % x.ndim
    if not lay.cut_by(dim):
        return
    n = x.shape[dim]
    start, end, step = (list(args[2:5]) + [None, None, 1][len(args[2:5]) :])[:3]
    plain = all(v is None or type(v) is int for v in (start, end, step))
    if plain and step == 1 and len(lay.cut_by(dim)) == 1 and lay.is_block(dim):
        start = 0 if start is None else clamp_index(start, n)
        end = n if end is None else clamp_index(end, n)
        offsets = [0]
        for size in lay.sizes_along(dim):
            offsets.append(offsets[-1] + size)
        kept = 0  # rows of the slice on the ranks before rank k (what slice_backward reads)
        for k in range(1, len(offsets) - 1):
            kept += max(0, min(end, offsets[k]) - max(start, offsets[k - 1]))
            if min(n, start + kept) != offsets[k]:  # slice_backward's bound k
                break
        else:
            return
    graph_break(f"{func} ({start}:{end}:{step}) along cut dim {dim}: its gradient moves")


_SLICES = (torch.ops.aten.slice.Tensor,)


def _local_backward(func, leaves) -> None:
    """An op on ShardTensors cut over several ranks goes into dynamo's graph only if its
    backward sends nothing either (its forward's messages break the graph where they are
    posted: :mod:`shardlab.comm.collectives`): a graph break where a gradient would need
    a sum over ranks inside the compiled backward, a ShardTensor that requires grad and is
    whole (Replicate) on a mesh dim where another argument is cut. A plain tensor is fine:
    its partial gradient leaves the compiled backward as it is and is summed there
    (``compiled_grads.route``: a parameter's with the others at the end of the backward)."""
    if not torch.is_grad_enabled():
        return
    from torch.distributed.tensor import Replicate

    layouts = [a._layout for a in leaves if getattr(a, "_layout", None) is not None]
    for a in leaves:
        if not isinstance(a, torch.Tensor) or not a.requires_grad:
            continue
        lay = getattr(a, "_layout", None)
        for m, p in enumerate(lay.placements if lay is not None else ()):
            if isinstance(p, Replicate) and any(
                not isinstance(o.placements[m], Replicate) for o in layouts
            ):
                graph_break(f"{func}: a gradient summed over mesh dim {m} in the backward")
