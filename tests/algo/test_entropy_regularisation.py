"""cohort.algo.entropy: the entropy bonus and Skywork-OR1's adaptive coefficient, against their formulas."""

from __future__ import annotations

import pytest
import torch

from cohort.algo import adapt_entropy_coef, applied_entropy_coef, entropy_bonus


def test_the_bonus_is_minus_coef_times_the_masked_entropy_over_the_step_tokens():
    entropy = torch.tensor([[1.0, 2.0, 9.0], [0.5, 0.5, 0.5]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    # (1 + 2 + 0.5) / 5 tokens of the whole step (this micro-batch holds 3 of them), times -0.1
    assert float(entropy_bonus(entropy, mask, 0.1, 5)) == pytest.approx(-0.1 * 3.5 / 5)
    # Micro-batch shares add up to the step's mean.
    a = entropy_bonus(entropy[:1], mask[:1], 0.1, 3)
    b = entropy_bonus(entropy[1:], mask[1:], 0.1, 3)
    assert float(a + b) == pytest.approx(-0.1 * 3.5 / 3)


def test_the_bonus_carries_the_entropy_gradient():
    logits = torch.randn(2, 3, 5, requires_grad=True)
    logp = logits.log_softmax(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    entropy_bonus(entropy, torch.ones(2, 3, dtype=torch.bool), 1.0, 6).backward()
    assert logits.grad is not None and logits.grad.abs().max() > 0


@pytest.mark.parametrize("bad", [dict(num_tokens=0), dict(mask=torch.ones(2, 2, dtype=torch.bool))])
def test_the_bonus_refuses_bad_input(bad):
    args = dict(entropy=torch.ones(2, 3), mask=torch.ones(2, 3, dtype=torch.bool), coef=0.1, num_tokens=6)
    args.update(bad)
    with pytest.raises(ValueError):
        entropy_bonus(**args)


def test_the_adaptive_coefficient_moves_by_delta_within_its_bounds():
    step = dict(target=0.2, delta=0.005, low=0.0, high=0.01)
    assert adapt_entropy_coef(0.003, 0.1, **step) == pytest.approx(0.008)  # below the target: up
    assert adapt_entropy_coef(0.003, 0.2, **step) == pytest.approx(0.008)  # at the target: up
    assert adapt_entropy_coef(0.008, 0.1, **step) == 0.01  # clamped at high
    assert adapt_entropy_coef(0.003, 0.5, **step) == 0.0  # above: down, clamped at low
    with pytest.raises(ValueError, match="finite"):
        adapt_entropy_coef(0.003, float("nan"), **step)


def test_the_adaptive_bonus_applies_only_at_or_below_the_target():
    assert (
        applied_entropy_coef(0.3, 0.5, target=0.2, adaptive=False) == 0.3
    )  # a fixed coefficient always applies
    assert applied_entropy_coef(0.3, 0.5, target=0.2, adaptive=True) == 0.0
    assert applied_entropy_coef(0.3, 0.2, target=0.2, adaptive=True) == 0.3
    assert applied_entropy_coef(0.3, None, target=0.2, adaptive=True) == 0.3  # nothing measured yet
