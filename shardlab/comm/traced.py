"""ShardTensor under ``torch.compile``: a traceable subclass.

What dynamo and AOTAutograd see::

    user code        x = conv(x)          y = x.relu() * w         loss = y.mean()

    mesh of 1 rank   [torch's conv, relu, mul, mean on the blocks: one graph, no break]
    several ranks    conv (halos) | [relu, mul (w as it is)] | mean (all-reduce)
                                ^ break                   ^ break: a message

* **The layout travels with the tensor.** DTensor's flatten format carries a
  :class:`Placements` (DTensor's placements, holding the :class:`ShardLayout`): the
  ShardTensors that dynamo and AOTAutograd rebuild from fake blocks have their layout,
  and dynamo's guard on the spec compares layouts (other shard sizes, another graph).
* **On a mesh of one rank everything is traced.** dynamo puts the ops in the graph,
  AOTAutograd runs ``__torch_dispatch__`` on fake blocks (it decides as it always does
  and leaves torch's ops on the blocks in the graph); the patched ``torch.nn.functional``
  entry points take torch's own function there (:mod:`shardlab.patch`); parameters are
  taken as they are (:func:`one_rank`). Nothing is sent, so nothing is in the way.
* **Cut over several ranks, what sends nothing is traced; every message breaks the
  graph** (:func:`check_ranks`, :class:`sends_break`): the op that would post it runs
  eagerly, as do the patched entry points that send (halos, rings, exact means) and the
  public methods that read the layout (``to_local``, ``full_tensor``, ...: :func:`eager`).
  Parameters are taken as they are (``F.linear`` too: torch's, on the ShardTensors);
  their partial gradients leave the compiled backward and are summed with the others at
  the end of the backward (``shardlab.tensor.compiled_grads.route``). No compiled graph,
  forward or backward, holds a collective: with uneven shards the ranks' graphs differ,
  and a message inside one, ordered against eager messages outside, could pair rank 0's
  halo with rank 1's all-reduce (a hang). Traced anyway (``aot_function``, ``make_fx``),
  the collectives are graph nodes that send the same messages when the graph runs
  (:mod:`shardlab.comm.collectives`), never skipped.
* **Inside** :class:`messages_in_graphs` **(opt-in) the messages are in the graphs too**:
  ops that send are traced, a patched ``F`` call is one nonstrict-traced call, the
  messages of a graph are chained by a token (one order on every rank) and kept in their
  pass (forward or backward), and the ranks agree before a call breaks (:func:`agree`).
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch._C._dynamo.eval_frame import get_eval_frame_callback as _callback

from shardlab import _compat
from shardlab._tree import tree_leaves
from shardlab.comm import collectives
from shardlab.layout.views import clamp_index

__all__ = [
    "COMPILED", "TRACEABLE", "Placements", "agree", "breaks_on_messages", "check",
    "check_ranks", "cpu_numbers", "dynamo_blocks",
    "cut_by_dynamo", "eager", "entry", "faked", "graph_break", "layout_of", "one_rank",
    "guessing", "in_graphs", "message_traced", "messages_in_graphs", "outside_modes",
    "placements", "pooled_mean", "prepare", "sends_break", "SYMBOLIC", "tracing",
]  # fmt: skip

tracing = _callback  # ``tracing() is not None``: dynamo's frame callback is installed

TRACEABLE = _compat.traceable()  # before 2.13 each op runs eagerly (:func:`check`)


def graph_break(what: str):
    """Ask dynamo to run ``what`` eagerly: raises dynamo's ``Unsupported`` (a graph break
    while dynamo traces; a stand-in exists only while something traces)."""
    from torch._dynamo.exc import unimplemented

    unimplemented(
        gb_type="shardlab: a ShardTensor op",
        context=what,
        explanation=(
            "this ShardTensor call runs eagerly (shardlab.comm.traced); dynamo compiles "
            "the code around it"
        ),
        hints=["fullgraph=True cannot hold it: compile without fullgraph"],
    )


def eager(fn):
    """``fn`` and everything it calls run eagerly, also when called from compiled code:
    dynamo breaks the graph at the call and never traces inside.

    Outside ``torch.compile`` (no dynamo callback installed: every eager program) the
    call goes straight to ``fn``; only under dynamo does it pass through
    ``torch.compiler.disable`` (which costs ~1.5 µs, and an op on a ShardTensor passes
    several of these entry points). Both that wrapper and dynamo's import (~0.5 s) wait
    for the first call under dynamo."""
    disabled = []

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if _callback() is None:
            return fn(*args, **kwargs)
        if not disabled:
            prepare()
            disabled.append(torch.compiler.disable(fn, recursive=True))
        return disabled[0](*args, **kwargs)

    call._torchdynamo_disable = True  # dynamo never inlines it: a graph break, called as is
    call._torchdynamo_disable_msg = _reason(fn)  # (what dynamo says: ``fullgraph=True``)
    _skip(call.__code__)  # one code object for every wrapper
    return call


def _reason(fn) -> str:
    """Why dynamo leaves ``fn`` out of its graph, as its error with ``fullgraph=True``
    and ``torch._dynamo.explain`` say it."""
    name = f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', fn)}".lstrip(".")
    return (
        f"shardlab: {name} runs eagerly, never in a compiled graph (a ShardTensor cut "
        "over several ranks: it may send between ranks, or read the layout). "
        "fullgraph=True cannot hold it: compile without fullgraph, and dynamo compiles "
        "the code around it"
    )


def entry(fn):
    """:func:`eager` for the hottest entry points (``__torch_function__``,
    ``__torch_dispatch__``: every op passes both), without the wrapper's frame: ``fn``
    starts with ``if tracing() is not None: return <eager(fn)>(...)`` itself. Here dynamo
    is told never to inline ``fn`` and never to compile its frame."""
    fn._torchdynamo_disable = True
    fn._torchdynamo_disable_msg = _reason(fn)
    _skip(fn.__code__)
    return fn


_WRAPPER_CODE: list = []


def _skip(code) -> None:
    if code not in _WRAPPER_CODE:
        _WRAPPER_CODE.append(code)


COMPILED: list = []  # not empty once dynamo looked at a ShardTensor here (torch 2.13 on)


@functools.cache
def prepare() -> None:
    """Once dynamo is in use (``__tensor_flatten__``, or the first wrapper called under
    it): dynamo never compiles the frame of :func:`eager`'s wrapper itself; what it calls
    is disabled, or runs with no dynamo at all."""
    from torch._dynamo.eval_frame import skip_code

    if TRACEABLE:  # the traced paths (one rank, gradients fixed): 2.13 on
        COMPILED.append(True)
    for code in _WRAPPER_CODE:
        skip_code(code)


def check(func, args, kwargs) -> None:
    """A graph break when any argument is a stand-in, a ShardTensor that dynamo or
    AOTAutograd rebuilt for tracing (no layout). One pass, no allocation: every op on a
    ShardTensor runs this."""
    for a in args:
        if getattr(a, "_layout", 0) is None or (
            type(a) in (list, tuple) and any(getattr(x, "_layout", 0) is None for x in a)
        ):
            graph_break(getattr(func, "__name__", str(func)))
    if kwargs:
        for a in kwargs.values():
            if getattr(a, "_layout", 0) is None:
                graph_break(getattr(func, "__name__", str(func)))


class Placements(tuple):
    """DTensor's placements of a ShardTensor, holding its :class:`ShardLayout`: how the
    layout travels in DTensor's flatten format (dynamo, AOTAutograd) and how dynamo's guard
    on the spec sees shard sizes. Equal to another ``Placements`` only for the same layout;
    to plain placements as a tuple (torch's own checks compare them)."""

    def __new__(cls, layout):
        self = super().__new__(cls, layout.placements)
        self.layout = layout
        return self

    def __eq__(self, other):
        if isinstance(other, Placements):
            return self.layout == other.layout
        return tuple.__eq__(self, other)

    def __ne__(self, other):
        return not self.__eq__(other)

    __hash__ = tuple.__hash__

    def __reduce__(self):
        return Placements, (self.layout,)


def layout_of(flatten_spec):
    """The layout in DTensor's flatten context ``(placements, ...)``; None for plain
    placements and before torch 2.13 (:data:`TRACEABLE`)."""
    return getattr(flatten_spec[0], "layout", None) if TRACEABLE else None


def placements(layout) -> Placements:
    """The :class:`Placements` of ``layout``, one per layout object."""
    hit = layout.__dict__.get("_places")
    if hit is None:
        hit = Placements(layout)
        object.__setattr__(layout, "_places", hit)
    return hit


def outside_modes():
    """No dispatch mode (dynamo's fake tensors, AOTAutograd's tracing) inside: the meta
    runs whose results shardlab keeps between calls are plain meta tensors."""
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


def cpu_numbers():
    """For plain tensors of numbers that decisions read (positions on the CPU), also
    while torch.compile traces: :func:`outside_modes` when a mode is active (under a
    fake mode any op, on any tensor, would give a tensor without values)."""
    if torch._C._len_torch_dispatch_stack() == 0:
        return contextlib.nullcontext()
    return outside_modes()


def faked(args) -> bool:
    """True if the first ShardTensor among ``args`` holds a fake block (dynamo's or
    AOTAutograd's tracing)."""
    from torch._subclasses.fake_tensor import is_fake

    for a in args:
        if isinstance(a, torch.Tensor):
            return is_fake(a)
        if type(a) in (list, tuple):
            for x in a:
                if isinstance(x, torch.Tensor):
                    return is_fake(x)
    return False


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

    whole = bool(_IN_GRAPHS)  # messages_in_graphs(): an op that sends is traced too
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
    if dynamo and _SAVES_MESH and torch.Tag.nondeterministic_seeded in func.tags:
        if _in_checkpointed_region():  # (attention's kernels are tagged so)
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


_IN_GRAPHS: list = []  # not empty inside messages_in_graphs()


class messages_in_graphs:
    """Compile sharded code with its messages inside the graphs (torch 2.13 on).

    ::

        with shardlab.patched(), shardlab.messages_in_graphs():
            compiled = torch.compile(model)
            compiled(**batch).loss.backward()   # ResNet, Llama: one graph, no break

    By default a compiled graph holds no collective: every op that sends (a halo, an
    all-reduce, the ring of attention) breaks the graph and runs eagerly. Inside this
    scope, while torch.compile traces, they are traced too:

    * an op on ShardTensors that sends is traced as any other (its messages are
      ``shardlab::`` ops of the graph, ``shardlab/comm/collectives.py``), and so are the
      messages of its backward;
    * a patched ``torch.nn.functional`` call (a convolution's halos, ring attention,
      cross-entropy's sums) is one call in dynamo's graph (torch's
      ``nonstrict_trace``), which AOTAutograd traces through, forward and backward;
    * the messages of a graph are chained by a token in the order they were traced,
      the same on every rank, so no compiler can reorder them (a hang);
    * in an activation-checkpointed region (``torch.utils.checkpoint``, as
      ``transformers`` models call it) a message's outputs are saved, not sent again by
      the backward's recomputation (torch's partitioner would, and failed on every rank:
      ``shardlab/comm/collectives.py``). On torch 2.13-2.14 attention runs eagerly
      there (AOTAutograd saves the mesh with its random kernels' state).

    What reads data stays eager (a graph break): ``.item()``, random draws (dropout), a
    layout of symbolic sizes. Errors that eager code raises
    after reading data (a target out of bounds) are checked when the graph runs, on every
    rank (``torch._assert_async``: a ``RuntimeError``). Before torch 2.13 (no traceable
    ShardTensor) the scope changes nothing. What it decides is read when torch.compile
    traces: a graph compiled inside it keeps its messages when called outside.

    What torch's compilers get wrong on one device they get wrong here too, where the
    default design ran the op eagerly: inductor's gradient of ``avg_pool2d(...,
    ceil_mode=True)`` divides an overhanging window by the whole kernel
    (pytorch/pytorch#198119: EfficientNet's pooler).

    Compiled graphs are cached on disk by what dynamo traced (torch's AOTAutograd and
    inductor caches), which does not show what shardlab put in them: inside the scope the
    cache key also holds a hash of shardlab's source (``torch.compiler.config``'s
    ``cache_key_tag``), so no graph of another shardlab version is reused. Both patches
    (that tag, the partitioner's pass) are undone when the scope closes.
    """

    def __enter__(self):
        tag = torch.compiler.config.cache_key_tag
        stack = contextlib.ExitStack()
        stack.enter_context(
            torch.compiler.config.patch(cache_key_tag=f"{tag}shardlab:{_source_hash()}")
        )
        stack.enter_context(collectives.saved_in_checkpointed_regions())
        _IN_GRAPHS.append(stack)
        return self

    def __exit__(self, *exc):
        _IN_GRAPHS.pop().__exit__(*exc)


@functools.cache
def _source_hash() -> str:
    """A hash of shardlab's Python source (what decides the graphs it traces)."""
    import hashlib
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + path.read_bytes())
    return digest.hexdigest()[:16]


