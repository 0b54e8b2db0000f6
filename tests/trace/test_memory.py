"""``LiveBytes``: the storages an op makes, not the ones it views."""

from __future__ import annotations

import torch

from shardlab.trace.memory import LiveBytes


def test_a_view_of_a_parameter_made_before_is_not_counted():
    lin = torch.nn.Linear(64, 32)  # weight: 64 x 32 x 4 = 8192 bytes, made before the block
    x = torch.randn(4, 64)
    with LiveBytes() as mem:
        y = lin(x)  # addmm(bias, x, weight.t()): t() views the parameter's storage
    assert mem.now == y.untyped_storage().nbytes() == 4 * 32 * 4  # the output alone
    assert mem.peak == 4 * 32 * 4
