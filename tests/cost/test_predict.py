"""predict (shardlab/cost/predict.py) on a trace written by hand, and calibrate
(shardlab/cost/calibrate.py) on 2 and 4 gloo ranks: a fresh trace's bytes exactly, its
times within a loose factor (the figures: benchmarks/bench_cost.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import shardlab
from shardlab.cost import CostModel, Link, calibrate, predict
from shardlab.trace import Event, Trace

MODEL = CostModel({"p2p": Link(10e-6, 1e-9), "all_reduce": Link(20e-6, 2e-9)}, where="by hand")


def ev(rank, seq, kind, nbytes, start, end, peer=None, label=""):
    return Event(rank, seq, kind, kind, (0, 1), peer, nbytes, "float32", ((nbytes // 4,),),
                 label, start=start, duration=1e-6, end=end)  # fmt: skip


def _halo_then_all_reduce() -> Trace:
    """Rank 0 and 1 swap 1000 bytes (a halo), then all-reduce 400 bytes."""
    return Trace([
        ev(0, 0, "send", 1000, 0.0, 30e-6, 1, "conv2d.halo forward"),
        ev(0, 1, "recv", 1000, 1e-6, 40e-6, 1, "conv2d.halo forward"),
        ev(0, 2, "all_reduce", 400, 100e-6, 200e-6, label="batch_norm.stats forward"),
        ev(1, 0, "send", 1000, 0.0, 30e-6, 0, "conv2d.halo forward"),
        ev(1, 1, "recv", 1000, 2e-6, 50e-6, 0, "conv2d.halo forward"),
        ev(1, 2, "all_reduce", 400, 150e-6, 200e-6, label="batch_norm.stats forward"),
    ])  # fmt: skip


def test_predict_by_hand():
    p = predict(_halo_then_all_reduce(), MODEL)
    halo, ar = 10e-6 + 1000e-9, 2 * 20e-6 + 400 * 2e-9  # α + nβ; ring: 2(p-1)α + 2(p-1)/p nβ
    assert [(r.kind, r.group, r.predicted) for r in p.rows] == [
        ("p2p", (0, 1), pytest.approx(halo)), ("p2p", (1, 0), pytest.approx(halo)),
        ("all_reduce", (0, 1), pytest.approx(ar)),
    ]  # fmt: skip
    # measured: 0 -> 1 from the later post (2 µs) to rank 1's receive (50 µs); 1 -> 0: 39 µs;
    # the all-reduce from rank 1's post: 50 µs
    assert [r.measured for r in p.rows] == pytest.approx([48e-6, 39e-6, 50e-6])
    # each rank: the halo's two messages in flight at once count once (the longer), then the
    # all-reduce
    assert p.ranks[0]["predicted"] == pytest.approx(halo + ar)
    assert p.ranks[0]["measured"] == pytest.approx(48e-6 + 50e-6)
    assert p.ranks[0]["in_calls"] == pytest.approx(40e-6 + 100e-6)  # waiting included
    assert p.predicted == pytest.approx(halo + ar) and p.measured == pytest.approx(98e-6)
    assert p.bytes == _halo_then_all_reduce().bytes() == 4 * 1000 + 2 * 400
    by = p.by("kind")
    assert by["p2p"]["messages"] == 2 and by["p2p"]["bytes"] == 4000
    assert by["all_reduce"]["wire_bytes"] == 400  # 2(p-1)/p · n for p = 2
    assert set(p.by("label")) == {"conv2d.halo forward", "batch_norm.stats forward"}
    text = p.table()
    assert "by hand" in text and "rank 1" in text and text.splitlines()[-1].startswith("step")
    with pytest.raises(ValueError, match="what: 'kind' or 'label'"):
        p.by("rank")
    with pytest.raises(TypeError, match="model: a shardlab.cost.CostModel"):
        predict(_halo_then_all_reduce(), None)


def test_several_steps_take_each_messages_median():
    import dataclasses

    def slower(trace, by):
        return Trace([dataclasses.replace(e, end=e.start + (e.end - e.start) * by) for e in trace])

    one = _halo_then_all_reduce()
    p = predict([one, slower(one, 3.0), slower(one, 1.5)], MODEL)
    assert p.rows[2].measured == pytest.approx(1.5 * 50e-6)  # the median of 1, 3 and 1.5 x
    assert p.predicted == predict(one, MODEL).predicted
    with pytest.raises(ValueError, match="trace: step 1 of the list sends other messages"):
        predict([one, Trace(one.events[:2] + one.events[3:5])], MODEL)  # no all-reduce
    with pytest.raises(TypeError, match="trace: a shardlab.trace.Trace"):
        predict(42, MODEL)


def _a_few_messages(n):
    """Known messages: all-reduces, an all-gather and a halo exchange, traced."""
    me, p = dist.get_rank(), dist.get_world_size()
    x = torch.ones(n)
    with shardlab.trace() as t:
        for _ in range(3):
            dist.all_reduce(x)
        dist.all_gather_into_tensor(torch.empty(n * p), x)
        peers = [q for q in (me - 1, me + 1) if 0 <= q < p]
        ops = [dist.P2POp(dist.isend, x, q) for q in peers]
        ops += [dist.P2POp(dist.irecv, torch.empty(n), q) for q in peers]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return t.events


@pytest.mark.parametrize("world", [2, 4])
def test_calibrate_then_predict_a_fresh_trace(ranks_for, world):
    ranks = ranks_for(world)
    model = calibrate(ranks, kinds=("p2p", "all_reduce", "all_gather"), sizes=(64, 16384, 1 << 18),
                      repeats=3)  # fmt: skip
    assert set(model.links) == {"p2p", "all_reduce", "all_gather"}
    assert f"{world} gloo ranks" in model.where
    assert all(link.alpha + link.beta * 4096 > 0 for link in model.links.values())
    assert {n for n, _, _ in model.samples["all_gather"]} == {64, 16384, 1 << 18}
    trace = Trace([e for evs in ranks.run(_a_few_messages, 1 << 14) for e in evs])
    p = predict(trace, model)
    halos = 2 * (world - 1)  # messages of a line exchange
    assert [r.kind for r in p.rows].count("all_reduce") == 3 and len(p.rows) == 4 + halos
    assert p.bytes == trace.bytes()  # exactly: the same events, each once
    assert all(r.measured is not None and r.measured > 0 for r in p.rows)
    # a loose factor: the sizes here were calibrated; gloo on a shared 2-core machine is noisy
    assert 1 / 20 < p.predicted / p.measured < 20, p.table()


def test_calibrate_on_the_ranks_gives_every_rank_the_same_model(ranks_for):
    def body():
        return calibrate(kinds=("all_reduce",), sizes=(64, 4096), repeats=2, between=1e-3)

    models = ranks_for(2).run(body)
    assert models[0].to_dict() == models[1].to_dict()
    assert set(models[0].links) == {"p2p", "all_reduce"}  # p2p: always
    assert "1 ms of compute before each message" in models[0].where


def test_calibrate_errors_name_the_argument():
    with pytest.raises(ValueError, match="ranks: pass a shardlab.Ranks pool"):
        calibrate()
    with pytest.raises(ValueError, match="kinds: 'gather' cannot be calibrated"):
        calibrate(kinds=("gather",))
    with pytest.raises(ValueError, match="sizes: payloads"):
        calibrate(sizes=(0,))
    with pytest.raises(ValueError, match="between: seconds >= 0"):
        calibrate(between=-1.0)