def dynamo_blocks(values) -> bool:
    """Is a ShardTensor among ``values`` one dynamo runs on (its fake blocks; not
    AOTAutograd's functional ones, nor real ones)?"""
    from torch._subclasses.fake_tensor import FakeTensor

    return any(type(getattr(v, "_local_tensor", None)) is FakeTensor for v in values)


def agree(name: str, values, failed: BaseException | None) -> None:
    """Inside :class:`messages_in_graphs`, after dynamo ran the sharded ``F.<name>`` on
    its fake blocks (where it decides where a graph breaks): did it run on every rank? One
    all-reduce over the mesh at compile time (every rank's dynamo runs the same calls of
    the same frames; AOTAutograd's tracing is not asked, since one rank may take its graph
    from a cache), then every rank raises if one failed, so all break their graphs at this
    call (a rank that traced it alone would post messages the others do not)."""
    import torch.distributed as dist

    mesh = next((a.device_mesh for a in values if hasattr(a, "device_mesh")), None)
    if mesh is None or mesh.size() == 1:
        if failed is not None:
            raise failed
        return
    with outside_modes():
        device = "cpu" if mesh.device_type == "cpu" else torch.device(mesh.device_type)
        ok = torch.tensor([0 if failed is not None else 1], device=device)
        for m in range(mesh.ndim):
            dist.all_reduce(ok, dist.ReduceOp.MIN, group=mesh.get_group(m))
        ok = bool(ok.item())
    if failed is not None:
        raise failed
    if not ok:
        raise RuntimeError(
            f"shardlab: another rank could not trace torch.nn.functional.{name} into a "
            "compiled graph: every rank runs it eagerly"
        )


