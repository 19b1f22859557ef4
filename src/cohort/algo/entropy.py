"""Entropy regularisation: an entropy bonus in the loss, with Skywork-OR1's adaptive coefficient.

The objective becomes L = L_policy - c * H, where H is the mean per-token entropy of the policy over the
optimizer step's loss tokens (independent of how the policy term aggregates, so one c means the same for
every loss type). With the adaptive controller (Skywork-OR1, arXiv 2505.22312; TRL's
`use_adaptive_entropy`), c moves by `delta` after each optimizer step, up when the step's entropy was at or
below the target and down otherwise, within [low, high], and the bonus applies only while the last measured
entropy is at or below the target. Formulas and defaults: docs/algorithms.md.
"""

from __future__ import annotations

import math

import torch


def entropy_bonus(entropy: torch.Tensor, mask: torch.Tensor, coef: float, num_tokens: float) -> torch.Tensor:
    """Returns -coef * sum(entropy * mask) / num_tokens: one micro-batch's share of the entropy term.

    `entropy` and `mask` are [n, T]; `num_tokens` counts the loss tokens of the whole optimizer step (every
    micro-batch and process), so the shares of its micro-batches add up to -coef * H.
    """
    if entropy.shape != mask.shape:
        raise ValueError(f"entropy {tuple(entropy.shape)} and mask {tuple(mask.shape)} must have one shape")
    if not num_tokens > 0:
        raise ValueError(f"num_tokens={num_tokens} must be > 0 (the optimizer step's loss tokens)")
    return -coef * (entropy * mask.to(entropy.dtype)).sum() / num_tokens


def applied_entropy_coef(coef: float, last_entropy: float | None, *, target: float, adaptive: bool) -> float:
    """Returns the coefficient the next optimizer step applies: `coef`, or under the adaptive controller 0
    while the last measured entropy is above `target` (before any measurement the coefficient applies)."""
    if not adaptive or last_entropy is None or last_entropy <= target:
        return coef
    return 0.0


def adapt_entropy_coef(
    coef: float, entropy: float, *, target: float, delta: float, low: float, high: float
) -> float:
    """Returns the adaptive controller's next coefficient: coef + delta when `entropy` <= `target`, else
    coef - delta, clamped to [low, high]."""
    if not math.isfinite(entropy):
        raise ValueError(f"the measured entropy is {entropy}: the controller needs a finite value")
    moved = coef + delta if entropy <= target else coef - delta
    return min(max(moved, low), high)
