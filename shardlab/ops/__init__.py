"""Sharded implementations of ``torch.nn.functional`` ops, one family per module.

Importing this package registers every handler in :mod:`.registry`.
"""

from shardlab.ops import attention, conv, cross_entropy, pad  # noqa: F401  (register handlers)
from shardlab.ops.registry import HANDLERS, register, supported

__all__ = ["HANDLERS", "register", "supported"]
