"""Grouped log-prob layout: packing groups into rows, and splitting long groups when attention dominates."""

from __future__ import annotations

import random

import pytest

from cohort.fastpath import layouts


def test_packed_rows_hold_several_groups():
    lay = layouts.grouped_layout([[1, 2, 3, 4, 5, 6], [7], [8]], [[9, 9], [9], [9], []], 1, [0, 1, 2], 2)
    # Sizes 6 + 1, 1 + 0, 1 + 0: the two small groups share a row of width 7, each seeing only itself.
    assert len(lay.input_ids) == 2 and len(lay.input_ids[0]) == 7
    assert lay.input_ids[1][:2] == [7, 8] and lay.group[1] == [0, 1, -1, -1, -1, -1, -1]
    assert lay.position_ids[1][:2] == [0, 0]


def test_row_planner_splits_long_groups_only_when_attention_dominates():
    prompt_len = {0: 10, 1: 4}
    bodies = {0: [("a", 50), ("b", 40), ("c", 5)], 1: [("d", 3)]}
    width, rows = layouts.plan_rows(prompt_len, bodies, pair_cost=0.0)
    assert width == 105 and rows == [[(0, ["a", "b", "c"])], [(1, ["d"])]]  # 10+50+40+5: one piece each
    width, rows = layouts.plan_rows(prompt_len, bodies, pair_cost=1.0)
    pieces = [piece for row in rows for piece in row]
    assert sorted(m for _, members in pieces for m in members) == ["a", "b", "c", "d"]
    assert width < 105 and len([g for g, _ in pieces if g == 0]) > 1  # group 0 is split
    for row in rows:
        used = sum(prompt_len[g] + sum(dict(bodies[g])[m] for m in members) for g, members in row)
        assert used <= width


@pytest.mark.parametrize("pair_cost", [0.0, 6e-4, 0.01, 1.0])
def test_row_planner_places_every_member_once_and_never_costs_more_than_no_split(pair_cost):
    rng = random.Random(int(pair_cost * 1e4))
    for _ in range(30):
        groups = rng.randint(1, 6)
        prompt_len = {g: rng.randint(1, 150) for g in range(groups)}
        bodies = {
            g: [((g, m), rng.randint(0, 128)) for m in range(rng.randint(1, 16))] for g in range(groups)
        }
        width, rows = layouts.plan_rows(prompt_len, bodies, pair_cost)
        placed = sorted(m for row in rows for _, members in row for m in members)
        assert placed == sorted(m for g in bodies for m, _ in bodies[g])
        sizes = dict(m_n for g in bodies for m_n in bodies[g])
        for row in rows:
            assert sum(prompt_len[g] + sum(sizes[m] for m in members) for g, members in row) <= width
        widest = max(prompt_len[g] + sum(n for _, n in bodies[g]) for g in bodies)
        unsplit_rows = len(
            layouts._pack([prompt_len[g] + sum(n for _, n in bodies[g]) for g in bodies], widest)
        )
        cost = len(rows) * width * (1 + pair_cost * width)
        assert cost <= unsplit_rows * widest * (1 + pair_cost * widest) + 1e-9
