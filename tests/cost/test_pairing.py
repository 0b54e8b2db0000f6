"""A trace's events paired into messages, and their measured time
(shardlab/cost/pairing.py), on events written by hand."""

from __future__ import annotations

import pytest

from shardlab.cost import messages
from shardlab.cost.pairing import gaps, in_flight_together
from shardlab.trace import Event


def ev(rank, seq, kind, group, nbytes, start, end, peer=None, label=""):
    return Event(rank, seq, kind, kind, tuple(group), peer, nbytes, "float32", ((nbytes // 4,),),
                 label, start=start, duration=1e-6, end=end)  # fmt: skip


def test_collectives_pair_by_order_on_their_group():
    # two all-reduces on ranks 0-1, one on the pair (0, 2) between them on rank 0
    events = [
        ev(0, 0, "all_reduce", (0, 1), 8, 1.0, 1.5),
        ev(0, 1, "all_reduce", (0, 2), 8, 2.0, 2.1),
        ev(0, 2, "all_reduce", (0, 1), 16, 3.0, 3.2),
        ev(1, 0, "all_reduce", (0, 1), 8, 1.4, 1.5),  # arrived last: waited for nobody
        ev(1, 1, "all_reduce", (0, 1), 16, 3.1, 3.2),
        ev(2, 0, "all_reduce", (0, 2), 8, 2.0, 2.1),
    ]
    msgs, of = messages(events)
    assert [(m.kind, m.group, m.nbytes, len(m.events)) for m in msgs] == [
        ("all_reduce", (0, 1), 8, 2), ("all_reduce", (0, 2), 8, 2), ("all_reduce", (0, 1), 16, 2),
    ]  # fmt: skip
    assert msgs[0].measured() == pytest.approx(0.1)  # not rank 0's 0.5 s of waiting
    assert msgs[2].measured() == pytest.approx(0.1)
    assert of[id(events[4])] is msgs[2]
    assert sum(m.bytes for m in msgs) == sum(e.bytes for e in events)


def test_point_to_point_pairs_kth_send_with_kth_recv():
    events = [
        ev(0, 0, "send", (0, 1), 100, 1.0, 1.01, peer=1),
        ev(0, 1, "send", (0, 1), 200, 2.0, 2.01, peer=1),
        ev(1, 0, "recv", (0, 1), 100, 1.2, 1.25, peer=0),  # posted late: 0.05 s
        ev(1, 1, "recv", (0, 1), 200, 1.9, 2.3, peer=0),  # posted early: from the send
    ]
    msgs, _ = messages(events)
    assert [(m.kind, m.group, m.nbytes) for m in msgs] == [("p2p", (0, 1), 100),
                                                           ("p2p", (0, 1), 200)]  # fmt: skip
    assert msgs[0].measured() == pytest.approx(0.05)
    assert msgs[1].measured() == pytest.approx(0.3)
    # one end only (a trace of one rank): its own time; no end at all: None
    alone, _ = messages([ev(0, 0, "send", (0, 1), 8, 1.0, 1.5, peer=1)])
    assert alone[0].measured() == pytest.approx(0.5)
    assert messages([ev(0, 0, "send", (0, 1), 8, 1.0, 0.0, peer=1)])[0][0].measured() is None


def test_in_flight_together():
    # a halo (send and recv posted, then waited), then an all-reduce after both ended
    events = [
        ev(0, 0, "send", (0, 1), 8, 1.0, 1.3, peer=1),
        ev(0, 1, "recv", (0, 1), 8, 1.1, 1.4, peer=1),
        ev(0, 2, "all_reduce", (0, 1), 8, 1.5, 1.6),
        ev(0, 3, "all_reduce", (0, 1), 8, 1.6, 1.7),
    ]
    assert [[e.seq for e in run] for run in in_flight_together(events)] == [[0, 1], [2], [3]]


def test_gaps_are_the_compute_between_runs():
    events = [
        ev(0, 0, "send", (0, 1), 8, 1.0, 1.3, peer=1),
        ev(0, 1, "recv", (0, 1), 8, 1.1, 1.4, peer=1),
        ev(0, 2, "all_reduce", (0, 1), 8, 1.5, 1.6),
        ev(1, 0, "all_reduce", (0, 1), 8, 1.0, 1.6),
        ev(1, 1, "all_reduce", (0, 1), 8, 1.9, 2.0),
    ]
    assert gaps(events) == pytest.approx([0.1, 0.3])
