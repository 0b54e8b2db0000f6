"""Sharded implementations of ``torch.nn.functional`` ops, one family per module.

Importing this package registers every handler in :mod:`.registry`.
"""

from shardlab.ops import (  # noqa: F401  (each module registers its handlers)
    attention,
    conv,
    cross_entropy,
    dropout,
    interpolate,
    linear,
    mha,
    neighborhood,
    norm,
    pad,
    pool,
    unfold,
)
from shardlab.ops.registry import HANDLERS, register, supported

__all__ = ["HANDLERS", "register", "supported"]
