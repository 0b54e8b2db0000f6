"""``shardlab.zero.plot`` and the explorer: the bars drawn, what "measure" may run."""

from __future__ import annotations

import pytest

from shardlab.zero import explorer, llama, llama_sizes, plot, predict

pytest.importorskip("transformers")


@pytest.mark.parametrize("sizes", [(6, 64, 256), (3, 32, 128), (1, 16, 64)])
def test_llama_sizes_counts_what_llama_builds(sizes):
    model = llama(*sizes)
    psi, units = llama_sizes(*sizes)
    assert psi == sum(p.numel() for p in model.parameters())
    assert units[:-1] == [sum(p.numel() for p in b.parameters()) for b in model.model.layers]


def test_plot_stacks_the_three_states_per_bar():
    psi, units = llama_sizes(6, 64, 256)
    fig = plot([predict(psi, 4, s, units=units) for s in range(4)])
    assert len(fig.axes[0].patches) == 4 * 3  # params, grads, optim per stage
    heights = [p.get_height() for p in fig.axes[0].patches]
    assert heights[:3] == [4 * psi, 4 * psi, 8 * psi]  # stage 0: all whole, bytes


def test_the_explorer_measures_only_what_its_ranks_can_run(ranks_for):
    ex = explorer(ranks_for(2), layers=2, static=False)
    assert ex.can_measure() is None and not ex.button.disabled
    ex.measure()  # the four stages on the 2 ranks
    assert len(ex.figure.axes[0].patches) == 4 * 2 * 3  # formula and measured, three states each
    (rows,) = ex.rows.values()
    assert [r.stage for r in rows] == [0, 1, 2, 3]
    assert all(abs(r.ratio("states") - 1) < 0.15 for r in rows)
    ex.controls["n"].value = 8  # no such ranks here: the formula alone, the button off
    assert "N = 2 only" in ex.can_measure() and ex.button.disabled
    assert len(ex.figure.axes[0].patches) == 4 * 3  # the formula's bars alone
    ex.controls["n"].value = 2
    ex.controls["mixed"].value = True  # measured in float32 only
    assert "float32" in ex.can_measure()
    assert len(ex.figure.axes[0].patches) == 4 * 3


def test_the_static_explorer_is_the_figure_of_the_formula():
    fig = explorer(static=True, n=8)
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()][0] == "stage 0\nN = 8"
