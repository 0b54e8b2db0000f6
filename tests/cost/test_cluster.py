"""The projection onto a cluster (shardlab/cost/cluster.py): each scaling rule, the link a
group spans, a step read from a trace written by hand, and the bars (explore.py)."""

from __future__ import annotations

import math

import pytest

from shardlab.cost import (
    Cluster,
    Degrees,
    Growth,
    Step,
    Traffic,
    plot_projection,
    project,
    projection_explorer,
    recorded_step,
    rule_of,
    scale,
    spans_nodes,
)
from shardlab.trace import Event

G = Growth(tokens=4, width=2, layers=3, dtype=0.5)


def row(rule, dim="domain", kind="all_reduce", nbytes=1000, count=2):
    return Traffic(dim, kind, rule, nbytes, count)


@pytest.mark.parametrize(
    "rule, dim, kind, target, want",
    [
        # halo: the tile's edge, whatever the domain degree: √tokens · width · dtype
        ("halo", "domain", "p2p", Degrees(domain=64), (1000 * 2 * 2 * 0.5, 6, ("domain",))),
        # ring: a block of tokens · width · dtype / t; one message per other rank
        ("ring", "sequence", "p2p", Degrees(sequence=9, tensor=2),
         (1000 * 4 * 2 * 0.5 / 2, 2 * 3 * 8 / 3, ("sequence",))),
        # activation: a rank's whole activation, all-reduced over the tensor group
        ("activation", "tensor", "all_reduce", Degrees(tensor=8),
         (1000 * 4 * 2 * 0.5, 6, ("tensor",))),
        # gradients: the parameters over t, over every rank that holds the same ones
        ("gradients", "domain", "all_reduce", Degrees(domain=4, data=8, tensor=2),
         (1000 * 4 * 3 * 0.5 / 2, 2, ("sequence", "domain", "data"))),
        ("stats", "domain", "all_reduce", Degrees(domain=8), (1000 * 2 * 0.5, 6, ("domain",))),
        ("fixed", "domain", "all_reduce", Degrees(domain=8), (1000, 2, ("domain",))),
        ("input", "domain", "broadcast", Degrees(domain=8), (0.0, 0.0, ("domain",))),
    ],
)  # fmt: skip
def test_each_rule_scales_as_its_table_says(rule, dim, kind, target, want):
    recorded = Degrees(**{dim: 4})
    got = scale(row(rule, dim, kind), recorded, target, G)
    assert got[0] == pytest.approx(want[0]) and got[1] == pytest.approx(want[1])
    assert got[2] == want[2]


def test_a_dim_of_degree_one_sends_nothing_but_gradients_still_reduce_over_data():
    assert scale(row("halo", kind="p2p"), Degrees(domain=4), Degrees(data=8))[1] == 0
    assert scale(row("gradients"), Degrees(domain=4), Degrees(data=8))[1] == 2
    assert scale(row("gradients"), Degrees(domain=4), Degrees(tensor=8))[1] == 0


@pytest.mark.parametrize(
    "dims, degrees, across",
    [
        (("tensor",), Degrees(tensor=8, data=64), False),  # the innermost 8: one node
        (("data",), Degrees(tensor=8, data=64), True),
        (("domain",), Degrees(domain=8, data=8), False),
        (("domain",), Degrees(tensor=2, domain=8), True),  # stride 2, 8 of them: 16 ranks
        (("sequence", "domain", "data"), Degrees(domain=8), False),
        (("sequence", "domain", "data"), Degrees(domain=8, data=2), True),
    ],
)
def test_a_group_spans_nodes_when_its_dims_reach_past_one_node(dims, degrees, across):
    assert spans_nodes(dims, degrees, 8) is across


def test_the_cluster_names_the_source_of_every_parameter_and_its_assumptions():
    c = Cluster()
    lines = c.assumptions()
    assert len(lines) == len(Cluster.SOURCES) == 8
    assert sum("assumed" in line for line in lines) == len(Cluster.ASSUMED)
    assert c.link(False).bandwidth == pytest.approx(450e9 * 0.8)
    assert c.link(True).alpha == 10e-6 and c.compute_time(989e12 * 0.4) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="mfu"):
        Cluster(mfu=1.5)
    with pytest.raises(ValueError, match="ib_bandwidth"):
        Cluster(ib_bandwidth=0)


