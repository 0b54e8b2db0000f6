"""The two doors of every op on a ShardTensor, and the tables the layers above fill.

::

    x * 2 ─ __torch_function__(Tensor.__mul__, (x, 2))     the call as written
             ├─ nothing for autograd to record: the replay (shardlab.engine.nograd)
             ├─ a call taken over whole: a backward, a loss, a quantile, Tensor.unfold
             └─ torch's own __mul__ ─ aten.mul.Tensor
                  └─ __torch_dispatch__(aten.mul.Tensor, ...)  below autograd
                       └─ the dispatcher (shardlab.engine.dispatch)

The class may not import the engine and the ops above it: they fill this module's tables
when they are imported (:func:`install`), as DTensor installs its op dispatcher on its
class. ``ShardTensor.__torch_function__`` and ``__torch_dispatch__`` are the two functions
below.
"""

from __future__ import annotations

import torch

from shardlab.comm import graphs, traced, traced_ops
from shardlab.tensor import api, backward

__all__ = ["NEVER_REPLAYED", "SCALAR_TYPES", "dispatch_rule", "install"]
__all__ += ["torch_dispatch", "torch_function"]


@traced.entry
def torch_function(cls, func, types, args=(), kwargs=None):
    """``ShardTensor.__torch_function__``: the call as the user wrote it."""
    if traced.tracing() is not None:  # an eager region under torch.compile
        return _EAGER_TF[0](cls, func, types, args, kwargs)
    compiling = traced.COMPILED and torch.compiler.is_compiling()
    if func is _TOLIST and type(args[0]) is cls and not compiling:
        # torch refuses .tolist() for every subclass (DTensor too): the global tensor's
        # values, on every rank (a collective when it is cut, as .item() of a Partial)
        return args[0].detach().full_tensor().tolist()
    if type(func) is _GETTER and not compiling:
        if func.__name__ == "__get__":  # .grad, .dtype, .shape ...: read as they are
            return _disabled_torch_function(func, types, args, kwargs or _NO_KWARGS)
        if func.__self__ is _DATA:  # ``p.data = new``
            return _set_data(func, types, args)
    if compiling and func not in _OWN_CALLS:
        if traced_ops.one_rank(args, kwargs):  # traced: nothing to lift (see traced.py)
            pooled = traced_ops.pooled_mean(func, args, kwargs or _NO_KWARGS)
            if pooled is not None:
                return pooled
            return _disabled_torch_function(func, types, args, kwargs or _NO_KWARGS)
    if func not in _OWN_CALLS and (not kwargs or _scalar_kwargs(kwargs)):
        # the common case in one pass: ShardTensors of one mesh (no stand-in) and
        # scalars; nothing to lift, nothing of ours above aten
        mesh = _one_mesh(args, cls)
        if mesh is not None and mesh is not _MIXED:
            if (
                not compiling
                and func not in NEVER_REPLAYED  # (views, Python functions: asked first)
                and not (  # autograd records it: grad mode, a first argument requiring grad
                    args
                    and _GRAD()
                    and type(args[0]) is cls
                    and _READ(_REQUIRES_GRAD, (), args[:1], {})
                )
            ):  # nothing for autograd to record: on the blocks
                out = _REPLAY[0](func, types, args, kwargs or _NO_KWARGS)
                if out is not NotImplemented:
                    return out
            return _disabled_torch_function(func, types, args, kwargs or _NO_KWARGS)
    traced.check(func, args, kwargs)  # dynamo's stand-ins: a graph break
    kwargs = kwargs or {}
    run_backward = _BACKWARDS.get(func)  # with __torch_function__ on (recomputation),
    if run_backward is not None:  # nothing lifted
        return run_backward(*args, **kwargs)
    if not (compiling and traced.TRACEABLE):
        args, kwargs = _LIFT[0](args, kwargs)
    elif func in _OWN_CALLS and traced_ops.cut_by_dynamo(args, kwargs):  # (they send)
        traced.graph_break(f"{func.__name__} on ShardTensors cut over several ranks")
    # (traced: parameters taken as they are; their gradients are summed after the
    # backward: shardlab.tensor.compiled_grads.route)
    own = _OWN_CALLS.get(func)  # losses (exact means), quantiles, Tensor.unfold (halos)
    if own is not None:
        out = own(func, args, kwargs)
        if out is not NotImplemented:
            return out
    return torch._C._disabled_torch_function_impl(func, types, args, kwargs)


