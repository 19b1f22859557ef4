"""Per-token estimators of KL(pi_theta || pi_ref) from the log-probs of sampled tokens (Schulman, 2020).

The samples come from pi_old ~ pi_theta, so each estimator's *value* estimates the reverse KL
KL(pi_theta || pi_ref); what it does to the policy when differentiated as a loss term differs (see
`kl_estimate`). The log-ratio is clamped to [-clamp, clamp] before use so that log-probs of -1e4 (or -inf
padding) give finite values and finite gradients; outside the clamp the gradient is 0.
"""

from __future__ import annotations

import torch

from ._checks import check_choice, check_nonneg, check_tensor
from .options import KL_KINDS

#: Default bound on |log pi_ref - log pi_theta|; exp(20) ~ 4.9e8 still fits comfortably in bf16/fp16/fp32.
LOG_RATIO_CLAMP = 20.0


def kl_estimate(
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    kind: str = "k3",
    *,
    clamp: float = LOG_RATIO_CLAMP,
) -> torch.Tensor:
    """Return the per-token KL estimate, same shape as `logp`, with r = clamp(ref_logp - logp).

    kind="k1": -r = log pi_theta - log pi_ref. Unbiased, can be negative. As a loss its gradient is
      grad log pi_theta, whose expectation under pi_theta is 0: it only regularises when folded into the
      reward (PPO-RLHF style), not as a loss term.
    kind="k2": r^2 / 2. Biased, >= 0. Its gradient -r grad log pi_theta has expectation exactly
      grad KL(pi_theta || pi_ref), the reverse KL that the value estimates.
    kind="k3": exp(r) - r - 1 (DeepSeekMath, GRPO's default). Unbiased, >= 0, low variance. Its gradient
      (1 - pi_ref/pi_theta) grad log pi_theta has expectation grad KL(pi_ref || pi_theta), the *forward* KL,
      not the gradient of the reverse KL it estimates (Tang & Munos, 2025).
    """
    check_tensor("logp", logp)
    check_tensor("ref_logp", ref_logp)
    check_choice("kind", kind, KL_KINDS)
    clamp = check_nonneg("clamp", clamp, strictly=True)
    if logp.shape != ref_logp.shape:
        raise ValueError(
            f"ref_logp has shape {tuple(ref_logp.shape)} but logp has shape {tuple(logp.shape)}; they must "
            "match (both per-token log-probs of the same completion tokens)."
        )
    r = (ref_logp - logp).clamp(-clamp, clamp)
    if kind == "k1":
        return -r
    if kind == "k2":
        return 0.5 * r * r
    # expm1 keeps k3 accurate (and >= 0) for small r, where exp(r) - r - 1 cancels catastrophically:
    # in float32, r = 1e-4 would give 0 instead of 5e-9.
    return torch.expm1(r) - r
