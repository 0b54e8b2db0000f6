"""Sharded implementations of ``torch.nn.functional`` ops, one family per module.

Layer 5 (``layout`` → ``comm`` → ``tensor`` → ``engine`` → **ops** → ``patch``): it
may import everything below it, nothing above. Importing this package imports the engine
(which installs itself on the class) and registers every family in the one registry
(:mod:`shardlab.engine.registry`: ``F.conv2d`` …, and the calls taken over at
``__torch_function__``: losses, quantiles, ``Tensor.unfold``).
"""

import shardlab.engine  # noqa: F401  (installs the dispatcher on the class)
from shardlab.ops import (  # noqa: F401  (each module registers its handlers)
    _attn_fused,
    attention,
    conv,
    cross_entropy,
    doors,
    dropout,
    fft,
    interpolate,
    linear,
    losses,
    lrn,
    mha,
    neighborhood,
    norm,
    pad,
    pool,
    quantile,
    random_like,
    unfold,
)
from shardlab.ops.registry import register, rule, supported

__all__ = ["register", "rule", "supported"]
