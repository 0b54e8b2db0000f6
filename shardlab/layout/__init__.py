"""Pure layout arithmetic: shard sizes, redistribution boxes and halo plans (no process group).

* ``shards``        uneven shard sizes on 1-D / 2-D meshes (:class:`ShardLayout`)
* ``redistribute``  which global boxes move when a layout changes
* ``conv``          halo plans for a sliding-window op along one sharded dim
* ``conv_nd``       the same on several sharded dims (product of 1-D plans)

Nothing here communicates: these are the plans the ops and the figures follow. Layer 0
(**layout** → ``comm`` → ``tensor`` → ``engine`` → ``ops`` → ``patch``): it imports nothing
of shardlab but ``shardlab._compat``; every layer above may import it.
"""

from ._build import chunk_sizes
from .conv import (
    OVERHANG,
    PAD,
    ConvPlan,
    Rows,
    conv_out_length,
    conv_plan,
    same_padding,
)
from .conv_nd import Block, ConvPlanND, conv_plan_nd
from .redistribute import Move, moved_elements, redistribute_plan
from .shards import ShardLayout, format_sizes, offsets, owner_of

__all__ = [
    "OVERHANG",
    "PAD",
    "Block",
    "ConvPlan",
    "ConvPlanND",
    "Move",
    "Rows",
    "ShardLayout",
    "chunk_sizes",
    "conv_out_length",
    "conv_plan",
    "conv_plan_nd",
    "format_sizes",
    "moved_elements",
    "offsets",
    "owner_of",
    "redistribute_plan",
    "same_padding",
]
