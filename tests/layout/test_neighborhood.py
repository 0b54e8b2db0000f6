"""Neighborhood geometry without processes: NATTEN's window rule, the causal rule, and
the exact rows each rank needs (the halo lower bound)."""

from __future__ import annotations

import pytest

from shardlab.layout.neighborhood import check_dim, needed_rows, neighborhood_plan, neighbors


def natten_start(i, length, k, d):
    """NATTEN's window start (its published rule for the non-causal case)."""
    ns = k // 2
    if i - ns * d < 0:
        return i % d
    if i + ns * d >= length:
        imodd, a = i % d, (length // d) * d
        b = length - a
        return length - b + imodd - 2 * ns * d if imodd < b else a + imodd - k * d
    return i - ns * d


@pytest.mark.parametrize("k", [3, 5, 7, 9, 11, 13])
@pytest.mark.parametrize("d", [1, 2, 3])
def test_windows_follow_natten_and_have_exactly_k_keys(k, d):
    for length in range(k * d, k * d + 9):
        for i, keys in enumerate(neighbors(length, k, d, False)):
            start = natten_start(i, length, k, d)
            assert keys == tuple(start + d * t for t in range(k)), (length, i)
            assert i in keys and all(0 <= j < length for j in keys)
            assert len(set(keys)) == k and all(j % d == i % d for j in keys)


@pytest.mark.parametrize("k,d", [(3, 1), (5, 2), (7, 3)])
def test_causal_windows_see_the_past_only(k, d):
    length = k * d + 5
    for i, keys in enumerate(neighbors(length, k, d, True)):
        want = [i - d * (k - 1 - t) for t in range(k)]
        assert keys == tuple(j if j >= 0 else -1 for j in want)


def test_needed_rows_and_plan_bytes_are_the_lower_bound():
    for sizes in [(5, 1, 5), (1, 1, 10), (4, 0, 3, 6), (1,) * 9]:
        length = sum(sizes)
        for k, d, causal in [(3, 1, False), (5, 1, True), (3, 3, False)]:
            if k * d > length:
                continue
            plan = neighborhood_plan(sizes, k, d, causal)
            start = 0
            for r, n in enumerate(sizes):
                want = {
                    j for i in range(start, start + n) for j in neighbors(length, k, d, causal)[i]
                }
                want.discard(-1)
                assert plan.rows[r] == tuple(sorted(want))
                assert plan.rows[r] == needed_rows(length, k, d, causal, start, start + n)
                foreign = {j for j in want if not start <= j < start + n}
                assert plan.rows_received(r) == len(foreign)  # nothing more moves
                assert sum(b.stop - b.start for b in plan.sends(r)) == sum(
                    len([j for j in plan.rows[q] if start <= j < start + n])
                    for q in range(len(sizes))
                    if q != r
                )
                start += n


@pytest.mark.parametrize(
    "length,k,d,words",
    [
        (9, 4, 1, "odd integer"),
        (5, 7, 1, "larger than"),
        (9, 5, 2, "5 * 2 = 10"),
        (9, 3, 0, ">= 1"),
    ],
)
def test_bad_arguments(length, k, d, words):
    with pytest.raises(ValueError, match=words.replace("*", r"\*")):
        check_dim(length, k, d)
