"""shardlab: learn and do domain-, tensor- and sequence-parallel PyTorch."""

from shardlab.runtime import RankContext, RankError, Ranks, this_rank

__version__ = "0.1.0"

__all__ = ["RankContext", "RankError", "Ranks", "this_rank", "__version__"]


def load_ipython_extension(ipython):
    """``%load_ext shardlab``: registers the ``%%ranks`` cell magic."""
    from shardlab.runtime.magic import register

    register(ipython)
