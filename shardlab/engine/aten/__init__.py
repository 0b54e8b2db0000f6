"""aten-level rules for ShardTensors, one op family per module (each registers its ops
in :mod:`.registry`); :mod:`shardlab.engine.dispatch` routes every op through them."""

from . import (  # noqa: F401  (each module registers its rules)
    attention,
    batched,
    diagonal,
    dim_ops,
    foreach,
    indexing,
    matmul,
    reductions,
    shaping,
    views,
)
from .registry import HANDLERS, register

__all__ = ["HANDLERS", "register"]
