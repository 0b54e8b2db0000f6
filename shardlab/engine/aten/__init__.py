"""aten-level rules for ShardTensors, one op family per module (each registers its ops
in :mod:`shardlab.engine.registry`); :mod:`shardlab.engine.dispatch` routes every op
through them."""

from . import (  # noqa: F401  (each module registers its rules)
    addbmm,
    agreement,
    batched,
    diagonal,
    dim_ops,
    fft,
    foreach,
    hashing,
    householder,
    indexing,
    inplace_views,
    linalg,
    lu,
    masked_index,
    moments,
    prims,
    reductions,
    scatter,
    selection,
    shaping,
    take,
    views,
)
