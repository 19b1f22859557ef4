"""Token selections (top-entropy mask, covariance, Clip-Cov, KL-Cov) and the sampler's importance weights."""

from __future__ import annotations

import math
import random

import pytest
import torch

from cohort.algo import (
    clip_cov_mask,
    kl_cov_mask,
    sampler_correction,
    token_covariance,
    top_entropy_mask,
)

F64 = torch.float64


def test_top_entropy_mask_by_hand():
    # Valid entropies [0.1, 0.5, 0.9, 0.3, 0.7] (the 6th token is padding): the 0.6 quantile of five values by
    # linear interpolation is 0.58, so quantile=0.4 keeps 0.7 and 0.9.
    ent = torch.tensor([[0.1, 0.5, 0.9], [0.3, 0.7, 5.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    assert top_entropy_mask(ent, mask, 0.4).tolist() == [[False, False, True], [False, True, False]]
    assert torch.equal(top_entropy_mask(ent, mask, 1.0), mask)
    assert not top_entropy_mask(ent, torch.zeros_like(mask), 0.2).any()
    # Ties at the threshold are kept.
    assert top_entropy_mask(torch.ones(2, 2), torch.ones(2, 2, dtype=torch.bool), 0.25).all()


def test_top_entropy_mask_keeps_about_the_share():
    g = torch.Generator().manual_seed(0)
    ent = torch.rand(20, 50, generator=g)
    mask = torch.rand(20, 50, generator=g) < 0.7
    for q in (0.05, 0.2, 0.5, 0.9):
        kept = top_entropy_mask(ent, mask, q)
        assert not (kept & ~mask).any()
        assert abs(int(kept.sum()) - q * int(mask.sum())) <= 1
        assert ent[kept].min() >= ent[mask & ~kept].max()


def test_token_covariance_by_hand_and_against_a_loop():
    # Tokens logp [-1, -3] (row 0, A = 1) and [-2] (row 1, A = -2); means: logp -2, A (1 + 1 - 2) / 3 = 0.
    # cov = (-1 + 2)(1 - 0) = 1, (-3 + 2)(1) = -1, (-2 + 2)(-2) = 0.
    logp = torch.tensor([[-1.0, -3.0], [-2.0, 9.0]], dtype=F64)
    mask = torch.tensor([[True, True], [True, False]])
    cov = token_covariance(logp, torch.tensor([1.0, -2.0], dtype=F64), mask)
    torch.testing.assert_close(cov, torch.tensor([[1.0, -1.0], [0.0, 0.0]], dtype=F64))
    rng = random.Random(0)
    for n, t in [(1, 1), (3, 4), (5, 7)]:
        lp = torch.tensor([[rng.uniform(-4, 0) for _ in range(t)] for _ in range(n)], dtype=F64)
        adv = torch.tensor([[rng.uniform(-2, 2) for _ in range(t)] for _ in range(n)], dtype=F64)
        m = torch.tensor([[rng.random() < 0.8 for _ in range(t)] for _ in range(n)])
        cells = [(i, j) for i in range(n) for j in range(t) if m[i, j]]
        if not cells:
            continue
        ml = sum(float(lp[c]) for c in cells) / len(cells)
        ma = sum(float(adv[c]) for c in cells) / len(cells)
        want = torch.zeros(n, t, dtype=F64)
        for c in cells:
            want[c] = (float(lp[c]) - ml) * (float(adv[c]) - ma)
        torch.testing.assert_close(token_covariance(lp, adv, m), want)


def test_kl_cov_takes_the_top_tokens():
    cov = torch.tensor([[0.5, 3.0, -1.0], [2.0, 9.0, 0.0]])
    mask = torch.tensor([[True, True, True], [True, False, True]])  # 9.0 is padding
    # 5 valid tokens, ratio 0.4 -> k = 2: covariances 3.0 and 2.0.
    assert kl_cov_mask(cov, mask, ratio=0.4).tolist() == [[False, True, False], [True, False, False]]
    # k is at least 1.
    assert int(kl_cov_mask(cov, mask, ratio=1e-6).sum()) == 1
    assert not kl_cov_mask(cov, torch.zeros_like(mask), ratio=0.5).any()


def test_clip_cov_draws_inside_the_band_reproducibly():
    g = torch.Generator().manual_seed(0)
    cov = torch.randn(10, 30, generator=g) * 3
    mask = torch.rand(10, 30, generator=g) < 0.8
    a = clip_cov_mask(cov, mask, ratio=0.05, low=1.0, high=5.0, generator=torch.Generator().manual_seed(1))
    b = clip_cov_mask(cov, mask, ratio=0.05, low=1.0, high=5.0, generator=torch.Generator().manual_seed(1))
    assert torch.equal(a, b)
    assert int(a.sum()) == max(1, int(0.05 * int(mask.sum())))
    assert ((cov[a] >= 1.0) & (cov[a] <= 5.0)).all() and not (a & ~mask).any()
    # Fewer candidates than k: all of them.
    few = torch.zeros(2, 3)
    few[0, 1] = 2.0
    got = clip_cov_mask(few, torch.ones(2, 3, dtype=torch.bool), ratio=1.0, low=1.0, high=5.0)
    assert got.tolist() == [[False, True, False], [False, False, False]]


def test_sampler_correction_by_hand():
    # Token log-ratios train - sampler: [ln 3, ln 0.5] and [ln 1.5, (pad)].
    train = torch.tensor([[math.log(3.0), math.log(0.5)], [math.log(1.5), 0.0]], dtype=F64)
    sampler = torch.zeros(2, 2, dtype=F64)
    mask = torch.tensor([[True, True], [True, False]])
    w, m = sampler_correction(train, sampler, mask, level="token", mode="truncate", max_ratio=2.0)
    torch.testing.assert_close(w, torch.tensor([[2.0, 0.5], [1.5, 0.0]], dtype=F64))
    assert abs(m["is_ratio/max"].item() - 3.0) < 1e-12 and abs(m["is_ratio/min"].item() - 0.5) < 1e-12
    assert (
        abs(m["is_ratio/mean"].item() - 5.0 / 3) < 1e-12
        and abs(m["is_ratio/corrected_frac"].item() - 1 / 3) < 1e-12
    )
    w, _ = sampler_correction(train, sampler, mask, level="token", mode="mask", max_ratio=2.0, min_ratio=0.6)
    torch.testing.assert_close(w, torch.tensor([[0.0, 0.0], [1.5, 0.0]], dtype=F64))
    # Sequence level: row 0's ratio is 3 * 0.5 = 1.5 on both tokens, row 1's 1.5.
    w, _ = sampler_correction(train, sampler, mask, level="sequence", mode="truncate", max_ratio=1.2)
    torch.testing.assert_close(w, torch.tensor([[1.2, 1.2], [1.2, 0.0]], dtype=F64))
    w, _ = sampler_correction(train, sampler, mask, level="sequence", mode="mask", max_ratio=2.0)
    torch.testing.assert_close(w, torch.tensor([[1.5, 1.5], [1.5, 0.0]], dtype=F64))


def test_sampler_correction_stays_finite_and_detached():
    train = torch.tensor([[0.0, -1e4]], requires_grad=True)
    sampler = torch.tensor([[-1e4, 0.0]])
    w, m = sampler_correction(
        train, sampler, torch.ones(1, 2, dtype=torch.bool), level="sequence", mode="mask"
    )
    assert torch.isfinite(w).all() and not w.requires_grad and all(torch.isfinite(v) for v in m.values())


@pytest.mark.parametrize(
    "call, fragment",
    [
        (
            lambda: top_entropy_mask(torch.zeros(2, 2), torch.ones(2, 2, dtype=torch.bool), 0.0),
            r"in \(0, 1\]",
        ),
        (
            lambda: top_entropy_mask(torch.zeros(2, 2), torch.ones(2, 3, dtype=torch.bool), 0.5),
            "must be \\[N, T\\]",
        ),
        (
            lambda: kl_cov_mask(torch.zeros(2, 2), torch.ones(2, 2, dtype=torch.bool), ratio=1.5),
            r"in \(0, 1\]",
        ),
        (
            lambda: clip_cov_mask(
                torch.zeros(2, 2), torch.ones(2, 2, dtype=torch.bool), ratio=0.1, low=5, high=1
            ),
            "low must be < high",
        ),
        (
            lambda: token_covariance(torch.zeros(2, 2), torch.zeros(3), torch.ones(2, 2, dtype=torch.bool)),
            "advantages has shape",
        ),
        (
            lambda: sampler_correction(
                torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool), max_ratio=1.0
            ),
            "max_ratio must be > 1",
        ),
        (
            lambda: sampler_correction(
                torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool), min_ratio=1.0
            ),
            r"min_ratio must be in \[0, 1\)",
        ),
        (
            lambda: sampler_correction(
                torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool), level="row"
            ),
            "unknown level",
        ),
        (
            lambda: sampler_correction(
                torch.zeros(1, 2), torch.zeros(1, 3), torch.ones(1, 2, dtype=torch.bool)
            ),
            "must all be \\[N, T\\]",
        ),
    ],
)
def test_bad_input(call, fragment):
    with pytest.raises(ValueError, match=fragment):
        call()
