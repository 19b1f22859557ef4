"""cohort.algo: the GRPO family as pure tensor functions (no models, no I/O, no `.item()` in the hot path).

Import these into any training loop: advantages from rewards, the clipped policy loss with its four
aggregations, KL estimators and DAPO's row filters. Formulas and sources: docs/algorithms.md.
"""

from .advantages import (
    COMBINE_MODES,
    SCALES,
    STD_KINDS,
    combine_rewards,
    group_advantages,
    process_advantages,
    process_advantages_to_tokens,
    reinforce_pp_advantages,
    rloo_advantages,
)
from .entropy import adapt_entropy_coef, applied_entropy_coef, entropy_bonus
from .estimators import ADVANTAGE_ESTIMATORS, ADVANTAGE_TYPES, estimate_advantages, register_advantage
from .filters import truncation_mask, zero_std_group_mask
from .kl import KL_KINDS, LOG_RATIO_CLAMP, kl_estimate
from .losses import (
    AGGREGATIONS,
    IMPORTANCE_LEVELS,
    LOSS_AGGREGATIONS,
    LOSS_PARAMETERS,
    LOSS_TYPES,
    POLICY_LOSSES,
    TOKEN_COUNT_SCOPE,
    LossInputs,
    LossTerms,
    aggregation_of,
    check_loss_kwargs,
    cispo_loss,
    clip_loss,
    gmpo_loss,
    loss_normalisers,
    masked_mean,
    policy_loss,
    register_loss,
    sapo_loss,
)
from .offpolicy import IS_LEVELS, IS_MODES, sampler_correction
from .selection import clip_cov_mask, kl_cov_mask, token_covariance, top_entropy_mask

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "ADVANTAGE_TYPES",
    "IS_LEVELS",
    "IS_MODES",
    "adapt_entropy_coef",
    "applied_entropy_coef",
    "clip_cov_mask",
    "entropy_bonus",
    "estimate_advantages",
    "kl_cov_mask",
    "register_advantage",
    "reinforce_pp_advantages",
    "rloo_advantages",
    "sampler_correction",
    "token_covariance",
    "top_entropy_mask",
    "AGGREGATIONS",
    "LOSS_PARAMETERS",
    "POLICY_LOSSES",
    "LossInputs",
    "LossTerms",
    "aggregation_of",
    "check_loss_kwargs",
    "cispo_loss",
    "clip_loss",
    "gmpo_loss",
    "register_loss",
    "sapo_loss",
    "COMBINE_MODES",
    "IMPORTANCE_LEVELS",
    "KL_KINDS",
    "LOG_RATIO_CLAMP",
    "LOSS_AGGREGATIONS",
    "LOSS_TYPES",
    "SCALES",
    "STD_KINDS",
    "TOKEN_COUNT_SCOPE",
    "combine_rewards",
    "group_advantages",
    "kl_estimate",
    "loss_normalisers",
    "masked_mean",
    "policy_loss",
    "process_advantages",
    "process_advantages_to_tokens",
    "truncation_mask",
    "zero_std_group_mask",
]