@traced.entry
def torch_dispatch(cls, func, types, args=(), kwargs=None):
    """``ShardTensor.__torch_dispatch__``: each aten op, below autograd."""
    if traced.tracing() is not None:
        if not traced.faked(args):  # an eager region under torch.compile
            return _EAGER_TD[0](cls, func, types, args, kwargs)
    elif traced.COMPILED and torch.compiler.is_compiling():  # dynamo's fake blocks
        if traced_ops.check_ranks(func, args, kwargs):  # cut over ranks: traced where
            with graphs.sends_break():  # nothing is sent
                return _DISPATCH[0](func, args, kwargs or _NO_KWARGS)
    if _INFERENCE_MODE() and func.is_view and _tracked_view(func):
        return _normal_view(func, args, kwargs or _NO_KWARGS)
    return _DISPATCH[0](func, args, kwargs or _NO_KWARGS)  # checks stand-ins


_DATA = torch._C.TensorBase.__dict__["data"]


def _set_data(func, types, args):
    """``p.data = new`` (``vector_to_parameters``, older training code): torch swaps the
    tensor's metadata only, which left a ShardTensor's block and layout as they were (a
    silent no-op; DTensor's too). ``new`` must be a ShardTensor on ``p``'s mesh: ``p`` takes
    its block (shared, as torch shares storage), layout and global shape, dtype, strides.
    (A plain ``p`` never comes here: torch asks ``p`` alone for ``__torch_function__``.)"""
    p, new = args
    if type(p) is not api.ShardTensor:
        return _disabled_torch_function(func, types, args, _NO_KWARGS)
    if not isinstance(new, api.ShardTensor) or new.device_mesh != p.device_mesh:
        what = (
            type(new).__name__
            if not isinstance(new, api.ShardTensor)
            else "a ShardTensor on another mesh"
        )
        raise RuntimeError(
            f"p.data = new, with p a ShardTensor: new must be a ShardTensor on p's mesh, got "
            f"{what}; lay a whole tensor out with shardlab.distribute(new, p.device_mesh, "
            "p.placements), or write it in place with p.copy_(new) under torch.no_grad()"
        )
    _disabled_torch_function(func, types, args, _NO_KWARGS)  # the wrapper's sizes, dtype
    p._local_tensor, p._spec, p._layout = new._local_tensor, new._spec, new._layout
    for note in (*api.NOTES, "_whole_to_local"):
        p.__dict__.pop(note, None)
    for note in ("_writeback", "_whole_to_local"):  # (a copied view: writes reach its base)
        if note in new.__dict__:
            setattr(p, note, new.__dict__[note])
    return None


_INFERENCE_MODE = torch.is_inference_mode_enabled
_GETTER = type(torch.Tensor.grad.__get__)  # a property of torch's tensors, read
_TOLIST = torch.Tensor.tolist
_TRACKED: dict = {}  # aten view op -> does autograd's view bookkeeping see its result?


def _tracked_view(func) -> bool:
    """A view op with an ADInplaceOrView kernel (``view``, ``transpose``, ``detach``):
    its result is made an alias of its input (a composite one, ``flatten``, is not)."""
    hit = _TRACKED.get(func)
    if hit is None:
        hit = _TRACKED[func] = torch._C._dispatch_has_kernel_for_dispatch_key(
            func.name(), "ADInplaceOrView"
        )
    return hit


def _normal_view(func, args, kwargs):
    """A view op inside ``torch.inference_mode()`` of a ShardTensor made outside it: torch
    gives a normal tensor there (a view sharing its base's version counter); made in the
    mode, the result would be an inference tensor, which autograd's view bookkeeping
    refuses ("Cannot set version_counter for inference tensor": DTensor's case)."""
    dispatch = _DISPATCH[0]
    with torch._C.DisableTorchFunctionSubclass():
        inference = args[0].is_inference()
    if inference:
        return dispatch(func, args, kwargs)
    with torch.inference_mode(False):
        return dispatch(func, args, kwargs)


