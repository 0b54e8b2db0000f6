"""plot_collectives on hand-built traces: arrows pair the k-th send from a to b with the k-th
recv on b from a; collectives span their group; unmatched messages dangle, never crash."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from shardlab.trace.events import Event, Trace
from shardlab.viz import human_bytes, match_messages, plot_collectives

from ._helpers import render


class Ranks:
    """Builds events with per-rank sequence numbers and increasing start times."""

    def __init__(self):
        self.events, self.seq, self.clock = [], Counter(), 0.0

    def add(self, rank, kind, peer=None, nbytes=24, group=(), label=""):
        self.clock += 0.001
        e = Event(rank, self.seq[rank], kind, kind, tuple(group), peer, nbytes, "float32",
                  ((nbytes // 4,),), label, start=self.clock, duration=0.0005)  # fmt: skip
        self.seq[rank] += 1
        self.events.append(e)
        return e

    def collective(self, kind, group, nbytes=64, label=""):
        for r in group:
            self.add(r, kind, nbytes=nbytes, group=group, label=label)

    def trace(self, shuffle=None):
        events = list(self.events)
        if shuffle is not None:
            shuffle.shuffle(events)
        return Trace(events)


def ring(world, recv_first=False, label="conv1d.halo forward"):
    t = Ranks()
    for r in range(world):
        pair = [("send", (r + 1) % world, 24 * (r + 1)), ("recv", (r - 1) % world, 24 * r or 24)]
        for kind, peer, nbytes in reversed(pair) if recv_first else pair:
            t.add(r, kind, peer, nbytes, tuple(range(world)), label)
    return t


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("recv_first", [False, True])
def test_ring_arrows_match_sends_to_recvs(world, recv_first):
    t = ring(world, recv_first)
    t.collective("all_reduce", tuple(range(world)), 1536, "linear.grad")
    for by in ("seq", "time"):
        fig = plot_collectives(t.trace(random.Random(world)), by=by)
        assert sorted(fig.shardlab_arrows) == sorted(
            (r, (r + 1) % world, 24 * (r + 1)) for r in range(world)
        )
        assert fig.shardlab_dangling == []
        assert fig.shardlab_collectives == [("all_reduce", tuple(range(world)), world)]
        assert fig.shardlab_lanes == list(range(world))
    texts = " ".join(t.get_text() for t in fig.axes[0].texts)
    assert "all_reduce" in texts and "1.5 KiB" in texts and "linear.grad" in texts
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert "send → recv: conv1d.halo forward" in legend  # the one cause of every message
    if world == 4:
        render(fig)


def test_kth_send_matches_kth_recv():
    t = Ranks()
    for n in (10, 20, 30):
        t.add(0, "send", 1, n)
    for n in (10, 20, 30):
        t.add(1, "recv", 0, n)
    t.add(1, "send", 0, 7, label="grad")
    t.add(0, "recv", 1, 7, label="grad")
    fig = plot_collectives(t.trace(random.Random(0)))
    assert "7 B\ngrad" in [t.get_text() for t in fig.axes[0].texts]  # causes differ: on arrows
    assert fig.shardlab_arrows == [(0, 1, 10), (0, 1, 20), (0, 1, 30), (1, 0, 7)]
    pairs, unmatched = match_messages(t.events)
    assert [(s.seq, r.seq) for s, r in pairs[:3]] == [(0, 0), (1, 1), (2, 2)]
    assert unmatched == []


def test_unmatched_messages_dangle():
    t = ring(3)
    orphan = t.add(0, "send", 2, 100, label="orphan")
    t.add(1, "recv", 2, 5)  # its send was never traced
    t.add(2, "send", None, 8)  # no peer at all
    t.add(0, "send", 5, 9)  # to a rank that traced nothing
    fig = plot_collectives(t.trace())
    assert len(fig.shardlab_arrows) == 3
    assert sorted(fig.shardlab_dangling, key=str) == sorted(
        [(0, 2, 100, "send"), (2, 1, 5, "recv"), (2, None, 8, "send"), (0, 5, 9, "send")],
        key=str,
    )
    assert orphan.bytes == 100
    assert fig.shardlab_lanes == [0, 1, 2, 5]
    assert sum(t.get_text() == "unmatched" for t in fig.axes[0].texts) == 3
    render(fig)


def test_subgroup_collectives_and_kinds():
    t = Ranks()
    t.collective("all_gather", (0, 2), 3 * 2**20)
    t.collective("all_gather", (1, 3), 3 * 2**20)
    t.collective("reduce_scatter", (0, 1, 2, 3), 4096)
    t.collective("broadcast", (0, 1), 12, "weights")
    t.collective("barrier", (0, 1, 2, 3), 0)
    fig = plot_collectives(t.trace(random.Random(3)))
    got = sorted(fig.shardlab_collectives)
    assert got == sorted([
        ("all_gather", (0, 2), 2), ("all_gather", (1, 3), 2),
        ("reduce_scatter", (0, 1, 2, 3), 4), ("broadcast", (0, 1), 2),
        ("barrier", (0, 1, 2, 3), 4),
    ])  # fmt: skip
    texts = " ".join(t.get_text() for t in fig.axes[0].texts)
    assert "3.0 MiB" in texts and "4.0 KiB" in texts and "{0,2}" in texts
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert {"all_gather", "reduce_scatter", "broadcast", "barrier"} <= set(legend)
    render(fig)


def test_random_traces_never_crash():
    rng = random.Random(5)
    for k in range(12):
        world = rng.randint(1, 4)
        t = Ranks()
        for _ in range(rng.randint(0, 14)):
            a, b = rng.randrange(world), rng.randrange(world)
            choice = rng.random()
            if choice < 0.4:
                t.add(a, "send", b, rng.choice((4, 2000, 5 * 2**20)))
            elif choice < 0.8:
                t.add(b, "recv", a, 4)
            else:
                t.collective(rng.choice(("all_reduce", "all_to_all")), tuple(range(world)))
        events = t.events
        sends = Counter((e.rank, e.peer) for e in events if e.kind == "send")
        recvs = Counter((e.peer, e.rank) for e in events if e.kind == "recv")
        fig = plot_collectives(t.trace(rng), by=rng.choice(("seq", "time")))
        assert len(fig.shardlab_arrows) == sum((sends & recvs).values())
        assert len(fig.shardlab_arrows) + len(fig.shardlab_dangling) == sum(
            e.kind in ("send", "recv") for e in events
        ) - sum((sends & recvs).values())
        if k % 6 == 0:
            render(fig)


def test_max_events_and_empty_trace():
    t = ring(4)
    fig = plot_collectives(t.trace(), max_events=3)
    assert "first 3 of 8" in fig.axes[0].get_title()
    render(plot_collectives(Trace([])))
    with pytest.raises(ValueError, match="by"):
        plot_collectives(Trace([]), by="wall")


@pytest.mark.parametrize(
    "n, text",
    [(0, "0 B"), (24, "24 B"), (1023, "1023 B"), (1536, "1.5 KiB"), (3 * 2**20, "3.0 MiB"),
     (5 * 2**30, "5.0 GiB")],
)  # fmt: skip
def test_human_bytes(n, text):
    assert human_bytes(n) == text
