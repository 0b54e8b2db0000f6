"""The expert-parallel figures: load, routing and flow from plain data (no process), the
flow read from a trace's all-to-all splits, and the explorer's controls redrawing."""

from __future__ import annotations

import pytest
import torch

import shardlab.viz.explorers as explorers
from shardlab import viz
from shardlab.trace import Event, Trace
from shardlab.viz.experts import ExpertExplorer, expert_load, simulate_routing, token_flow


def test_expert_load_counts_each_ranks_pairs_per_expert():
    index = torch.tensor([[0, 1], [0, 2], [3, 0]])
    assert expert_load(index, 4, sizes=[2, 1]) == [[2, 1, 1, 0], [1, 0, 0, 1]]
    assert expert_load([[1], [1]], 2) == [[0, 2]]
    with pytest.raises(ValueError, match="sum to 2, not the 3 tokens"):
        expert_load(index, 4, sizes=[1, 1])
    with pytest.raises(ValueError, match="expert 5 out of range"):
        expert_load([[5]], 4)


def _a2a(rank, seq, splits, label="experts.dispatch forward", group=(0, 1, 2)):
    return Event(rank, seq, "all_to_all", "c10d.alltoall_base", group, None, sum(splits),
                 "float64", ((sum(splits) // 8,),), label, splits=tuple(splits))  # fmt: skip


def test_token_flow_reads_the_splits_of_each_layers_dispatch():
    events = []
    for r in range(3):
        events.append(_a2a(r, 0, [8 * r, 16, 0]))  # layer 0
        events.append(_a2a(r, 1, [0, 0, 8], label="experts.combine forward"))
        events.append(_a2a(r, 2, [8, 8, 8]))  # layer 1
    t = Trace(events)
    assert token_flow(t, layer=0) == [[0, 16, 0], [8, 16, 0], [16, 16, 0]]
    assert token_flow(t, layer=1) == [[8, 8, 8]] * 3
    assert token_flow(t) == [[8, 24, 8], [16, 24, 8], [24, 24, 8]]
    assert token_flow(t, "experts.combine") == [[0, 0, 8]] * 3
    with pytest.raises(ValueError, match="no all_to_all labelled"):
        token_flow(Trace([]))
    fig = viz.plot_token_flow(t, row_bytes=8)  # the sum, in tokens
    assert fig.shardlab_flow == [[1, 3, 1], [2, 3, 1], [3, 3, 1]]


def test_routing_and_load_figures_keep_what_they_drew():
    index = simulate_routing(12, 4, 2, seed=1)
    assert index.shape == (12, 2) and (index[:, 0] != index[:, 1]).all()
    fig = viz.plot_routing(index, 4, sizes=[5, 7])
    assert fig.shardlab_load == expert_load(index, 4, [5, 7])
    assert sum(map(sum, fig.shardlab_load)) == 24
    load = viz.plot_expert_load(fig.shardlab_load).shardlab_received
    per_expert = [sum(col) for col in zip(*fig.shardlab_load)]
    assert load == [per_expert[0] + per_expert[1], per_expert[2] + per_expert[3]]
    with pytest.raises(ValueError, match="multiple of the number of ranks"):
        viz.plot_routing(index, 4, sizes=[4, 4, 4])


def test_a_biased_router_sends_most_tokens_to_expert_0():
    balanced = simulate_routing(400, 8, 2, bias=0.0)
    biased = simulate_routing(400, 8, 2, bias=4.0)
    assert (balanced == 0).sum() < 150 and (biased[:, 0] == 0).float().mean() > 0.9
    with pytest.raises(ValueError, match="top_k"):
        simulate_routing(4, 2, 3)


def test_expert_explorer_redraws_and_shows_errors(monkeypatch):
    monkeypatch.setattr(explorers, "figure_png", lambda fig, dpi=None: str(id(fig)).encode())
    e = viz.expert_explorer(static=False, ranks=4, experts=8, tokens=32, row_bytes=16)
    assert isinstance(e, ExpertExplorer) and e.error_message is None
    assert sum(e.received.values()) == 4 * 32 * 2  # every pair lands once
    assert max(e.received.values()) < 1.5 * 64  # the even share: 64 pairs per rank
    e.controls["bias"].value = 4.0
    assert e.received[0] > 2 * 64  # rank 0 holds expert 0
    flow = e.figure.shardlab_flow
    assert all(sum(row) == 32 * 2 * 16 for row in flow)  # each rank hands all its pairs
    assert e.sent == {r: sum(row) - row[r] for r, row in enumerate(flow)}
    assert "vs mean" in e.table.value
    e.controls["experts"].value = 6  # 6 experts on 4 ranks
    assert "multiple of the number of ranks" in e.error_message
    e.controls["ranks"].value = 3
    assert e.error_message is None and len(e.received) == 3
    fig = ExpertExplorer.static_figure(bias=1.0)
    assert len(fig.shardlab_flow) == 4