def test_project_by_hand_a_halo_and_a_gradient_all_reduce():
    rows = [row("halo", kind="p2p", nbytes=1e6, count=1), row("gradients", nbytes=8e6, count=1)]
    step = Step("toy", rows, Degrees(domain=4), 1e12)
    c = Cluster()
    one = project(step, c, Degrees(domain=8))  # one node: NVLink
    nv, ib = c.link(False), c.link(True)
    assert one.comm["domain"] == pytest.approx(nv.alpha + 1e6 * nv.beta)
    assert one.comm["data"] == pytest.approx(14 * nv.alpha + 2 * 7 / 8 * 8e6 * nv.beta)
    assert one.compute == pytest.approx(1e12 / (989e12 * 0.4))
    many = project(step, c, Degrees(domain=8, data=8))  # 64 ranks: the gradients over IB
    assert many.comm["domain"] == one.comm["domain"]  # halos stay within the node
    assert many.comm["data"] == pytest.approx(126 * ib.alpha + 2 * 63 / 64 * 8e6 * ib.beta)
    assert many.communication > one.communication and many.compute == one.compute
    assert many.exposed == max(many.communication - many.compute, 0)
    with pytest.raises(ValueError, match="no tensor messages"):
        project(step, c, Degrees(domain=8, tensor=2))


def ev(rank, seq, kind, nbytes, start, end, peer=None, label=""):
    return Event(rank, seq, kind, kind, (0, 1, 2), peer, nbytes, "float64", ((nbytes // 8,),),
                 label, mesh_dim=0, start=start, duration=1e-6, end=end)  # fmt: skip


def test_recorded_step_counts_one_exchange_per_run_in_flight_and_names_each_rule():
    events = [  # rank 1, in the middle of a line of 3: both neighbours at once
        ev(1, 0, "send", 800, 0.0, 1.0, 0, "conv2d.halo forward"),
        ev(1, 1, "send", 800, 0.1, 1.0, 2, "conv2d.halo forward"),
        ev(1, 2, "recv", 800, 0.2, 1.0, 0, "conv2d.halo forward"),
        ev(1, 3, "recv", 800, 0.3, 1.0, 2, "conv2d.halo forward"),
        ev(1, 4, "all_reduce", 64, 2.0, 3.0, label="batch_norm.stats forward"),
        ev(1, 5, "all_reduce", 4096, 4.0, 5.0, label="params backward"),
        ev(0, 0, "send", 800, 0.0, 1.0, 1, "conv2d.halo forward"),
    ]
    step = recorded_step("toy", events, Degrees(domain=3), flops=1e9)
    assert [(t.kind, t.rule, t.nbytes, t.count) for t in step.traffic] == [
        ("all_reduce", "stats", 64, 1), ("all_reduce", "gradients", 4096, 1),
        ("p2p", "halo", 800, 1),
    ]  # fmt: skip
    assert rule_of("broadcast", "scatter_tensor.meta", "domain") == "input"
    assert rule_of("p2p", "sdpa.ring forward [explicit]", "sequence") == "ring"
    assert rule_of("all_reduce", "linear", "tensor") == "activation"


def test_the_figure_draws_compute_beside_each_dim_and_writes_the_assumptions():
    rows = [row("halo", kind="p2p", nbytes=1e6, count=4), row("gradients", nbytes=8e6, count=1)]
    step = Step("toy", rows, Degrees(domain=4), 1e11)
    scales = {8: Degrees(domain=8), 64: Degrees(domain=8, data=8)}
    fig = plot_projection([project(step, Cluster(), d) for d in scales.values()])
    ax = fig.axes[0]
    assert len(ax.patches) == 2 * 3  # each scale: compute | halos (domain), gradients (data)
    text = fig.axes[1].texts[0].get_text()
    assert text.count("assumed") >= len(Cluster.ASSUMED) + 2 and "datasheet" in text
    ex = projection_explorer({"toy": (step, scales, Growth())}, static=False)
    first = [p.communication for p in ex.projections]
    ex.controls["ib_bandwidth"].value = 6.25e9  # a slower network: only 64 GPUs cross it
    again = [p.communication for p in ex.projections]
    assert again[0] == first[0] and again[1] > first[1]
    assert math.isclose(ex.current().ib_bandwidth, 6.25e9)