def in_graphs() -> bool:
    """Inside :class:`messages_in_graphs` on a torch that traces ShardTensors."""
    return TRACEABLE and bool(_IN_GRAPHS)


_QUIET: list = []  # not empty while dynamo runs an op on cut blocks: a message breaks


class sends_break:
    """While dynamo runs an op on fake blocks cut over several ranks: a message that op
    would post breaks the graph (:func:`shardlab.comm.collectives.all_reduce_` ...), so
    the op runs eagerly. Elsewhere (AOTAutograd's guesses of a gradient's layout, its
    tracing) a message is a node of the graph."""

    def __enter__(self):
        _QUIET.append(True)

    def __exit__(self, *exc):
        _QUIET.pop()


def breaks_on_messages() -> bool:
    return bool(_QUIET)


_GUESSES: list = []  # not empty while AOTAutograd guesses a gradient's layout


class guessing:
    """AOTAutograd guesses the layout of an output's gradient (a Partial output's is
    made Replicate, ``ShardTensor.__coerce_tangent_metadata__``): the message that
    guess traces is metadata only, in no graph that runs."""

    def __enter__(self):
        _GUESSES.append(True)

    def __exit__(self, *exc):
        _GUESSES.pop()


def message_traced(t) -> None:
    """A message about to be traced on the fake block ``t`` (a group of several ranks).

    Under ``torch.compile`` no graph may hold it (the module docstring says why):

    * dynamo runs an op on its fake blocks (an entry point it traces into, outside
      :class:`sends_break`): a graph break, the op runs eagerly;
    * AOTAutograd traces the graph (functional blocks) and meets a message dynamo never
      saw: dynamo runs only the forward, and a backward may move a gradient (SigLIP's
      did, before ``select_backward`` kept its new dim whole). dynamo's graph is already
      made, so the whole frame runs eagerly (dynamo's ``SkipFrame``; the functions it
      calls are compiled on their own).

    Every rank of the group decides alike (the layouts are the same everywhere), so the
    ranks' graphs hold the same ops and post their messages in the same order. Outside
    ``torch.compile`` (``aot_function``, ``make_fx``) the message is a node of the graph,
    as :mod:`shardlab.comm.collectives` describes."""
    from torch._guards import TracingContext

    if _GUESSES or _IN_GRAPHS or TracingContext.try_get() is None:
        return
    from torch._subclasses.fake_tensor import FakeTensor

    if type(t) is FakeTensor:
        graph_break("a message between ranks")
    from torch._dynamo.exc import SkipFrame

    raise SkipFrame(
        "shardlab: a message between ranks would be traced into a compiled graph (a "
        "backward dynamo did not run): this frame runs eagerly"
    )


SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)  # dynamo's symbolic scalars

_SAVES_MESH = _compat.saves_mesh_for_random_ops()  # 2.13-2.14: such an op runs eagerly


_RANDOM_CALLS = ("scaled_dot_product_attention", "multi_head_attention_forward")


def random_in_checkpointed_region(name: str) -> None:
    """Inside :class:`messages_in_graphs` a patched ``F`` call is traced whole: on torch
    2.13-2.14 one whose kernels are random-tagged (attention's) raises in a checkpointed
    region, so that every rank runs it eagerly (:data:`_SAVES_MESH`)."""
    if _SAVES_MESH and name in _RANDOM_CALLS and _in_checkpointed_region():
        raise NotImplementedError(
            f"shardlab: torch.nn.functional.{name} in an activation-checkpointed region "
            "runs eagerly on torch 2.13-2.14 (AOTAutograd saves the mesh as a tensor)"
        )


def _in_checkpointed_region() -> bool:
    """Is dynamo tracing the body of ``torch.utils.checkpoint`` (its higher-order op)?"""
    from torch._dynamo.symbolic_convert import InstructionTranslator

    tx = InstructionTranslator.current_tx()
    tracer = getattr(getattr(tx, "output", None), "current_tracer", None)
    while tracer is not None:
        if "checkpoint" in str(getattr(tracer, "source_target", "")):
            return True
        tracer = getattr(tracer, "parent", None)
    return False


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
