"""What a sharded ``torch.nn.functional`` implementation receives, whoever made its input.

:func:`prepare` turns the arguments of a patched call into what every handler in
:mod:`shardlab.ops` expects, differentiably:

* a plain DTensor (from ``distribute_tensor``, ``parallelize_module``) becomes a
  ShardTensor with DTensor's own chunk sizes; its gradient goes back as a DTensor with
  the original placements (Partial read as Replicate), a sum over the ranks still
  pending where it is Replicate (a parameter: ``Partial()``, as torch's backward leaves
  it), so torch's own ops keep working;
* a ``Partial`` value is reduced first (one all-reduce), as DTensor would;
* a strided dim (a view merged a cut dim under another) is made consecutive again
  (point-to-point moves of the rows that change owner), except for handlers that work
  row by row (cross-entropy on ``logits.view(-1, V)``).

Each step is labelled in the tracer (``prepare <op>``).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.utils._pytree import tree_map

from shardlab.engine.decisions import SCALARS
from shardlab.layout import ShardLayout, moves
from shardlab.tensor import submesh
from shardlab.tensor.api import ShardTensor
from shardlab.tensor.dtensors import from_dtensor
from shardlab.tensor.functions import Redistribute
from shardlab.trace import label

__all__ = ["prepare"]


def _block_and_whole(layout: ShardLayout, keep_strided: bool) -> ShardLayout:
    """``layout`` with Partial mesh dims Replicate and every strided dim consecutive."""
    places = tuple(Replicate() if isinstance(p, Partial) else p for p in layout.placements)
    out = layout.replace(placements=places)
    if not keep_strided:
        for d in out.strided_dims():
            out = moves.as_block(out, d)
    return out


_READY: dict = {}  # (layout, keep_strided) -> nothing to prepare (no Partial, no strided)


def _ready(values, keep_strided: bool) -> bool:
    """No argument to prepare: ShardTensors needing nothing, plain tensors, scalars, and
    lists or tuples of those (anything else pytree may open: the full pass decides)."""
    for a in values:
        t = type(a)
        if t is ShardTensor:
            key = (a._layout, keep_strided)
            ok = _READY.get(key)
            if ok is None:
                ok = _READY[key] = _block_and_whole(a._layout, keep_strided) == a._layout
                if len(_READY) > 4096:
                    _READY.clear()
            if not ok:
                return False
        elif t is list or t is tuple:
            if not _ready(a, keep_strided):
                return False
        elif isinstance(a, DTensor) or not (t in SCALARS or isinstance(a, torch.Tensor)):
            return False
    return True


def prepare(args, kwargs, name: str, keep_strided: bool = False):
    """The arguments of ``F.<name>`` as the sharded handlers expect them (see module).
    ``keep_strided``: the handler works row by row and takes strided dims as they are."""
    if _ready(args, keep_strided) and _ready(kwargs.values(), keep_strided):
        return tuple(args), dict(kwargs)  # the common case: nothing to do, one pass
    cut = [a for a in (*args, *kwargs.values()) if isinstance(a, ShardTensor)]
    mesh = max((a.device_mesh for a in cut), key=lambda m: m.ndim) if cut else None

    def conv(a):
        if isinstance(a, DTensor) and not isinstance(a, ShardTensor):
            # a DTensor on a sub-mesh of the input's (torch TP's mesh["tp"]): read on
            # the input's mesh; on its own mesh: adopted as it is
            on_sub = mesh is not None and a.device_mesh != mesh
            a = submesh.embed(a, mesh) if on_sub else from_dtensor(a)
        if isinstance(a, ShardTensor):
            want = _block_and_whole(a._layout, keep_strided)
            if want != a._layout:
                with label(f"prepare {name}"):
                    a = Redistribute.apply(a, want)
        return a

    return tree_map(conv, tuple(args)), tree_map(conv, dict(kwargs))


def _known_to_libraries() -> None:
    """Libraries that pick a backend by the module a tensor's class comes from
    (``type(x).__module__.split(".")[0]``: opt_einsum, and tensorly and neuraloperator's
    FNO through it) read ``"shardlab"`` for a ShardTensor; they are told it is torch's.
    torch imports opt_einsum with itself when it is installed, so it is there now."""
    import sys

    dispatch = sys.modules.get("opt_einsum.backends.dispatch")
    aliases = getattr(dispatch, "_aliases", None)
    if isinstance(aliases, dict) and "torch" in aliases:
        aliases.setdefault("shardlab", aliases["torch"])


_known_to_libraries()
