"""Messages inside compiled graphs (opt-in: :class:`messages_in_graphs`), and the breaks
that keep them out by default (:class:`sends_break`, :func:`message_traced`).
"""

from __future__ import annotations

import contextlib
import functools

import torch

from shardlab import _compat
from shardlab.comm import collectives
from shardlab.comm.traced import TRACEABLE, graph_break, outside_modes

__all__ = ["agree", "breaks_on_messages", "dynamo_blocks", "guessing", "in_graphs"]
__all__ += ["message_traced", "messages_in_graphs", "random_in_checkpointed_region"]
__all__ += ["sends_break"]


_QUIET: list = []  # not empty while dynamo runs an op on cut blocks: a message breaks
_GUESSES: list = []  # not empty while AOTAutograd guesses a gradient's layout
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
