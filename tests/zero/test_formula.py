"""``shardlab.zero.predict`` against numbers derived by hand and the ZeRO paper's own."""

from __future__ import annotations

import pytest

from shardlab.zero import ADAM_MIXED, predict


def test_the_papers_figure_1_in_mixed_precision():
    # ZeRO paper, figure 1: Ψ = 7.5 B parameters, N = 64 ranks, K = 12 (mixed-precision Adam)
    psi, n = 7_500_000_000, 64
    per_rank = [sum(predict(psi, n, s, **ADAM_MIXED).paper) / 1e9 for s in range(4)]
    assert per_rank == pytest.approx([120, 31.4, 16.6, 1.88], abs=0.05)  # GB, as printed there


def test_the_float32_table_by_hand():
    # Ψ = 1000 float32 parameters on N = 4: p = g = 4 bytes, Adam K = 8 (two moments)
    want = {  # (params, grads, optim) kept between steps, as torch builds the stage
        0: (4000, 4000, 8000),
        1: (4000, 4000, 2000),  # the optimizer state cut: 8000 / 4
        2: (1000, 1000, 2000),  # + the gradients; torch's stage 2 cuts the parameters too
        3: (1000, 1000, 2000),
    }
    for stage, (p, g, k) in want.items():
        pred = predict(1000, 4, stage)
        assert (pred.params, pred.grads, pred.optim) == (p, g, k), stage
        assert pred.states == p + g + k
    assert predict(1000, 4, 2).paper == (4000, 1000, 2000)  # the paper's: parameters whole
    assert predict(1000, 4, 3).paper == (1000, 1000, 2000)
    assert predict(1000, 1, 3).paper == predict(1000, 1, 0).paper  # one rank: nothing to cut


def test_the_peak_terms_by_hand():
    # Ψ = 1000 on N = 4; units: three blocks of 400, 300, 200 parameters, the root's own
    # 100; activations 5000 bytes. The peak: at the start of backward
    units, a = [400, 300, 200, 100], 5000
    assert predict(1000, 4, 0, units=units, activations=a).peak == 16000 + a  # states
    assert predict(1000, 4, 1, units=units, activations=a).peak == 10000 + a
    # stage 2: shard 1000 + optim 2000, every parameter whole 4000, the root's and the
    # biggest block's gradients whole 4 x (100 + 400)
    assert predict(1000, 4, 2, units=units, activations=a).peak == 3000 + 4000 + 2000 + a
    # stage 3: the root and the two biggest blocks whole, 4 x (100 + 400 + 300)
    assert predict(1000, 4, 3, units=units, activations=a).peak == 3000 + 3200 + 2000 + a
    # no units given: one unit (the root) of Ψ; gathered whole as at stage 2
    assert predict(1000, 4, 3).peak == predict(1000, 4, 2).peak == 3000 + 4000 + 4000


def test_the_messages_of_a_step():
    # bytes a rank hands in: all-reduce its whole gradients; all-gather its shard; reduce-
    # scatter its whole gradients; ZeroRedundancyOptimizer broadcasts every parameter once
    assert predict(1000, 4, 0).messages == {"all_reduce": 4000}
    assert predict(1000, 4, 1).messages == {"all_reduce": 4000, "broadcast": 4000}
    assert predict(1000, 4, 2).messages == {"all_gather": 1000, "reduce_scatter": 4000}
    assert predict(1000, 4, 3).messages == {"all_gather": 2000, "reduce_scatter": 4000}


@pytest.mark.parametrize(
    "args, kwargs, word",
    [
        ((0, 4, 1), {}, "params"),
        ((1000, 0, 1), {}, "ranks"),
        ((1000, 4, 5), {}, "stage"),
        ((1000, 4, 3), {"units": [500, 400]}, "units"),
        ((1000, 4, 3), {"optim_bytes": 1.5}, "optim_bytes"),
    ],
)
def test_errors_name_the_argument(args, kwargs, word):
    with pytest.raises(ValueError, match=word):
        predict(*args, **kwargs)
