"""shardlab: learn and do domain-, tensor- and sequence-parallel PyTorch.

Importing shardlab is cheap (torch is imported when first needed), so that a
pool of ranks can import torch in its forkserver while the kernel does too.
"""

import importlib

from shardlab import _layers
from shardlab._compat import check_torch_version

check_torch_version()  # one clear message for an unsupported torch, before anything else

from shardlab.runtime import RankContext, RankError, Ranks, this_rank  # noqa: E402
from shardlab.runtime.launch import preload_on_ranks  # noqa: E402

# what a rank's first sharded call imports (the engine and its rules, the patch, the
# tracer, DTensor, dynamo: about a second of CPU a rank), imported once by the pool's
# forkserver before it forks the ranks
preload_on_ranks("torch.distributed.tensor", "torch._dynamo", "shardlab.ops", "shardlab.patch",
                 "shardlab.trace")  # fmt: skip

__version__ = "0.1.0"

__all__ = [
    "ExpertParallel",
    "GatherError",
    "GatherWarning",
    "RankContext",
    "RankError",
    "Ranks",
    "ShardTensor",
    "cost",
    "disable",
    "distribute",
    "enable",
    "explain",
    "gathers",
    "messages_in_graphs",
    "patched",
    "scatter_tensor",
    "this_rank",
    "trace",
    "zero",
    "__version__",
]

# name -> module that defines it (these import torch, so they load on first use)
_LAZY = {
    "trace": "shardlab.trace",
    "cost": "shardlab.cost",
    "explain": "shardlab.explainer.explain",
    "ShardTensor": "shardlab.tensor",
    "distribute": "shardlab.tensor",
    "scatter_tensor": "shardlab.tensor",
    "enable": "shardlab.patch",
    "disable": "shardlab.patch",
    "patched": "shardlab.patch",
    "messages_in_graphs": "shardlab.comm.graphs",
    "gathers": "shardlab.comm.gathers",
    "GatherWarning": "shardlab.comm.gathers",
    "GatherError": "shardlab.comm.gathers",
    "ExpertParallel": "shardlab.experts",
    "zero": "shardlab.zero",
}


def _complete_the_class():
    """The engine and the ops above :mod:`shardlab.tensor` (they install themselves on it);
    while the engine is being imported (it imports the class), once it is done."""
    import sys

    if "shardlab.engine" not in sys.modules:
        import shardlab.ops  # noqa: F401  (imports shardlab.engine)


def _complete_the_engine():
    import shardlab.ops  # noqa: F401


_layers.after("shardlab.tensor", _complete_the_class)
_layers.after("shardlab.engine", _complete_the_engine)


def __getattr__(name):
    if name in _LAZY:
        module = importlib.import_module(_LAZY[name])
        value = module if module.__name__ == f"shardlab.{name}" else getattr(module, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'shardlab' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


def load_ipython_extension(ipython):
    """``%load_ext shardlab``: registers the ``%%ranks`` cell magic."""
    from shardlab.runtime.magic import register

    register(ipython)
