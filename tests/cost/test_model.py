"""The cost model and its fit (shardlab/cost/model.py), without processes."""

from __future__ import annotations

import json
import math
import random

import pytest

from shardlab.cost import CostModel, Link, coefficients, fit_link
from shardlab.cost.model import fit_model


def test_fit_recovers_alpha_and_beta_from_exact_times():
    link = Link(alpha=50e-6, beta=2e-9)
    rows = [(a, b, link.time(a, b)) for a, b in [(1, 16), (1, 4096), (1, 1 << 20), (2, 8)]]
    got = fit_link(rows)
    assert math.isclose(got.alpha, link.alpha, rel_tol=1e-9)
    assert math.isclose(got.beta, link.beta, rel_tol=1e-9)


def test_fit_is_relative_and_tolerates_noise():
    rng = random.Random(0)
    link = Link(alpha=100e-6, beta=1e-9)
    rows = [
        (1, n, link.time(1, n) * rng.uniform(0.9, 1.1))
        for n in (16, 256, 4096, 65536, 1 << 20, 1 << 22)
        for _ in range(3)
    ]
    got = fit_link(rows)
    # an absolute fit would leave α to the big messages' noise (~400 µs): relative keeps it
    assert 0.8 < got.alpha / link.alpha < 1.2 and 0.8 < got.beta / link.beta < 1.2


def test_fit_never_negative():
    # times that fall with size (noise at small sizes): a free fit would make β < 0
    got = fit_link([(1, 16, 3e-3), (1, 4096, 2e-3), (1, 65536, 1e-3)])
    assert got.alpha > 0 and got.beta == 0
    # times that grow faster than a line through 0: α would be < 0
    got = fit_link([(1, 1000, 1e-6), (1, 2000, 4e-6), (1, 4000, 16e-6)])
    assert got.alpha == 0 and got.beta > 0
    with pytest.raises(ValueError, match="rows: no measured time"):
        fit_link([(1, 16, 0.0)])


def test_fit_model_takes_the_median_of_repeats():
    link = Link(20e-6, 1e-9)
    rows = []
    for n in (16, 4096, 1 << 20):
        a, b = coefficients("all_reduce", n, 4)
        rows += [(n, 4, link.time(a, b)), (n, 4, link.time(a, b)), (n, 4, 1.0)]  # 1 outlier
    model = fit_model({"all_reduce": rows, "p2p": [(n, 2, link.time(1, n)) for n in (8, 8192)]})
    assert math.isclose(model.links["all_reduce"].alpha, 20e-6, rel_tol=1e-6)
    assert model.samples["all_reduce"][0][2] == link.time(*coefficients("all_reduce", 16, 4))
    assert model.fit_error()["all_reduce"] < 1e-6


def test_model_time_uses_the_kinds_link_and_formula():
    p2p, ar = Link(10e-6, 1e-9), Link(30e-6, 2e-9)
    model = CostModel({"p2p": p2p, "all_reduce": ar}, where="by hand")
    assert math.isclose(model.time("send", 1000, 2), 10e-6 + 1000e-9)
    assert math.isclose(model.time("all_reduce", 1200, 4), 6 * 30e-6 + 1800 * 2e-9)
    # no link of its own: the p2p link, with the kind's formula (all-gather of 100 B shards)
    assert math.isclose(model.time("all_gather", 100, 4), 3 * 10e-6 + 300e-9)
    tree = CostModel({"p2p": p2p, "all_reduce": ar}, {"all_reduce": "tree"})
    assert math.isclose(tree.time("all_reduce", 1200, 4), 4 * 30e-6 + 4800 * 2e-9)
    assert "all_reduce" in str(model) and "by hand" in str(model)


def test_uniform_and_round_trip():
    model = CostModel.uniform(Link(5e-6, 1 / 100e9), "a network", all_reduce="tree")
    assert model.algorithm("all_reduce") == "tree" and model.algorithm("send") == "direct"
    again = CostModel.from_dict(json.loads(json.dumps(model.to_dict())))
    assert again == model


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match="links: a cost model needs a 'p2p' link"):
        CostModel({"all_reduce": Link(1e-6, 1e-9)})
    with pytest.raises(ValueError, match="algorithm: 'tree'"):
        CostModel.uniform(Link(1e-6, 1e-9), broadcast="tree", all_gather="tree")
