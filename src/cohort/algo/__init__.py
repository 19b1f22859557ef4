"""cohort.algo: the GRPO family as pure tensor functions (no models, no I/O, no `.item()` in the hot path).

Import these into any training loop: advantages from rewards, the clipped policy loss with its four
aggregations, KL estimators and DAPO's row filters. Formulas and sources: docs/algorithms.md.

The names load lazily (PEP 562): importing `cohort.algo.options`, the torch-free names and checks that
`cohort.config` reads, loads nothing else of the package; the first use of a tensor function imports its module.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_WHERE = {
    "adapt_entropy_coef": "entropy",
    "advantage_arguments": "options",
    "ADVANTAGE_ESTIMATORS": "estimators",
    "ADVANTAGE_TYPES": "options",
    "aggregation_of": "losses",
    "AGGREGATIONS": "options",
    "applied_entropy_coef": "entropy",
    "check_loss_kwargs": "losses",
    "check_loss_options": "losses",
    "cispo_loss": "losses",
    "clip_cov_mask": "selection",
    "clip_loss": "losses",
    "COMBINE_MODES": "options",
    "combine_rewards": "advantages",
    "dppo_kl_loss": "losses",
    "dppo_tv_loss": "losses",
    "dro_loss": "losses",
    "entropy_bonus": "entropy",
    "estimate_advantages": "estimators",
    "ESTIMATOR_FIELDS": "options",
    "gmpo_loss": "losses",
    "group_advantages": "advantages",
    "IMPORTANCE_LEVELS": "options",
    "IS_LEVELS": "options",
    "IS_MODES": "options",
    "kl_cov_mask": "selection",
    "kl_estimate": "kl",
    "KL_KINDS": "options",
    "LOG_RATIO_CLAMP": "kl",
    "LOSS_AGGREGATIONS": "losses",
    "loss_normalisers": "losses",
    "LOSS_PARAMETERS": "options",
    "LOSS_TYPES": "options",
    "LossInputs": "losses",
    "LossOptions": "losses",
    "LossParameter": "options",
    "LossTerms": "losses",
    "masked_mean": "losses",
    "max_rl_advantages": "advantages",
    "off_policy_mask": "offpolicy",
    "optimal_token_baseline": "advantages",
    "policy_loss": "losses",
    "POLICY_LOSSES": "losses",
    "process_advantages": "advantages",
    "process_advantages_to_tokens": "advantages",
    "register_advantage": "estimators",
    "register_loss": "losses",
    "reinforce_pp_advantages": "advantages",
    "rloo_advantages": "advantages",
    "sampler_correction": "offpolicy",
    "sapo_loss": "losses",
    "SCALES": "options",
    "STD_KINDS": "options",
    "TOKEN_COUNT_SCOPE": "losses",
    "token_covariance": "selection",
    "top_entropy_mask": "selection",
    "topk_divergence": "divergence",
    "topk_divergence_from_logprobs": "divergence",
    "truncation_mask": "filters",
    "vespo_loss": "losses",
    "zero_std_group_mask": "filters",
}
"""Each public name and the submodule that defines it."""

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "ADVANTAGE_TYPES",
    "AGGREGATIONS",
    "COMBINE_MODES",
    "ESTIMATOR_FIELDS",
    "IMPORTANCE_LEVELS",
    "IS_LEVELS",
    "IS_MODES",
    "KL_KINDS",
    "LOG_RATIO_CLAMP",
    "LOSS_AGGREGATIONS",
    "LOSS_PARAMETERS",
    "LOSS_TYPES",
    "LossInputs",
    "LossOptions",
    "LossParameter",
    "LossTerms",
    "POLICY_LOSSES",
    "SCALES",
    "STD_KINDS",
    "TOKEN_COUNT_SCOPE",
    "adapt_entropy_coef",
    "advantage_arguments",
    "aggregation_of",
    "applied_entropy_coef",
    "check_loss_kwargs",
    "check_loss_options",
    "cispo_loss",
    "clip_cov_mask",
    "clip_loss",
    "combine_rewards",
    "dppo_kl_loss",
    "dppo_tv_loss",
    "dro_loss",
    "entropy_bonus",
    "estimate_advantages",
    "gmpo_loss",
    "group_advantages",
    "kl_cov_mask",
    "kl_estimate",
    "loss_normalisers",
    "masked_mean",
    "max_rl_advantages",
    "off_policy_mask",
    "optimal_token_baseline",
    "policy_loss",
    "process_advantages",
    "process_advantages_to_tokens",
    "register_advantage",
    "register_loss",
    "reinforce_pp_advantages",
    "rloo_advantages",
    "sampler_correction",
    "sapo_loss",
    "token_covariance",
    "top_entropy_mask",
    "topk_divergence",
    "topk_divergence_from_logprobs",
    "truncation_mask",
    "vespo_loss",
    "zero_std_group_mask",
]


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        value = getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
        globals()[name] = value  # later lookups skip this function
        return value
    try:  # a submodule as an attribute (cohort.algo.losses), as after an eager import
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))


if TYPE_CHECKING:  # what a type checker and an editor see: the same names, imported eagerly
    from .advantages import (
        combine_rewards,
        group_advantages,
        max_rl_advantages,
        optimal_token_baseline,
        process_advantages,
        process_advantages_to_tokens,
        reinforce_pp_advantages,
        rloo_advantages,
    )
    from .divergence import topk_divergence, topk_divergence_from_logprobs
    from .entropy import adapt_entropy_coef, applied_entropy_coef, entropy_bonus
    from .estimators import ADVANTAGE_ESTIMATORS, estimate_advantages, register_advantage
    from .filters import truncation_mask, zero_std_group_mask
    from .kl import LOG_RATIO_CLAMP, kl_estimate
    from .losses import (
        LOSS_AGGREGATIONS,
        POLICY_LOSSES,
        TOKEN_COUNT_SCOPE,
        LossInputs,
        LossOptions,
        LossTerms,
        aggregation_of,
        check_loss_kwargs,
        check_loss_options,
        cispo_loss,
        clip_loss,
        dppo_kl_loss,
        dppo_tv_loss,
        dro_loss,
        gmpo_loss,
        loss_normalisers,
        masked_mean,
        policy_loss,
        register_loss,
        sapo_loss,
        vespo_loss,
    )
    from .offpolicy import off_policy_mask, sampler_correction
    from .options import (
        ADVANTAGE_TYPES,
        AGGREGATIONS,
        COMBINE_MODES,
        ESTIMATOR_FIELDS,
        IMPORTANCE_LEVELS,
        IS_LEVELS,
        IS_MODES,
        KL_KINDS,
        LOSS_PARAMETERS,
        LOSS_TYPES,
        SCALES,
        STD_KINDS,
        LossParameter,
        advantage_arguments,
    )
    from .selection import clip_cov_mask, kl_cov_mask, token_covariance, top_entropy_mask
