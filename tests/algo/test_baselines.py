"""RLOO and REINFORCE++(-baseline) advantages and the estimator registry: by hand, against loops, bad input."""

from __future__ import annotations

import math
import random

import pytest
import torch

from cohort.algo import estimate_advantages, register_advantage, reinforce_pp_advantages, rloo_advantages

F64 = torch.float64


def test_rloo_by_hand():
    # Group [1, 0, 0, 1]: A_0 = 1 - (0 + 0 + 1) / 3 = 2/3, A_1 = 0 - (1 + 0 + 1) / 3 = -2/3; group [2, 2, 2, 5]:
    # A_0 = 2 - 3 = -1 (others 2, 2, 5), A_3 = 5 - 2 = 3.
    r = torch.tensor([1.0, 0, 0, 1, 2, 2, 2, 5], dtype=F64)
    torch.testing.assert_close(
        rloo_advantages(r, 4), torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3, -1, -1, -1, 3], dtype=F64)
    )
    # NaN: left out of the others' means and given 0; [1, nan, 3]: A_0 = 1 - 3, A_2 = 3 - 1.
    r = torch.tensor([1.0, float("nan"), 3.0], dtype=F64)
    torch.testing.assert_close(rloo_advantages(r, 3), torch.tensor([-2.0, 0.0, 2.0], dtype=F64))
    # One valid row in a group: no other to compare with, 0.
    assert rloo_advantages(torch.tensor([float("nan"), 4.0]), 2).tolist() == [0.0, 0.0]


def test_reinforce_pp_by_hand():
    # baseline=False, rewards [1, 3, 5, 7] (two groups of 2), population std: mean 4, sd sqrt(5).
    r = torch.tensor([1.0, 3.0, 5.0, 7.0], dtype=F64)
    got = reinforce_pp_advantages(r, 2, baseline=False, std="population", eps=0.0)
    torch.testing.assert_close(got, (r - 4) / math.sqrt(5))
    # baseline=True: group means 2 and 6 -> a = [-1, 1, -1, 1], batch mean 0, population sd 1 -> a itself.
    got = reinforce_pp_advantages(r, 2, baseline=True, std="population", eps=0.0)
    torch.testing.assert_close(got, torch.tensor([-1.0, 1.0, -1.0, 1.0], dtype=F64))
    # Token weights [1, 3, 1, 1] on a = [-1, 1, -1, 1]: weighted mean (-1 + 3 - 1 + 1) / 6 = 1/3; deviations
    # [-4/3, 2/3, -4/3, 2/3]; weighted population variance (16/9 + 3 * 4/9 + 16/9 + 4/9) / 6 = 48/54 = 8/9.
    w = torch.tensor([1.0, 3.0, 1.0, 1.0], dtype=F64)
    got = reinforce_pp_advantages(r, 2, std="population", eps=0.0, weights=w)
    torch.testing.assert_close(
        got, torch.tensor([-4 / 3, 2 / 3, -4 / 3, 2 / 3], dtype=F64) / math.sqrt(8 / 9)
    )
    # All equal after the baseline: exactly 0.
    assert reinforce_pp_advantages(torch.tensor([1.0, 1.0, 2.0, 2.0]), 2).tolist() == [0.0] * 4


