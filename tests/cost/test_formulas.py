"""The formulas of shardlab/cost/formulas.py against numbers derived by hand, for 2, 3 and
4 ranks; what ``Event.bytes`` means for each kind; the errors name the argument."""

from __future__ import annotations

import math

import pytest

from shardlab.cost import Link, coefficients, formula_bytes, wire_bytes

LINK = Link(alpha=10e-6, beta=1e-9)  # 10 µs per message, 1 GB/s


# (kind, algorithm, n, p) -> (a, b), worked out from the schedules:
# ring all-reduce: p-1 steps of reduce-scatter and p-1 of all-gather, n/p bytes each;
# tree all-reduce: ⌈log2 p⌉ steps up and down, n bytes each; ring all-gather of the
# whole n: p-1 steps of n/p; binomial broadcast: ⌈log2 p⌉ steps of n.
HAND = [
    ("send", None, 1000, 2, (1, 1000)),
    ("recv", None, 1000, 4, (1, 1000)),
    ("all_reduce", "ring", 1200, 2, (2, 1200)),  # 2·1 steps of 600
    ("all_reduce", "ring", 1200, 3, (4, 1600)),  # 2·2 steps of 400
    ("all_reduce", "ring", 1200, 4, (6, 1800)),  # 2·3 steps of 300
    ("all_reduce", "tree", 1200, 2, (2, 2400)),
    ("all_reduce", "tree", 1200, 3, (4, 4800)),  # ⌈log2 3⌉ = 2
    ("all_reduce", "tree", 1200, 4, (4, 4800)),
    ("all_gather", None, 1200, 2, (1, 600)),
    ("all_gather", None, 1200, 3, (2, 800)),
    ("all_gather", None, 1200, 4, (3, 900)),
    ("reduce_scatter", None, 1200, 4, (3, 900)),
    ("all_to_all", None, 1200, 3, (2, 800)),
    ("broadcast", None, 1200, 2, (1, 1200)),
    ("broadcast", None, 1200, 3, (2, 2400)),
    ("broadcast", None, 1200, 4, (2, 2400)),
    ("reduce", None, 1200, 4, (2, 2400)),
    ("scatter", None, 1200, 4, (2, 900)),
    ("gather", None, 1200, 3, (2, 800)),
    ("barrier", None, 0, 4, (2, 0)),
]


@pytest.mark.parametrize("kind,algorithm,n,p,want", HAND)
def test_coefficients_by_hand(kind, algorithm, n, p, want):
    a, b = coefficients(kind, n, p, algorithm)
    assert a == want[0] and math.isclose(b, want[1])


def test_times_by_hand():
    # ring all-reduce of 1 MB on 4 ranks: 6 α + 1.5 MB β = 60 µs + 1.5 ms
    a, b = coefficients("all_reduce", 1_000_000, 4)
    assert math.isclose(LINK.time(a, b), 6 * 10e-6 + 1.5e-3)
    assert math.isclose(LINK.time(*coefficients("send", 1000, 2)), 10e-6 + 1e-6)
    assert math.isclose(LINK.bandwidth, 1e9) and Link(1e-6, 0).bandwidth == math.inf


def test_one_rank_sends_nothing():
    for kind in ("all_reduce", "all_gather", "broadcast", "all_to_all", "barrier"):
        assert coefficients(kind, 4096, 1) == (0, 0)


def test_monotone_in_bytes_and_ranks():
    for kind in ("send", "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"):
        for p in (2, 3, 4, 8, 64):
            times = [LINK.time(*coefficients(kind, n, p)) for n in (0, 1, 100, 10**4, 10**6)]
            assert times == sorted(times) and times[0] < times[-1], (kind, p)
        if kind != "send":
            times = [LINK.time(*coefficients(kind, 10**6, p)) for p in (2, 3, 4, 8, 64, 512)]
            assert times == sorted(times), kind


def test_ring_bandwidth_term_approaches_twice_the_tensor():
    # the ring all-reduce sends 2(p-1)/p·n per rank: at most 2n, whatever p
    assert [wire_bytes("all_reduce", 1000, p) for p in (2, 4, 1000)] == [1000, 1500, 1998]


def test_event_bytes_to_the_formulas_n():
    # all_gather's Event.bytes is this rank's shard: the formula's n is the gathered whole
    assert formula_bytes("all_gather", 100, 4) == 400
    assert formula_bytes("scatter", 100, 4) == 400 and formula_bytes("gather", 100, 3) == 300
    # reduce_scatter's is its whole input, all_reduce's and all_to_all's the whole tensor
    for kind in ("reduce_scatter", "all_reduce", "all_to_all", "broadcast", "send", "recv"):
        assert formula_bytes(kind, 100, 4) == 100
    # so an all-gather of 100-byte shards on 4 ranks sends 3 shards: 300 bytes per rank,
    # as a reduce-scatter of a 400-byte input does
    assert wire_bytes("all_gather", 100, 4) == wire_bytes("reduce_scatter", 400, 4) == 300


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match="kind: 'allreduce'"):
        coefficients("allreduce", 10, 2)
    with pytest.raises(ValueError, match="algorithm: 'tree' is not one for all_gather"):
        coefficients("all_gather", 10, 2, "tree")
    with pytest.raises(ValueError, match="n: the bytes"):
        coefficients("all_reduce", -1, 2)
    with pytest.raises(ValueError, match="p: a group"):
        coefficients("all_reduce", 10, 0)
    with pytest.raises(ValueError, match="beta must be"):
        Link(1e-6, -1.0)
