"""The rank runtime: a persistent pool of ranks for notebooks, tests and scripts.

Below the tensor layers, beside ``shardlab.layout``: it imports nothing of shardlab but
``shardlab._compat`` (and the kernel's side imports no torch); the tracer and the
tensor layers above may import it.
"""

from shardlab.runtime.context import RankContext, this_rank
from shardlab.runtime.errors import RankError
from shardlab.runtime.pool import Ranks

__all__ = ["RankContext", "RankError", "Ranks", "this_rank"]
