"""Advantages: the seeds' worked examples by hand, vectorised code against plain loops, and properties."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cohort.algo import (
    combine_rewards,
    group_advantages,
    process_advantages,
    process_advantages_to_tokens,
)

F64 = torch.float64


def t64(values):
    return torch.tensor(values, dtype=F64)


# ---------------------------------------------------------------------------------------------------------
# Worked examples (arithmetic in the comments; expected values derived from the formula, not copied).
# ---------------------------------------------------------------------------------------------------------


def test_seed_7x8_example_population_std():
    # rewards [1, 1, 0, 1]: mean = 3/4 = 0.75; population var = (3 * 0.25^2 + 0.75^2) / 4 = 0.1875,
    # std = sqrt(0.1875) = 0.4330127; A = 0.25 / 0.4330127 = 0.5773503 = 1/sqrt(3), -0.75 / 0.4330127 = -sqrt(3).
    adv = group_advantages(t64([1, 1, 0, 1]), 4, std="population", eps=0.0)
    s3 = math.sqrt(3)
    torch.testing.assert_close(adv, t64([1 / s3, 1 / s3, -s3, 1 / s3]), rtol=0, atol=1e-12)
    # With the default eps = 1e-4 added to the std: 0.25 / 0.4331127 = 0.577217 (still ~0.577).
    adv = group_advantages(t64([1, 1, 0, 1]), 4, std="population")
    torch.testing.assert_close(
        adv, t64([0.25, 0.25, -0.75, 0.25]) / (math.sqrt(0.1875) + 1e-4), rtol=0, atol=1e-12
    )
    assert abs(adv[0].item() - 0.577) < 1e-3 and abs(adv[2].item() + 1.732) < 1e-3


def test_seed_7x8_example_sample_std():
    # Same rewards, unbiased std: var = 0.75 / 3 = 0.25, std = 0.5; A = 0.25 / 0.5 = 0.5, -0.75 / 0.5 = -1.5.
    adv = group_advantages(t64([1, 1, 0, 1]), 4, std="sample", eps=0.0)
    torch.testing.assert_close(adv, t64([0.5, 0.5, -1.5, 0.5]), rtol=0, atol=1e-12)


def test_seed_apples_example_mean_only():
    # rewards [1.5, 1.0, 0, 0]: mean = 2.5 / 4 = 0.625; differences 0.875, 0.375, -0.625, -0.625 (Dr. GRPO).
    adv = group_advantages(t64([1.5, 1.0, 0.0, 0.0]), 4, scale="none")
    torch.testing.assert_close(adv, t64([0.875, 0.375, -0.625, -0.625]), rtol=0, atol=1e-12)


def test_seed_eight_reward_example_is_recomputed_not_copied():
    # The seed prints "mean 0.875, std 0.637, advantages [0.82 -1.23 ...]" for these rewards; that is wrong.
    # sum = 1.5 + 0 + 1.5 + 0 + 1.0 + 1.5 + 0.5 + 1.5 = 7.5, mean = 7.5 / 8 = 0.9375.
    # squared deviations: 4 * 0.5625^2 + 2 * 0.9375^2 + 0.0625^2 + 0.4375^2
    #   = 4 * 0.31640625 + 2 * 0.87890625 + 0.00390625 + 0.19140625 = 3.21875; population var = 0.40234375,
    #   std = 0.6343057; A(1.5) = 0.5625 / 0.6343057 = 0.886796, A(0) = -1.477994, A(1.0) = 0.098533,
    #   A(0.5) = -0.689730.
    rewards = t64([1.5, 0.0, 1.5, 0.0, 1.0, 1.5, 0.5, 1.5])
    adv = group_advantages(rewards, 8, std="population", eps=0.0)
    sd = math.sqrt(3.21875 / 8)
    expected = (rewards - 0.9375) / sd
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(adv[:2], t64([0.886796, -1.477994]), rtol=0, atol=1e-6)
    assert abs(adv[0].item() - 0.82) > 0.05  # the printed value really is off


def test_constant_group_is_exactly_zero_for_every_scale():
    # 0.1 * 3 / 3 != 0.1 in floating point, so centring alone could leave residues; the result must be 0.
    rewards = torch.tensor([0.1, 0.1, 0.1, 0.7, 0.7, 0.7, 1.0, 0.0, 0.2])
    for scale in ("group", "batch", "none"):
        for std in ("sample", "population"):
            adv = group_advantages(rewards, 3, scale=scale, std=std, eps=0.0)
            assert torch.equal(adv[:6], torch.zeros(6)), (scale, std, adv)
            assert (adv[6:] != 0).all()


def test_nan_rewards_get_zero_and_are_left_out_of_statistics():
    # Group 1: [1, NaN, 0, 1] -> statistics over [1, 0, 1]: mean 2/3, sample std = sqrt((2*(1/3)^2 + (2/3)^2)/2)
    # = sqrt(1/3) = 0.57735; A = (1/3)/0.57735 = 0.57735, (-2/3)/0.57735 = -1.1547. Group 2: [NaN, 5, NaN, NaN]:
    # one valid reward, so no comparison is possible: all 0.
    adv = group_advantages(
        t64([1, float("nan"), 0, 1, float("nan"), 5, float("nan"), float("nan")]), 4, eps=0.0
    )
    s = math.sqrt(1 / 3)
    torch.testing.assert_close(
        adv, t64([1 / 3 / s, 0, -2 / 3 / s, 1 / 3 / s, 0, 0, 0, 0]), rtol=0, atol=1e-12
    )


def test_batch_scale_uses_group_mean_and_batch_std():
    # Groups [0, 1] and [10, 12]; group means 0.5 and 11. Batch std (sample) of [0, 1, 10, 12]: mean 5.75,
    # squares 33.0625 + 22.5625 + 18.0625 + 39.0625 = 112.75, var = 112.75 / 3 = 37.5833, std = 6.13052.
    adv = group_advantages(t64([0, 1, 10, 12]), 2, scale="batch", eps=0.0)
    sd = math.sqrt(112.75 / 3)
    torch.testing.assert_close(adv, t64([-0.5, 0.5, -1, 1]) / sd, rtol=0, atol=1e-12)


def _loop_group_advantages(rewards, g, scale, std, eps):
    n = len(rewards)
    out = [0.0] * n
    finite = [r for r in rewards if not math.isnan(r)]

    def sd_of(xs):
        m = sum(xs) / len(xs)
        ss = sum((x - m) ** 2 for x in xs)
        dof = len(xs) - 1 if std == "sample" else len(xs)
        return math.sqrt(ss / dof) if dof > 0 else 0.0

    batch_sd = sd_of(finite) if finite else 0.0
    for j in range(0, n, g):
        vals = [r for r in rewards[j : j + g] if not math.isnan(r)]
        if len(vals) <= 1 or max(vals) == min(vals):
            continue
        m = sum(vals) / len(vals)
        denom = {"group": sd_of(vals) + eps, "batch": batch_sd + eps, "none": 1.0}[scale]
        for i in range(j, j + g):
            if not math.isnan(rewards[i]):
                out[i] = (rewards[i] - m) / denom
    return out


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("std", ["sample", "population"])
def test_group_advantages_matches_loop_reference(scale, std):
    rng = random.Random(0)
    for g in (1, 2, 3, 5, 8):
        for n_groups in (1, 2, 4):
            for _ in range(3):
                rewards = [
                    float("nan") if rng.random() < 0.15 else rng.choice([0.0, 1.0, rng.uniform(-3, 3)])
                    for _ in range(g * n_groups)
                ]
                got = group_advantages(t64(rewards), g, scale=scale, std=std, eps=1e-4)
                want = t64(_loop_group_advantages(rewards, g, scale, std, 1e-4))
                torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_group_advantages_keeps_float32_and_accepts_ints():
    assert group_advantages(torch.tensor([1.0, 0.0]), 2).dtype == torch.float32
    assert group_advantages(torch.tensor([1, 0]), 2).dtype == torch.get_default_dtype()


@settings(max_examples=60, deadline=None)
@given(
    g=st.integers(1, 8),
    n_groups=st.integers(1, 4),
    scale=st.sampled_from(["group", "batch", "none"]),
    std=st.sampled_from(["sample", "population"]),
    data=st.data(),
)
def test_property_advantages_sum_to_zero_in_each_group(g, n_groups, scale, std, data):
    values = st.one_of(st.floats(-100, 100), st.just(float("nan")), st.sampled_from([0.0, 1.0]))
    rewards = t64(data.draw(st.lists(values, min_size=g * n_groups, max_size=g * n_groups)))
    adv = group_advantages(rewards, g, scale=scale, std=std)
    assert torch.isfinite(adv).all()
    assert (adv[torch.isnan(rewards)] == 0).all()
    sums = adv.view(n_groups, g).sum(-1)
    scale_of = adv.view(n_groups, g).abs().amax(-1).clamp(min=1.0)
    assert (sums.abs() <= 1e-9 * scale_of).all(), sums


# ---------------------------------------------------------------------------------------------------------
# combine_rewards
# ---------------------------------------------------------------------------------------------------------


def test_combine_sum_skips_nan_and_none():
    # Row 0: 2 * 1 = 2 (second reward not applicable); row 1: nothing applies -> NaN; row 2: 2 * 0.5 + 1 * 2 = 3.
    nan = float("nan")
    got = combine_rewards(t64([[1.0, nan], [nan, nan], [0.5, 2.0]]), [2.0, 1.0], 3)
    assert got[0].item() == 2.0 and math.isnan(got[1].item()) and got[2].item() == 3.0
    got_none = combine_rewards([[1.0, None], [None, None], [0.5, 2.0]], [2.0, 1.0], 3)
    assert got_none[0].item() == 2.0 and math.isnan(got_none[1].item()) and got_none[2].item() == 3.0
    # weights=None means every weight is 1: 1 + 0 = 1.
    assert combine_rewards(t64([[1.0, 0.0]]), None, 1).tolist() == [1.0]


def test_combine_decoupled_hand_example():
    # Groups of 2, rewards (r1, r2): group 0 = (1, 0), (0, 0); group 1 = (1, 1), (1, 0). Population std, eps 0.
    # Column z-scores per group: r1 g0 [1, 0] -> [1, -1]; r2 g0 [0, 0] -> [0, 0]; r1 g1 [1, 1] -> [0, 0];
    # r2 g1 [1, 0] -> [1, -1]. Weighted sum with w = (1, 0.5): s = [1, -1, 0.5, -0.5].
    # Batch: mean 0, var = (1 + 1 + 0.25 + 0.25) / 4 = 0.625, std = 0.790569; A = s / 0.790569.
    r = t64([[1, 0], [0, 0], [1, 1], [1, 0]])
    got = combine_rewards(r, [1.0, 0.5], 2, mode="decoupled", std="population", eps=0.0)
    torch.testing.assert_close(got, t64([1, -1, 0.5, -0.5]) / math.sqrt(0.625), rtol=0, atol=1e-12)
    # The plain weighted sum would give [1, 0, 1.5, 1]: group 1's two different reward pairs still differ,
    # but a GRPO z-score maps (1,0)-vs-(0,0) and (1,1)-vs-(1,0) to the same +-1 (GDPO's "collapse").
    summed = combine_rewards(r, [1.0, 0.5], 2)
    torch.testing.assert_close(
        group_advantages(summed, 2, std="population", eps=0.0), t64([1, -1, 1, -1]), rtol=0, atol=1e-12
    )
    # docs/algorithms.md's example, equal weights: (1, 1) vs (0, 0) gets twice the advantage of (1, 0) vs (0, 0),
    # where the plain sum's z-scores are +-1 for both. Column z-scores [1, -1] twice in group 0, [1, -1] and [0, 0]
    # in group 1: s = [2, -2, 1, -1], batch std sqrt(2.5) -> [1.265, -1.265, 0.632, -0.632] (population).
    both = combine_rewards(
        t64([[1, 1], [0, 0], [1, 0], [0, 0]]), [1.0, 1.0], 2, mode="decoupled", std="population", eps=0.0
    )
    torch.testing.assert_close(both, t64([2, -2, 1, -1]) / math.sqrt(2.5), rtol=0, atol=1e-12)


def _loop_decoupled(rewards, weights, g, std, eps):
    n, k = len(rewards), len(weights)
    z = [[0.0] * k for _ in range(n)]
    for c in range(k):
        col = [row[c] for row in rewards]
        adv = _loop_group_advantages(col, g, "group", std, eps)
        for i in range(n):
            z[i][c] = adv[i]
    s = [sum(w * zc for w, zc in zip(weights, z[i])) for i in range(n)]
    valid = [i for i in range(n) if any(not math.isnan(v) for v in rewards[i])]
    vals = [s[i] for i in valid]
    if len(vals) <= 1 or max(vals) == min(vals):
        return [0.0] * n
    m = sum(vals) / len(vals)
    dof = len(vals) - 1 if std == "sample" else len(vals)
    sd = math.sqrt(sum((v - m) ** 2 for v in vals) / dof)
    return [(s[i] - m) / (sd + eps) if i in valid else 0.0 for i in range(n)]


@pytest.mark.parametrize("std", ["sample", "population"])
def test_combine_decoupled_matches_loop_reference(std):
    rng = random.Random(1)
    for g in (1, 2, 4):
        for n_groups in (1, 3):
            for k in (1, 2, 3):
                rewards = [
                    [float("nan") if rng.random() < 0.2 else float(rng.choice([0, 1, 2])) for _ in range(k)]
                    for _ in range(g * n_groups)
                ]
                weights = [rng.uniform(0.1, 2.0) for _ in range(k)]
                got = combine_rewards(t64(rewards), weights, g, mode="decoupled", std=std)
                want = t64(_loop_decoupled(rewards, weights, g, std, 1e-4))
                torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


# ---------------------------------------------------------------------------------------------------------
# Process supervision
# ---------------------------------------------------------------------------------------------------------


def test_process_advantages_hand_example():
    # One group of 2 completions; steps [1, 0, 1] and [0, 0]. All 5 step rewards: mean 0.4,
    # population var = (2 * 0.6^2 + 3 * 0.4^2) / 5 = (0.72 + 0.48) / 5 = 0.24, std = 0.489898.
    # Normalised: 1 -> 0.6 / 0.489898 = 1.224745, 0 -> -0.4 / 0.489898 = -0.816497.
    # Return-to-go, row 0: [1.2247 - 0.8165 + 1.2247, -0.8165 + 1.2247, 1.2247] = [1.632993, 0.408248, 1.224745];
    # row 1: [-1.632993, -0.816497].
    hi, lo = 0.6 / math.sqrt(0.24), -0.4 / math.sqrt(0.24)
    got = process_advantages([t64([1, 0, 1]), t64([0, 0])], 2, std="population", eps=0.0)
    torch.testing.assert_close(got[0], t64([hi + lo + hi, lo + hi, hi]), rtol=0, atol=1e-12)
    torch.testing.assert_close(got[1], t64([2 * lo, lo]), rtol=0, atol=1e-12)
    torch.testing.assert_close(got[0], t64([1.632993, 0.408248, 1.224745]), rtol=0, atol=1e-6)


def test_process_return_to_go_matches_seed_diagram():
    # Seed 000's diagram: normalised step rewards [0.5, -0.2, 0.8, 0.3] -> advantages [1.4, 0.9, 1.1, 0.3]
    # (0.3; 0.8 + 0.3 = 1.1; -0.2 + 1.1 = 0.9; 0.5 + 0.9 = 1.4). Build a group of 4 completions whose step
    # rewards normalise to exactly those values: z, -z, [a], [-a] has mean 0 and population variance
    # (2 * sum(z^2) + 2 a^2) / 10 = (2 * 1.02 + 2 a^2) / 10, which is 1 for a^2 = 3.98; then r~ = r.
    z = [0.5, -0.2, 0.8, 0.3]
    a = math.sqrt(3.98)
    rows = [t64(z), t64([-v for v in z]), t64([a]), t64([-a])]
    got = process_advantages(rows, 4, std="population", eps=0.0)
    torch.testing.assert_close(got[0], t64([1.4, 0.9, 1.1, 0.3]), rtol=0, atol=1e-12)


def _loop_process(step_rewards, g, std, eps):
    out = []
    for j in range(0, len(step_rewards), g):
        group = step_rewards[j : j + g]
        flat = [v for row in group for v in row if not math.isnan(v)]
        constant = len(flat) <= 1 or max(flat) == min(flat)
        if not constant:
            m = sum(flat) / len(flat)
            dof = len(flat) - 1 if std == "sample" else len(flat)
            sd = math.sqrt(sum((v - m) ** 2 for v in flat) / dof)
        for row in group:
            norm = [0.0 if constant or math.isnan(v) else (v - m) / (sd + eps) for v in row]
            out.append([sum(norm[k:]) for k in range(len(norm))])
    return out


@pytest.mark.parametrize("std", ["sample", "population"])
def test_process_advantages_matches_loop_reference(std):
    rng = random.Random(2)
    for g in (1, 2, 3):
        for n_groups in (1, 2):
            for _ in range(4):
                # Some completions have no steps; some steps have no reward (NaN); ties are common.
                rows = [
                    [
                        float("nan") if rng.random() < 0.1 else rng.choice([0.0, 1.0, rng.uniform(-1, 1)])
                        for _ in range(rng.randint(0, 4))
                    ]
                    for _ in range(g * n_groups)
                ]
                got = process_advantages([t64(r) for r in rows], g, std=std)
                want = _loop_process(rows, g, std, 1e-4)
                assert [len(x) for x in got] == [len(x) for x in want]
                for a, b in zip(got, want):
                    torch.testing.assert_close(a, t64(b), rtol=1e-10, atol=1e-10)


def test_process_advantages_to_tokens():
    # Completion 0: steps end at tokens 1 and 3 -> tokens 0-1 get A0, tokens 2-3 get A1, token 4 (after the
    # last step) gets 0. Completion 1: one step ending at token 0 -> [A, 0, 0, 0, 0]. Completion 2: no steps.
    adv = process_advantages_to_tokens(
        [t64([1.5, -2.0]), t64([3.0]), t64([])],
        [torch.tensor([1, 3]), torch.tensor([0]), torch.tensor([], dtype=torch.long)],
        5,
    )
    torch.testing.assert_close(
        adv, t64([[1.5, 1.5, -2.0, -2.0, 0.0], [3.0, 0, 0, 0, 0], [0, 0, 0, 0, 0]]), rtol=0, atol=0
    )


def test_process_advantages_to_tokens_matches_loop():
    rng = random.Random(3)
    for _ in range(20):
        length = rng.randint(1, 12)
        n = rng.randint(1, 5)
        advs, ends, want = [], [], []
        for _ in range(n):
            k = rng.randint(0, length)
            e = sorted(rng.sample(range(length), k))
            a = [rng.uniform(-1, 1) for _ in range(k)]
            row = []
            for t in range(length):
                later = [j for j, end in enumerate(e) if end >= t]
                row.append(a[later[0]] if later else 0.0)
            advs.append(t64(a))
            ends.append(torch.tensor(e, dtype=torch.long))
            want.append(row)
        torch.testing.assert_close(
            process_advantages_to_tokens(advs, ends, length), t64(want), rtol=0, atol=0
        )


# ---------------------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "call, fragments",
    [
        (lambda: group_advantages(torch.zeros(6), 4), ["6 rows", "group_size=4"]),
        (lambda: group_advantages(torch.zeros(4), 0), ["group_size", "0"]),
        (
            lambda: group_advantages(torch.zeros(4), 2, scale="prompt"),
            ["'prompt'", "'group'", "'batch'", "'none'"],
        ),
        (lambda: group_advantages(torch.zeros(4), 2, std="biased"), ["'biased'", "'sample'", "'population'"]),
        (lambda: group_advantages(torch.zeros(4, 1), 2), ["1-D", "(4, 1)"]),
        (lambda: group_advantages(torch.zeros(4), 2, eps=-1.0), ["eps", "-1.0"]),
        (lambda: combine_rewards(torch.zeros(4, 2), [1.0], 2), ["1 reward weights", "2 reward columns"]),
        (lambda: combine_rewards(torch.zeros(4, 2), None, 3), ["4 rows", "group_size=3"]),
        (lambda: combine_rewards(torch.zeros(4, 2), None, 2, mode="avg"), ["'avg'", "'sum'", "'decoupled'"]),
        (lambda: process_advantages([t64([1.0])] * 3, 2), ["3 rows", "group_size=2"]),
        (lambda: process_advantages([t64([1.0])] * 2, 2, std="x"), ["'x'", "'sample'"]),
        (
            lambda: process_advantages_to_tokens([t64([1.0, 2.0])], [torch.tensor([3, 1])], 5),
            ["strictly increasing", "[3, 1]"],
        ),
        (lambda: process_advantages_to_tokens([t64([1.0])], [torch.tensor([5])], 5), ["[0, 5)"]),
        (lambda: process_advantages_to_tokens([t64([1.0])], [torch.tensor([0, 1])], 5), ["(1,)", "(2,)"]),
    ],
)
def test_bad_input_raises_value_error_naming_the_value(call, fragments):
    with pytest.raises(ValueError) as info:
        call()
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))


def test_decoupled_gives_a_constant_group_exactly_zero_and_the_filter_judges_each_column():
    from cohort.algo import zero_std_group_mask

    # Group 0: both columns constant -> no signal. Group 1: the plain sum is constant (1 + 0 = 0 + 1) but
    # each column varies, so GDPO's weighted z-scores (1 - 0.5, -1 + 0.5) differ. Group 2: one column varies.
    r = t64([[1, 1], [1, 1], [1, 0], [0, 1], [0, 0], [0, 1]])
    adv = combine_rewards(r, [1.0, 0.5], 2, mode="decoupled")
    assert adv[:2].tolist() == [0.0, 0.0]  # exactly: the batch centring once left -7.5e-18 here
    assert (adv[2:] != 0).all()
    summed = combine_rewards(r, [1.0, 1.0], 2)
    assert zero_std_group_mask(summed, 2).tolist() == [True, True, True, True, False, False]
    # Judged per column, group 1 carries a signal and must not be filtered or resampled away.
    assert zero_std_group_mask(r, 2).tolist() == [True, True, False, False, False, False]
    # NaN = not applicable: a column with one valid reward in a group is constant there.
    nan = float("nan")
    assert zero_std_group_mask(t64([[1, nan], [1, 2]]), 2).tolist() == [True, True]