def _loop_reinforce(r, g, baseline, std, eps, w):
    n = len(r)
    vals = list(r)
    if baseline:
        for b in range(n // g):
            grp = [v for v in r[b * g : (b + 1) * g] if not math.isnan(v)]
            m = sum(grp) / len(grp) if grp else 0.0
            for i in range(b * g, (b + 1) * g):
                vals[i] = r[i] - m
    idx = [i for i in range(n) if not math.isnan(r[i])]
    tw = sum(w[i] for i in idx)
    mean = sum(w[i] * vals[i] for i in idx) / tw
    var = sum(w[i] * (vals[i] - mean) ** 2 for i in idx) / max(tw - 1 if std == "sample" else tw, 1)
    if len({vals[i] for i in idx}) <= 1:
        return [0.0] * n
    return [0.0 if math.isnan(r[i]) else (vals[i] - mean) / (math.sqrt(var) + eps) for i in range(n)]


@pytest.mark.parametrize("baseline", [False, True])
@pytest.mark.parametrize("std", ["sample", "population"])
def test_reinforce_pp_against_a_loop(baseline, std):
    rng = random.Random(f"{baseline}{std}")
    for g, groups in [(2, 1), (3, 2), (4, 5)]:
        for _ in range(5):
            r = [rng.choice([0.0, 1.0, 0.5, float("nan"), rng.uniform(-2, 2)]) for _ in range(g * groups)]
            w = [float(rng.randint(1, 9)) for _ in r]
            if all(math.isnan(x) for x in r):
                continue
            got = reinforce_pp_advantages(
                torch.tensor(r, dtype=F64), g, baseline=baseline, std=std, weights=torch.tensor(w)
            )
            want = _loop_reinforce(r, g, baseline, std, 1e-4, w)
            torch.testing.assert_close(got, torch.tensor(want, dtype=F64), rtol=1e-12, atol=1e-12)


def test_rloo_against_a_loop():
    rng = random.Random(3)
    for g, groups in [(2, 1), (3, 4), (8, 3)]:
        r = [rng.choice([0.0, 1.0, float("nan"), rng.uniform(-1, 1)]) for _ in range(g * groups)]
        want = []
        for i, v in enumerate(r):
            b = i // g
            others = [r[j] for j in range(b * g, (b + 1) * g) if j != i and not math.isnan(r[j])]
            want.append(0.0 if math.isnan(v) or not others else v - sum(others) / len(others))
        torch.testing.assert_close(
            rloo_advantages(torch.tensor(r, dtype=F64), g), torch.tensor(want, dtype=F64)
        )


def test_estimator_registry_and_user_estimators():
    r = torch.tensor([1.0, 0.0, 1.0, 1.0])
    torch.testing.assert_close(estimate_advantages("rloo", r, 2), rloo_advantages(r, 2))
    torch.testing.assert_close(
        estimate_advantages("grpo", r, 2, scale="none"), torch.tensor([0.5, -0.5, 0.0, 0.0])
    )
    seen = {}

    def mine(rewards, group_size, shift=0.0):
        seen["dtype"] = rewards.dtype
        return rewards * 0 + shift

    register_advantage("test_mine", mine)
    out = estimate_advantages("test_mine", r, 2, shift=2.0)
    assert out.dtype == r.dtype and out.tolist() == [2.0] * 4 and seen["dtype"] == torch.float64
    register_advantage("test_wrong", lambda rewards, group_size: rewards[:1])
    with pytest.raises(ValueError, match="one advantage per completion"):
        estimate_advantages("test_wrong", r, 2)
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        estimate_advantages("nope", r, 2)
    # A NaN from a plug-in estimator is named as the estimator's, not left for the loss to blame the lr on.
    register_advantage("test_nan", lambda rewards, group_size: rewards / (rewards - rewards))
    with pytest.raises(
        ValueError, match=r"estimator 'test_nan' returned 4 non-finite advantage\(s\) \(rows \[0, 1"
    ):
        estimate_advantages("test_nan", r, 2)
    # Every built-in gives a row with no reward (NaN) a finite 0.
    nan_row = torch.tensor([1.0, float("nan"), 0.0, 1.0], dtype=torch.float64)
    for name in ("grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"):
        assert torch.isfinite(estimate_advantages(name, nan_row, 2)).all(), name


@pytest.mark.parametrize(
    "call, fragment",
    [
        (lambda: rloo_advantages(torch.zeros(2, 2), 2), "1-D"),
        (lambda: rloo_advantages(torch.zeros(5), 2), "not divisible"),
        (lambda: reinforce_pp_advantages(torch.zeros(4), 2, std="mad"), "unknown std"),
        (lambda: reinforce_pp_advantages(torch.zeros(4), 2, weights=torch.ones(3)), "weights has shape"),
        (lambda: reinforce_pp_advantages(torch.zeros(4), 2, weights=-torch.ones(4)), "weights must be >= 0"),
        (lambda: reinforce_pp_advantages(torch.zeros(4), 2, eps=-1.0), "eps must be >= 0"),
    ],
)
def test_bad_input(call, fragment):
    with pytest.raises(ValueError, match=fragment):
        call()
