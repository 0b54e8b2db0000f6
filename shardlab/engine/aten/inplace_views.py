"""In-place views of a ShardTensor: ``x.transpose_(0, 1)``, ``t_``, ``squeeze_``, ``unsqueeze_``
(and ``resize_as_`` / ``resize_`` to the shape it has: itself).

torch changes the tensor's own sizes and strides (no data moves); its RNN kernels do it
to their output with ``batch_first=True`` (``nn.GRU`` and ``nn.RNN``). On a ShardTensor:

1. the out-of-place view (``transpose`` ...) through the view rules: the new layout and
   this rank's block, a view of the old one (no message, as for any view);
2. the wrapper's own sizes and strides changed by torch's in-place op, with the Python
   dispatch key excluded (metadata only: a wrapper holds no data);
3. the wrapper takes the view's block, spec and layout, and is returned (it *is* the
   result, as torch's in-place ops return their input).
"""

from __future__ import annotations

import torch

from shardlab.engine.registry import register
from shardlab.tensor.api import ShardTensor

aten = torch.ops.aten

# the in-place view op -> its out-of-place view
OUT_OF_PLACE = {
    aten.transpose_.default: aten.transpose.int,
    aten.t_.default: aten.t.default,
    aten.squeeze_.default: aten.squeeze.default,
    aten.squeeze_.dim: aten.squeeze.dim,
    aten.squeeze_.dims: aten.squeeze.dims,
    aten.unsqueeze_.default: aten.unsqueeze.default,
}
_PYTHON_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.Python) | torch._C.DispatchKeySet(
    torch._C.DispatchKey.PythonTLSSnapshot
)


def inplace_view(func, args, kwargs, dispatch):
    """``func(*args, **kwargs)`` (an op of :data:`OUT_OF_PLACE`) on the ShardTensor
    ``args[0]``; ``dispatch``: shardlab's aten dispatch (the view's rule)."""
    x = args[0]
    if type(x) is not ShardTensor or any(isinstance(a, torch.Tensor) for a in args[1:]):
        return NotImplemented
    view = dispatch(OUT_OF_PLACE[func], args, kwargs)  # 1. layout and block (torch's checks)
    if "_writeback" in view.__dict__:  # the view is a copy (a layout chosen from the global
        name = func.__name__.split(".")[0]  # shapes alone: every rank raises here)
        raise NotImplementedError(
            f"{name} on this ShardTensor ({x._layout}): its result here is a copy of the "
            f"data (a size-1 dim held by one rank), which an in-place view cannot be; call "
            f"{name.rstrip('_')}(...) and use its result"
        )
    with torch._C._ExcludeDispatchKeyGuard(_PYTHON_KEYS):  # 2. the wrapper's metadata
        func(x, *args[1:], **kwargs)
    if tuple(x.shape) != tuple(view.shape):  # never: the same op, twice
        raise RuntimeError(f"shardlab internal error: {func} gave {tuple(x.shape)}")
    x._local_tensor, x._spec, x._layout = view._local_tensor, view._spec, view._layout  # 3.
    return x


@register(aten.resize_as_.default, aten.resize_.default)
def resize(func, args, kwargs):
    """``x.resize_as_(other)`` / ``x.resize_(size)`` to the shape ``x`` has: torch's no-op
    (the same sizes, strides and data), so ``x`` itself on every rank, no message. A new
    shape (new elements of no value, a global storage reshaped) or a ``memory_format``:
    the next stage."""
    x, to = args[0], args[1]
    shape = tuple(to.shape) if func is aten.resize_as_.default else tuple(to)
    if type(x) is not ShardTensor or shape != tuple(x.shape) or len(args) > 2 or kwargs:
        return NotImplemented
    return x
