"""shardlab: learn and do domain-, tensor- and sequence-parallel PyTorch.

Importing shardlab is cheap (torch is imported when first needed), so that a
pool of ranks can import torch in its forkserver while the kernel does too.
"""

import importlib

from shardlab.runtime import RankContext, RankError, Ranks, this_rank

__version__ = "0.1.0"

__all__ = ["RankContext", "RankError", "Ranks", "this_rank", "trace", "__version__"]

_LAZY = {"trace": "shardlab.trace"}  # name -> module (imports torch)


def __getattr__(name):
    if name in _LAZY:
        value = importlib.import_module(_LAZY[name])
        globals()[name] = value
        return value
    raise AttributeError(f"module 'shardlab' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


def load_ipython_extension(ipython):
    """``%load_ext shardlab``: registers the ``%%ranks`` cell magic."""
    from shardlab.runtime.magic import register

    register(ipython)
