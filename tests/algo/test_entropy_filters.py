"""DAPO's row filters: zero-std groups and truncated completions."""

from __future__ import annotations

import pytest
import torch

from cohort.algo import group_advantages, truncation_mask, zero_std_group_mask


def test_zero_std_group_mask():
    # Groups of 3: [1, 1, 1] all equal; [0, 1, 0] varies; [2, NaN, 2] equal among the non-NaN;
    # [NaN, 5, NaN] one reward only -> nothing to compare; [NaN, NaN, NaN] no reward at all.
    nan = float("nan")
    rewards = torch.tensor([1, 1, 1, 0, 1, 0, 2, nan, 2, nan, 5, nan, nan, nan, nan])
    want = [True] * 3 + [False] * 3 + [True] * 3 + [True] * 3 + [True] * 3
    assert zero_std_group_mask(rewards, 3).tolist() == want


def test_zero_std_groups_are_exactly_the_zero_advantage_groups():
    g = torch.Generator().manual_seed(3)
    rewards = torch.randint(0, 2, (64,), generator=g).float()  # binary rewards: half the pairs are constant
    zero = zero_std_group_mask(rewards, 2)
    adv = group_advantages(rewards, 2)
    assert zero.any() and (~zero).any()
    assert torch.equal(adv[zero], torch.zeros(int(zero.sum())))
    assert (adv[~zero] != 0).all()


def test_truncation_mask():
    truncated = torch.tensor([False, True, False])
    assert truncation_mask(truncated).tolist() == [True, False, True]
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
    assert truncation_mask(truncated, mask).tolist() == [
        [True, True, False],
        [False, False, False],
        [True, False, False],
    ]
    with pytest.raises(ValueError, match=r"\(2, 3\)"):
        truncation_mask(truncated, torch.ones(2, 3))
    with pytest.raises(ValueError, match="1-D"):
        truncation_mask(torch.zeros(3, 1, dtype=torch.bool))


def test_filters_bad_group_size():
    with pytest.raises(ValueError, match="5 rows.*group_size=2"):
        zero_std_group_mask(torch.zeros(5), 2)
