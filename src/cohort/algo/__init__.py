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
)
from .filters import truncation_mask, zero_std_group_mask
from .kl import KL_KINDS, LOG_RATIO_CLAMP, kl_estimate
from .losses import (
    IMPORTANCE_LEVELS,
    LOSS_AGGREGATIONS,
    LOSS_TYPES,
    TOKEN_COUNT_SCOPE,
    loss_normalisers,
    masked_mean,
    policy_loss,
)

__all__ = [
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
