"""Importance weights for a sampler whose probabilities differ from the trainer's.

An inference engine (or a bfloat16 copy of the policy) samples from pi_sampler, while the loss is computed
with the trainer's pi_old; their ratio w = pi_old / pi_sampler is 1 in theory and not in practice, and a
policy gradient that ignores it is biased. Two remedies bound the variance of the correction:
- truncated importance sampling, TIS (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You
  Off-Policy RL Training"): weigh each token's loss by min(w, C);
- masked importance sampling, MIS (as TRL's `vllm_importance_sampling_mode="*_mask"`): drop the tokens (or the
  whole sequence) whose ratio leaves [C_min, C_max] instead of truncating it.
Either per token (w_t) or per sequence (w_i = prod_t w_t, the exact sequence ratio).

Where cohort departs: the log-ratio is clamped to [-20, 20] before exp (as the loss does), so a sequence of
very different tokens gets a huge but finite ratio rather than inf.
"""

from __future__ import annotations

import torch

from ._checks import check_choice, check_tensor
from .kl import LOG_RATIO_CLAMP
from .options import IS_LEVELS, IS_MODES


def sampler_correction(
    train_logp: torch.Tensor,
    sampler_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    level: str = "token",
    mode: str = "truncate",
    max_ratio: float = 2.0,
    min_ratio: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Return (weights [N, T], metrics): the detached importance weights pi_train / pi_sampler, truncated to
    [min_ratio, max_ratio] (mode "truncate", TIS) or zeroed outside it (mode "mask", MIS), per token or per
    sequence; 0 at masked positions. Metrics: is_ratio/mean, /min, /max of the raw ratio over valid tokens and
    is_ratio/corrected_frac, the share of valid tokens whose weight was changed."""
    for name, t in (("train_logp", train_logp), ("sampler_logp", sampler_logp), ("mask", mask)):
        check_tensor(name, t)
    if train_logp.dim() != 2 or train_logp.shape != sampler_logp.shape or train_logp.shape != mask.shape:
        raise ValueError(
            f"train_logp {tuple(train_logp.shape)}, sampler_logp {tuple(sampler_logp.shape)} and mask "
            f"{tuple(mask.shape)} must all be [N, T] (the same completion tokens)."
        )
    check_choice("level", level, IS_LEVELS)
    check_choice("mode", mode, IS_MODES)
    if isinstance(max_ratio, bool) or not isinstance(max_ratio, (int, float)) or not max_ratio > 1:
        raise ValueError(
            f"max_ratio must be > 1 (a ratio of 1 must pass unchanged; TIS uses 2), got {max_ratio!r}"
        )
    if min_ratio is not None and (
        isinstance(min_ratio, bool) or not isinstance(min_ratio, (int, float)) or not 0 <= min_ratio < 1
    ):
        raise ValueError(f"min_ratio must be in [0, 1) or None, got {min_ratio!r}")
    mask = mask.bool()
    dtype = torch.promote_types(train_logp.dtype, torch.float32)
    diff = torch.where(mask, train_logp.detach().to(dtype) - sampler_logp.detach().to(dtype), 0)  # [N, T]
    if level == "sequence":
        diff = torch.where(mask, diff.sum(-1, keepdim=True), 0)  # [N, T], the row's log-ratio on each token
    ratio = torch.exp(diff.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))  # [N, T]
    lo = 0.0 if min_ratio is None else float(min_ratio)
    if mode == "truncate":
        weights = ratio.clamp(min=lo, max=float(max_ratio))
    else:
        weights = torch.where((ratio >= lo) & (ratio <= max_ratio), ratio, 0)
    weights = torch.where(mask, weights, 0)
    changed = (weights != ratio) & mask
    count = mask.sum().clamp(min=1)
    raw = ratio[mask]
    empty = raw.numel() == 0
    metrics = {
        "is_ratio/mean": torch.where(mask, ratio, 0).sum() / count,
        "is_ratio/min": raw.min() if not empty else torch.ones((), dtype=dtype),
        "is_ratio/max": raw.max() if not empty else torch.ones((), dtype=dtype),
        "is_ratio/corrected_frac": changed.sum().to(dtype) / count,
    }
    return weights.detach(), metrics


def off_policy_mask(
    advantages: torch.Tensor,
    logp: torch.Tensor,
    sampler_logp: torch.Tensor,
    mask: torch.Tensor,
    threshold: float,
) -> torch.Tensor:
    """Return bool [N, T]: the tokens DeepSeek-V3.2's off-policy sequence mask keeps (False on padding).

    DeepSeek-V3.2 (arXiv 2512.02556, eq. 9; TRL's off_policy_mask_threshold): a completion's distance from the
    sampler is KL_i = sum_t (log pi_sampler - log pi_theta) / |o_i| over its tokens (a NaN term, a token the
    engine could not score, adds 0 and still counts in |o_i|); the token is dropped when its advantage is
    negative and KL_i > threshold, so only off-policy *negative* samples are silenced. advantages [N] or [N, T];
    logp [N, T] the current log-probs (detached here); sampler_logp [N, T]; threshold >= 0.
    """
    for name, t in (
        ("advantages", advantages),
        ("logp", logp),
        ("sampler_logp", sampler_logp),
        ("mask", mask),
    ):
        check_tensor(name, t)
    if logp.dim() != 2 or logp.shape != sampler_logp.shape or logp.shape != mask.shape:
        raise ValueError(
            f"logp {tuple(logp.shape)}, sampler_logp {tuple(sampler_logp.shape)} and mask {tuple(mask.shape)} "
            "must all be [N, T] (the same completion tokens)."
        )
    if advantages.shape not in (logp.shape[:1], logp.shape):
        raise ValueError(
            f"advantages has shape {tuple(advantages.shape)}; it must be [N] or [N, T] to match logp "
            f"{tuple(logp.shape)}."
        )
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not threshold >= 0:
        raise ValueError(
            f"threshold must be a number >= 0 (the per-token KL above which a negative sample is dropped; "
            f"DeepSeek-V3.2's examples use 0.5), got {threshold!r}."
        )
    mask = mask.bool()
    dtype = torch.promote_types(logp.dtype, torch.float32)
    gap = torch.nan_to_num(sampler_logp.detach().to(dtype) - logp.detach().to(dtype), nan=0.0)  # [N, T]
    kl = torch.where(mask, gap, 0).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)  # [N, 1]
    adv = advantages.detach()
    adv = adv[:, None] if adv.dim() == 1 else adv  # [N, 1] or [N, T]
    keep = (adv >= 0) | (kl <= threshold)  # [N, 1] or [N, T]
    return keep.expand_as(mask) & mask  # [N, T]
