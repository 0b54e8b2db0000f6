"""Sharded implementations of ``torch.nn.functional`` ops, one family per module.

Importing this package registers every handler in :mod:`.registry`.
"""

from shardlab.ops import conv, pad  # noqa: F401  (register their handlers)
from shardlab.ops.registry import HANDLERS, register, supported

__all__ = ["HANDLERS", "register", "supported"]
