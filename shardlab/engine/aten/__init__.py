"""aten-level rules for ShardTensors, one op family per module (each registers its ops
in :mod:`shardlab.engine.registry`); :mod:`shardlab.engine.dispatch` routes every op
through them."""

from . import (  # noqa: F401  (each module registers its rules)
    addbmm,
    agreement,
    batched,
    diagonal,
    dim_ops,
    distances,
    fft,
    foreach,
    group_norm,
    hashing,
    histogram,
    householder,
    indexing,
    inplace_views,
    linalg,
    lu,
    margin,
    masked_index,
    moments,
    prims,
    reductions,
    scatter,
    segment,
    selection,
    shaping,
    take,
    trilinear,
    views,
)
