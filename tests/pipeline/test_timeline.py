"""``shardlab.pipeline``'s timeline, without processes: the bubble of a textbook GPipe,
its replay from stretched wall-clock times and messages, and what ``record`` sees."""

from __future__ import annotations

import pytest

from shardlab.pipeline import Action, bubble, formula, record, replay
from shardlab.trace import Event


def gpipe(p: int, m: int, f: float = 1.0, b: float = 2.0) -> list[Action]:
    """The textbook GPipe timeline: every forward ``f``, every backward ``b`` seconds."""
    out = []
    for r in range(p):
        for i in range(m):
            out.append(Action(r, r, i, "F", (r + i) * f, (r + i + 1) * f, f))
        for i in range(m):
            start = (m + p - 1) * f + (p - 1 - r + i) * b
            out.append(Action(r, r, i, "B", start, start + b, b))
    return out


def gpipe_of(times, m: int) -> list[Action]:
    """GPipe with each stage's own (forward, backward) seconds: every action starts when
    its rank is free and its input has arrived (the previous stage's forward, the next
    stage's backward), messages free."""
    p = len(times)
    end: dict = {}
    out = []
    for r, (f, _) in enumerate(times):
        for i in range(m):
            start = max(end.get((r, i - 1, "F"), 0.0), end.get((r - 1, i, "F"), 0.0))
            end[r, i, "F"] = start + f
            out.append(Action(r, r, i, "F", start, start + f, f))
    for r in reversed(range(p)):
        free = end[r, m - 1, "F"]
        for i in range(m):
            start = max(free, end.get((r + 1, i, "B"), 0.0))
            free = end[r, i, "B"] = start + times[r][1]
            out.append(Action(r, r, i, "B", start, free, times[r][1]))
    return out


def messages(actions) -> list[Event]:
    """The sends and receives GPipe makes: each F's output to the next rank, each B's
    gradient to the previous one; a send posted when its action ends, its recv waited
    for just when the next action starts."""
    at = {(a.rank, a.microbatch, a.kind): a for a in actions}
    p = max(a.rank for a in actions) + 1
    events, seq = [], {}

    def add(rank, kind, peer, start, end):
        seq[rank] = seq.get(rank, -1) + 1
        events.append(Event(rank, seq[rank], kind, kind, (rank, peer), peer, 8, "float64",
                            ((1,),), start=start, end=end))  # fmt: skip

    for a in sorted(actions, key=lambda a: a.start):
        peer = a.rank + 1 if a.kind == "F" else a.rank - 1
        if 0 <= peer < p:
            add(a.rank, "send", peer, a.end, a.end)
            nxt = at[(peer, a.microbatch, a.kind)]
            add(peer, "recv", a.rank, a.end, nxt.start)
    return events


@pytest.mark.parametrize("p, m", [(4, 8), (3, 5), (2, 1), (4, 16)])
def test_textbook_gpipe_has_the_formulas_bubble(p, m):
    assert bubble(gpipe(p, m)) == pytest.approx(formula(p, m))
    assert formula(4, 8) == pytest.approx(3 / 11)


@pytest.mark.parametrize(
    "times",
    [[(1, 2)] * 4, [(1, 2), (1, 2), (1, 2), (1.5, 2.5)], [(2, 1), (0.5, 3), (1, 1)],
     [(0.1, 0.3), (0.2, 0.1)], [(1, 2)]],
)  # fmt: skip
@pytest.mark.parametrize("m", [1, 3, 8])
def test_unequal_stages_have_the_formulas_bubble(times, m):
    """The slowest stage sets the pace: the formula with each stage's times equals the
    bubble of GPipe run with them, and is never below the textbook's."""
    p = len(times)
    assert bubble(gpipe_of(times, m)) == pytest.approx(formula(p, m, times))
    assert formula(p, m, times) >= formula(p, m) - 1e-12
    with pytest.raises(ValueError, match="times has 2 stages, stages is 3"):
        formula(3, m, [(1, 1), (1, 1)])


def test_replay_undoes_a_stretched_wall_clock():
    ideal = gpipe(4, 8)
    # the same run on a crowded machine: every action twice as long and 1 s later per rank
    wall = [
        Action(
            a.rank, a.stage, a.microbatch, a.kind, 2 * a.start + a.rank, 2 * a.end + a.rank, a.cpu
        )  # fmt: skip
        for a in ideal
    ]
    again = replay(wall, messages(wall))
    key = lambda a: (a.rank, a.microbatch, a.kind)  # noqa: E731
    assert sorted(map(key, again)) == sorted(map(key, ideal))
    got = {key(a): (a.start, a.end) for a in again}
    for a in ideal:
        assert got[key(a)] == pytest.approx((a.start, a.end))
    assert bubble(again) == pytest.approx(formula(4, 8))


def test_replay_without_messages_packs_each_rank():
    acts = [Action(0, 0, i, "F", 10.0 * i, 10.0 * i + 5, 1.0) for i in range(3)]
    assert [(a.start, a.end) for a in replay(acts)] == [(0, 1), (1, 2), (2, 3)]
    assert bubble([]) == 0.0


class _Stage:  # the three methods a schedule calls on a PipelineStage
    stage_index = 5

    def forward_one_chunk(self, fwd_chunk_id, args, kwargs=None):
        return fwd_chunk_id

    def backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True, last_backward=False):
        return bwd_chunk_id

    def backward_weight_one_chunk(self, bwd_chunk_id, last_backward=False):
        return bwd_chunk_id


def test_record_names_each_call_and_unwraps():
    stage = _Stage()
    with record(stage, rank=2) as actions:
        assert stage.forward_one_chunk(3, ()) == 3
        stage.backward_one_chunk(3, full_backward=True)
        stage.backward_one_chunk(4, full_backward=False)
        stage.backward_weight_one_chunk(bwd_chunk_id=4)
    assert [(a.rank, a.stage, a.microbatch, a.kind) for a in actions] == [
        (2, 5, 3, "F"), (2, 5, 3, "B"), (2, 5, 4, "I"), (2, 5, 4, "W")
    ]  # fmt: skip
    assert all(a.end >= a.start and a.cpu >= 0 for a in actions)
    assert "forward_one_chunk" not in vars(stage)  # the class's methods again
