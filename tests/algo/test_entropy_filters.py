"""token_entropy (chunked) against torch.distributions, and DAPO's row filters."""

from __future__ import annotations

import math

import pytest
import torch

from cohort.algo import group_advantages, token_entropy, truncation_mask, zero_std_group_mask

F64 = torch.float64


@pytest.mark.parametrize("chunk_size", [1, 2, 5, 1024])
def test_entropy_matches_categorical_for_any_chunk_size(chunk_size):
    logits = torch.randn(2, 3, 7, generator=torch.Generator().manual_seed(0), dtype=F64)
    want = torch.distributions.Categorical(logits=logits).entropy()  # [2, 3]
    got = token_entropy(logits, chunk_size=chunk_size)
    assert got.shape == (2, 3)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_entropy_by_hand():
    # Uniform over 4 tokens: H = log 4 = 1.386294. One token with all the mass (logits 0 vs -1e4): H = 0.
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.0, -1e4, -1e4, -1e4]], dtype=F64)
    torch.testing.assert_close(
        token_entropy(logits), torch.tensor([math.log(4), 0.0], dtype=F64), rtol=0, atol=1e-12
    )


def test_entropy_upcasts_low_precision_and_is_differentiable():
    logits = torch.randn(4, 9, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    got = token_entropy(logits, chunk_size=3)
    assert got.dtype == torch.float32
    torch.testing.assert_close(
        got, torch.distributions.Categorical(logits=logits.float()).entropy(), rtol=0, atol=1e-5
    )

    x = torch.randn(5, 6, dtype=F64, requires_grad=True)
    (g_chunked,) = torch.autograd.grad(token_entropy(x, chunk_size=2).sum(), x)
    (g_ref,) = torch.autograd.grad(torch.distributions.Categorical(logits=x).entropy().sum(), x)
    torch.testing.assert_close(g_chunked, g_ref, rtol=0, atol=1e-12)


def test_entropy_bad_input():
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        token_entropy(torch.zeros(2, 3), chunk_size=0)
    with pytest.raises(ValueError, match="floating"):
        token_entropy(torch.zeros(2, 3, dtype=torch.long))
    assert token_entropy(torch.zeros(0, 5)).shape == (0,)


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
