"""The rank runtime: a persistent pool of ranks for notebooks, tests and scripts."""

from shardlab.runtime.context import RankContext, this_rank
from shardlab.runtime.errors import RankError
from shardlab.runtime.pool import Ranks

__all__ = ["RankContext", "RankError", "Ranks", "this_rank"]