# the two doors again, as traced.eager makes them for a call under dynamo
_EAGER_TF = [traced.eager(torch_function)]
_EAGER_TD = [traced.eager(torch_dispatch)]


def dispatch_rule(cls, func, types, args=(), kwargs=None):
    """torch 2.11 routes ShardTensor ops here (see ``_compat.route_dispatch``)."""
    if _INFERENCE_MODE() and func.is_view and _tracked_view(func):
        return _normal_view(func, args, kwargs or _NO_KWARGS)
    return _DISPATCH[0](func, args, kwargs or {})


SCALAR_TYPES = (bool, int, float, complex, str, type(None), torch.dtype, torch.device)
_NO_KWARGS: dict = {}


def _one_mesh(args, cls, mesh=None):
    """The mesh when ``args`` are ShardTensors of one mesh (no traced stand-in), scalars
    and lists or tuples of those (cat's, a view's sizes); None when there is no
    ShardTensor; :data:`_MIXED` when anything else is there."""
    for a in args:
        t = type(a)
        if t is cls:
            if a._layout is None or (mesh is not None and a._spec.mesh is not mesh):
                return _MIXED
            mesh = a._spec.mesh
        elif t is list or t is tuple:
            mesh = _one_mesh(a, cls, mesh)
            if mesh is _MIXED:
                return _MIXED
        elif t not in SCALAR_TYPES:
            return _MIXED
    return mesh


_GRAD = torch.is_grad_enabled
_READ = torch._C._disabled_torch_function_impl  # a getter without __torch_function__
_REQUIRES_GRAD = torch._C.TensorBase.requires_grad.__get__


def _scalar_kwargs(kwargs) -> bool:
    """Only scalars among the keyword arguments (``scale=``, ``dim=``, ``dtype=`` …)."""
    for v in kwargs.values():
        if type(v) not in SCALAR_TYPES:
            return False
    return True


_MIXED = object()
_disabled_torch_function = torch._C._disabled_torch_function_impl
# what ShardTensor.__torch_function__ does itself rather than pass on to aten
_BACKWARDS = {
    torch.Tensor.backward: backward.tensor_backward,
    torch.autograd.backward: backward.backward,
    torch.autograd.grad: backward.grad,
}

# -- tables the layers above fill (they import this module; it imports none of them) ------
# shardlab.engine installs its dispatcher, replay and lifting when it is imported, as
# DTensor installs its op dispatcher on its class; shardlab.ops adds the calls it takes
# over at the Python entry. shardlab/__init__.py imports both once the class is loaded.
_DISPATCH: list = []  # [dispatch(func, args, kwargs)]: every aten op (shardlab.engine.dispatch)
_REPLAY: list = []  # [call(func, types, args, kwargs)]: no autograd to record (engine.nograd)
_LIFT: list = []  # [lift(args, kwargs)]: plain parameters and DTensors adopted (engine.lift)
NEVER_REPLAYED: set = set()  # functions the replay never learns (engine.nograd adds them)
# torch function -> handler(func, args, kwargs), run above aten (NotImplemented: go on);
# the backwards are called as they are, before anything is lifted
_OWN_CALLS: dict = dict.fromkeys(_BACKWARDS)


def install(*, dispatch=None, replay=None, lift=None, calls=None) -> None:
    """What a layer above gives the class: the aten ``dispatch``, the no-grad ``replay``,
    the ``lift`` of plain arguments (shardlab.engine), ``calls`` taken over at
    ``__torch_function__`` (shardlab.ops: ``{F.mse_loss: handler, ...}``)."""
    for table, fn in ((_DISPATCH, dispatch), (_REPLAY, replay), (_LIFT, lift)):
        if fn is not None:
            table[:] = [fn]
    _OWN_CALLS.update(calls or {})
