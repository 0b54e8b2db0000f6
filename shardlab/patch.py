"""Route ``torch.nn.functional`` calls on ShardTensors to shardlab (the only wrapt module).

::

    with shardlab.patched():           # or shardlab.enable() ... shardlab.disable()
        y = nn.Conv2d(3, 8, 3, padding=1)(x)   # x a ShardTensor -> halo convolution
        z = F.conv2d(torch.randn(1, 3, 8, 8), w)  # plain tensors -> torch, unchanged

Each patched name is replaced by a wrapt ``FunctionWrapper`` around the
original: a call whose positional or keyword arguments include a ShardTensor
goes to the handler registered for that name in ``shardlab.ops.registry``; any
other call goes to the original, with identical results, placements, messages
and errors: plain tensors, and plain DTensors too (torch's own tensor
parallelism, ``loss_parallel``, ``CommDebugMode`` counts are as without shardlab).
A plain DTensor next to a ShardTensor in a routed call is adopted (its gradient
comes back a DTensor). Taking plain DTensors over is explicit:
``ShardTensor.from_dtensor(x)``, or ``patched(dtensors=True)`` for a scope.
When natten is importable, its ``na1d``/``na2d``/``na3d`` (``natten.functional`` and
``natten``) route ShardTensor calls to :mod:`shardlab.ops.neighborhood` the same way, also
when natten is imported after ``enable()`` (a wrapt post-import hook).
Patching is idempotent and thread-safe; ``disable()`` and leaving
``patched()`` (also on an exception) restore the original objects.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import sys
import threading

import torch
import torch.nn.functional as F
import wrapt
from torch.distributed.tensor import DTensor

from shardlab.comm import graphs, traced
from shardlab.comm.gathers import gathers
from shardlab.ops.registry import ORIGINALS  # name -> torch's F.<name>, while patched
from shardlab.tensor import ShardTensor

__all__ = ["PATCHED_NAMES", "disable", "enable", "is_enabled", "patched"]

PATCHED_NAMES = (
    "conv1d", "conv2d", "conv3d",
    "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
    "linear", "pad", "scaled_dot_product_attention", "cross_entropy",
    "max_pool1d", "max_pool2d", "max_pool3d", "avg_pool1d", "avg_pool2d", "avg_pool3d",
    "adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_avg_pool3d",
    "adaptive_max_pool1d", "adaptive_max_pool2d", "adaptive_max_pool3d",
    "interpolate", "batch_norm", "group_norm", "instance_norm", "layer_norm", "dropout",
    "multi_head_attention_forward", "unfold",
)  # fmt: skip

_LOCK = threading.RLock()
_WRAPPERS: dict = {}  # (name, torch's function) -> its wrapper, made once
_SHARD_TENSOR: list = [ShardTensor]  # what routes a call (DTensor in ``patched(dtensors=True)``);
# never empty: a thread may still be in a wrapper another thread's disable() took off


def _has_shard_tensor(args, kwargs) -> bool:
    st = _SHARD_TENSOR[0]
    for a in args:
        if isinstance(a, st):
            return True
    if kwargs:
        for a in kwargs.values():
            if isinstance(a, st):
                return True
    return False


def _router(name: str):
    @traced.entry  # eager code: dynamo traces _traced_router instead, never this frame
    def route(wrapped, instance, args, kwargs):
        if not _has_shard_tensor(args, kwargs):
            return wrapped(*args, **kwargs)
        from shardlab.ops.registry import call

        return call(name, args, kwargs)

    return route


def _one_rank(args, kwargs) -> bool:
    """Every distributed argument lives on a mesh of one rank (it is whole there; dynamo
    can read a mesh's size, not a ShardTensor's layout)."""
    st = _SHARD_TENSOR[0]
    for a in (*args, *kwargs.values()):
        if isinstance(a, st) and a.device_mesh.size() != 1:
            return False
    return True


def _no_random(name: str, args, kwargs) -> bool:
    """No dropout drawn by this call (shardlab draws its own masks, the same on any mesh:
    torch's generator would give other values)."""
    if name == "dropout":
        p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
        training = args[2] if len(args) > 2 else kwargs.get("training", True)
        return p == 0 or not training
    if name == "scaled_dot_product_attention":
        return (args[4] if len(args) > 4 else kwargs.get("dropout_p", 0.0)) == 0
    return name != "multi_head_attention_forward"


def _traced_cut(name: str, args, kwargs) -> bool:
    """Calls whose torch function, run on cut ShardTensors, sends what the sharded one sends
    and nothing else (so dynamo may trace it: ``traced_ops.check_ranks`` breaks the graph at a
    message): ``F.linear`` (on rows: nothing) and a constant ``F.pad`` (the edge ranks grow,
    ``aten.constant_pad_nd``: nothing; the other modes read a neighbour's rows)."""
    if name == "linear":
        return True
    if name == "pad":
        return (args[2] if len(args) > 2 else kwargs.get("mode", "constant")) == "constant"
    return False


def _traced_router(name: str, original):
    """What dynamo traces for the patched ``F.<name>`` (wrapt's C proxy it cannot): torch's
    own function for plain tensors, and for ShardTensors on a mesh of one rank where the
    call draws no dropout (aten ops on the blocks: in the graph), and for ``F.linear`` on
    any mesh, as a constant ``F.pad`` (:func:`_traced_cut`: their aten ops are traced where
    they send nothing, ``traced_ops.check_ranks``);
    the sharded implementation otherwise, eagerly (a graph break)."""
    from shardlab.ops.registry import call

    def routed(*args, **kwargs):
        if not _has_shard_tensor(args, kwargs):
            return original(*args, **kwargs)
        if _one_rank(args, kwargs) and _no_random(name, args, kwargs):
            return original(*args, **kwargs)
        if traced.TRACEABLE and _traced_cut(name, args, kwargs):  # torch's, on ShardTensors:
            return original(*args, **kwargs)  # traced where it sends nothing (check_ranks)
        if graphs.in_graphs() and name in _TRACED_CALLS:  # messages_in_graphs()
            return _traced_call(name, args, kwargs)
        return call(name, args, kwargs)

    return routed


_TRACED_CALLS: dict = {}  # name -> the sharded call, nonstrict-traced (made by enable())


def _nonstrict(name: str):
    """The sharded ``F.<name>`` as one call in dynamo's graph, which AOTAutograd traces
    through (torch's ``nonstrict_trace``: dynamo must meet it made, outside the code it
    compiles). Its arguments are tensors and numbers only: ``None`` s travel as their
    positions (``nones``), keyword arguments as their names (``keys``)."""
    from shardlab.ops.registry import dispatch

    def sharded_call(n_args: int, keys: tuple, nones: tuple, *values):
        values = list(values)
        for i in nones:
            values.insert(i, None)
        args, kwargs = tuple(values[:n_args]), dict(zip(keys, values[n_args:]))
        if not graphs.dynamo_blocks(values):  # eagerly (dynamo broke the graph here), or
            return dispatch(name, args, kwargs)  # AOTAutograd tracing (see below)
        try:  # dynamo's run on its fake blocks: where it decides the graph's breaks
            graphs.random_in_checkpointed_region(name)
            out, failed = dispatch(name, args, kwargs), None
        except Exception as e:  # noqa: BLE001  (raised again below, on every rank)
            out, failed = None, e
        graphs.agree(name, values, failed)  # (the ShardTensors may be keyword arguments)
        return out

    sharded_call.__name__ = sharded_call.__qualname__ = f"sharded_{name}"
    return torch._dynamo.nonstrict_trace(sharded_call)


def _traced_call(name: str, args, kwargs):
    # (a torch.Size as a plain tuple of ints: what a nonstrict-traced call takes)
    values = [tuple(v) if type(v) is torch.Size else v for v in (*args, *kwargs.values())]
    nones = tuple(i for i, v in enumerate(values) if v is None)
    rest = [v for v in values if v is not None]
    return _TRACED_CALLS[name](len(args), tuple(kwargs), nones, *rest)


def _wrapper(name: str, original):
    """``F.<name>`` patched: a wrapt proxy of torch's function, which dynamo sees as the
    plain function :func:`_traced_router` (torch's marker for wrappers it should trace
    through, as ``torch.jit._script_if_tracing`` sets it); compared by identity, so that
    dynamo never takes it for torch's own function."""
    cls = type(
        f"Patched_{name}",
        (wrapt.FunctionWrapper,),
        {
            "__script_if_tracing_wrapper": True,
            "__original_fn": staticmethod(_traced_router(name, original)),
            "__eq__": lambda self, other: self is other,
            "__hash__": lambda self: id(self),
        },
    )
    return cls(original, _router(name))


def enable(*, dtensors: bool | None = None) -> None:
    """Patch every name in :data:`~shardlab.patch.PATCHED_NAMES` (a second call changes nothing).

    ``dtensors=True``: plain DTensors route calls too (read with their chunk sizes, as
    :meth:`ShardTensor.from_dtensor` reads them), also where no ShardTensor is among the
    arguments; ``False`` (the default when first enabled): only ShardTensors do, and a
    call with plain tensors and plain DTensors runs torch's own code. ``None``: as it was.
    """
    with _LOCK:
        if dtensors is not None:
            _SHARD_TENSOR[:] = [DTensor if dtensors else ShardTensor]
        if not ORIGINALS:
            _hook_dynamo()
        if "torch._dynamo" in sys.modules:
            _hook_dynamo_rules()
        for name in PATCHED_NAMES:
            if name in ORIGINALS:
                continue
            original = getattr(F, name)
            ORIGINALS[name] = original
            # the same wrapper each time (a compiled graph guards on its type: a new one
            # at every ``patched()`` recompiled a step that entered it)
            key = (name, original)
            if key not in _WRAPPERS:
                _WRAPPERS[key] = _wrapper(name, original)
            setattr(F, name, _WRAPPERS[key])
        _hook_natten()
        if "torch._dynamo" in sys.modules:
            _made_for_dynamo()


def _rules_read_with_torchs_functions(wrapped, instance, args, kwargs):
    """dynamo's table of the torch functions it may trace (``trace_rules.
    get_torch_obj_rule_map``), read with torch's own functions in place. dynamo reads it from
    ``torch.nn.functional`` on its first compile, and again after ``init_process_group``
    clears it (before or after the patch): read while ``F`` holds shardlab's wrappers, it
    holds ours instead of torch's, and every compiled graph broke at ``F.max_pool2d``, plain
    tensors too."""
    if not ORIGINALS or wrapped.cache_info().currsize:
        return wrapped(*args, **kwargs)
    with _torchs_functions_in_place():
        return wrapped(*args, **kwargs)


def _hook_dynamo_rules() -> None:
    """Wrap dynamo's table reader (its ``cache_clear`` and ``cache_info`` pass through);
    :func:`disable` unwraps it."""
    from torch._dynamo import trace_rules

    reader = trace_rules.get_torch_obj_rule_map
    if not isinstance(reader, wrapt.FunctionWrapper):
        trace_rules.get_torch_obj_rule_map = wrapt.FunctionWrapper(
            reader, _rules_read_with_torchs_functions
        )


def _unhook_dynamo_rules() -> None:
    trace_rules = sys.modules.get("torch._dynamo.trace_rules")
    reader = getattr(trace_rules, "get_torch_obj_rule_map", None)
    if isinstance(reader, wrapt.FunctionWrapper):
        trace_rules.get_torch_obj_rule_map = reader.__wrapped__


@contextlib.contextmanager
def _torchs_functions_in_place():
    """torch's own ``F`` functions in place for the block, ours back after it (dynamo
    reading which functions it may trace: its import, its table of torch functions)."""
    with _LOCK:
        patched_now = {name: getattr(F, name) for name in ORIGINALS}
        try:
            for name, original in ORIGINALS.items():
                setattr(F, name, original)
            yield
        finally:
            for name, wrapper in patched_now.items():
                setattr(F, name, wrapper)


def _made_for_dynamo() -> None:
    """The nonstrict-traced calls (for ``messages_in_graphs()``), made once dynamo is
    imported: dynamo must meet them made, outside the code it compiles."""
    if traced.TRACEABLE and not _TRACED_CALLS:
        _TRACED_CALLS.update({name: _nonstrict(name) for name in PATCHED_NAMES})


# -- dynamo imported while F is patched ---------------------------------------------
# dynamo, imported, records which torch.nn.functional functions it may trace into (those
# boolean_dispatch makes, max_pool2d's); imported while they are patched (the first
# torch.compile, or an op's meta check that imports it), it would take ours for torch's
# and break every compiled graph at them, plain tensors too. Importing it in enable()
# cost every rank 0.8 s; instead its import runs with torch's functions in place.


class _DynamoFinder(importlib.abc.MetaPathFinder):
    """``torch._dynamo``'s import, while patched, runs with torch's own functions in place."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "torch._dynamo" or not ORIGINALS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _UnpatchedLoader(spec.loader)
                return spec
        return None


class _UnpatchedLoader(importlib.abc.Loader):
    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        with _torchs_functions_in_place():
            self.loader.exec_module(module)
        if ORIGINALS:
            _hook_dynamo_rules()
        _made_for_dynamo()


_DYNAMO_FINDER = _DynamoFinder()


def _hook_dynamo() -> None:
    if "torch._dynamo" not in sys.modules and _DYNAMO_FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _DYNAMO_FINDER)


def disable() -> None:
    """Put the original functions back (a second call changes nothing)."""
    with _LOCK:
        _SHARD_TENSOR[:] = [ShardTensor]  # (the next enable() routes ShardTensors, unless told)
        _unhook_dynamo_rules()
        for name, original in list(ORIGINALS.items()):
            setattr(F, name, original)
            del ORIGINALS[name]
        for (module, name), original in list(_NATTEN_ORIGINALS.items()):
            setattr(module, name, original)
            del _NATTEN_ORIGINALS[(module, name)]


# -- natten: its functional entry points, also when natten is imported later ----------
NATTEN_MODULES = ("natten.functional", "natten")
NATTEN_NAMES = ("na1d", "na2d", "na3d")
_NATTEN_ORIGINALS: dict = {}  # (module, name) -> original
_NATTEN_HOOKED: list = []


def _natten_router(name: str):
    def route(wrapped, instance, args, kwargs):
        if not _has_shard_tensor(args, kwargs):
            return wrapped(*args, **kwargs)
        from shardlab.ops import neighborhood

        return neighborhood.natten_call(name, wrapped, args, kwargs)

    return route


def _patch_natten(module) -> None:
    """wrapt's post-import hook (and ``enable()`` for natten already imported)."""
    with _LOCK:
        if not ORIGINALS:  # shardlab is not enabled: leave natten alone
            return
        for name in NATTEN_NAMES:
            original = getattr(module, name, None)
            if original is None or (module, name) in _NATTEN_ORIGINALS:
                continue
            _NATTEN_ORIGINALS[(module, name)] = original
            setattr(module, name, wrapt.FunctionWrapper(original, _natten_router(name)))


def _hook_natten() -> None:
    import sys

    if not _NATTEN_HOOKED:  # once per process: wrapt keeps the hooks
        for mod in NATTEN_MODULES:
            wrapt.register_post_import_hook(_patch_natten, mod)
        _NATTEN_HOOKED.append(True)
    for mod in NATTEN_MODULES:  # already imported (also after a disable())
        if mod in sys.modules:
            _patch_natten(sys.modules[mod])


def is_enabled() -> bool:
    """True while the patches are in place (inside :func:`patched`, or after :func:`enable`)."""
    return bool(ORIGINALS)


@contextlib.contextmanager
def patched(*, dtensors: bool | None = None, gather: str | None = None):
    """Patch inside the block; afterwards the patches are as they were before it.

    Inside, a ``torch.nn.functional`` call (or an ``nn`` module that makes one) whose
    arguments include a ShardTensor runs shardlab's sharded version; every other call runs
    torch's original, unchanged, plain DTensors too. ``dtensors=True`` takes plain
    DTensors over inside the block (see :func:`enable`): a DTensor image cut along H then
    gets the halo convolution, where torch convolves each block alone (no halo) and
    labels the result ``Replicate()``; its result is a ShardTensor.

    ``gather``: what an op with no rule for its layout does when it would gather a whole
    tensor onto every rank (:func:`shardlab.gathers`): ``"warn"`` (the default, once per
    op and layout, a :class:`shardlab.GatherWarning`), ``"raise"`` (a
    :class:`shardlab.GatherError` on every rank, before anything is sent) or
    ``"ignore"``; None: as outside the block.

    Communicates nothing itself: each sharded op sends what it needs (a convolution its
    halo rows, point to point; a norm one all-reduce; attention the K/V ring), as
    :func:`shardlab.trace` shows.

    Example::

        with shardlab.patched():
            x = shardlab.distribute(img, mesh, [Shard(2)], sizes=[[30, 34, 32, 32]])
            y = model(x)                       # nn.Conv2d etc., unchanged
            y.sum().backward()
    """
    with _LOCK:
        was, routes = is_enabled(), list(_SHARD_TENSOR)
        enable(dtensors=dtensors)
    try:
        with gathers(gather) if gather is not None else contextlib.nullcontext():
            yield
    finally:
        with _LOCK:
            if not was:
                disable()
            else:
                _SHARD_TENSOR[:] = routes
