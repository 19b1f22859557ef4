"""Token controls: which tokens of a micro-batch the policy loss counts, and with what weight.

Five mechanisms compose into one typed result (:class:`TokenControls`): the high-entropy token mask
(arXiv 2506.01939), Clip-Cov's detached tokens and KL-Cov's KL-penalised tokens (arXiv 2505.22617), and
DeepSeek-V3.2's off-policy sequence mask, and the sampler's importance correction (truncated or masked, per
token or per sequence). The loss multiplies its per-token terms by `weights` and adds KL-Cov's penalty on
`kl_cov`; a loss that folds the sampler weights into its own weight (vespo) takes `unsampled_weights` and
`sampler_weights` apart instead. Nothing here touches a model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .offpolicy import off_policy_mask, sampler_correction
from .options import COV_METHODS, SAMPLER_CORRECTIONS
from .selection import COV_RATIOS, clip_cov_mask, kl_cov_mask, token_covariance, top_entropy_mask


@dataclass(frozen=True)
class ControlSettings:
    """The token controls a run uses (AlgoConfig's fields of the same names)."""

    top_entropy_quantile: float = 1.0
    cov_method: str = "none"
    cov_ratio: float | None = None
    clip_cov_bounds: tuple[float, float] = (1.0, 5.0)
    sampler_correction: str = "none"
    sampler_is_max: float = 2.0
    sampler_is_min: float | None = None
    off_policy_mask_threshold: float | None = None

    def __post_init__(self) -> None:
        if self.cov_method not in COV_METHODS:
            raise ValueError(f"cov_method={self.cov_method!r}; choose one of {', '.join(COV_METHODS)}")
        if self.sampler_correction not in SAMPLER_CORRECTIONS:
            raise ValueError(
                f"sampler_correction={self.sampler_correction!r}; choose one of {', '.join(SAMPLER_CORRECTIONS)}"
            )

    @property
    def active(self) -> bool:
        """Returns True when some control changes which tokens count or how much."""
        return (
            self.top_entropy_quantile < 1
            or self.cov_method != "none"
            or self.sampler_correction != "none"
            or self.off_policy_mask_threshold is not None
        )

    @property
    def needs_entropy(self) -> bool:
        """Returns True when the controls read token entropies (the high-entropy mask)."""
        return self.top_entropy_quantile < 1


@dataclass(frozen=True)
class TokenControls:
    """One micro-batch's token controls: what the policy loss takes, and what they measured."""

    weights: torch.Tensor | None = (
        None  # [n, T] multiplier of the per-token loss (None: every token weighs 1)
    )
    kl_cov: torch.Tensor | None = None  # [n, T] bool: KL-Cov's tokens, which get its penalty
    kept: torch.Tensor | None = None  # [n, T] bool: the high-entropy mask alone (None: every token kept)
    sampler_weights: torch.Tensor | None = None  # [n, T] the sampler correction's weights alone
    unsampled_weights: torch.Tensor | None = None  # [n, T] `weights` without the sampler correction's
    metrics: dict[str, float] = field(default_factory=dict)


def token_controls(
    logp: torch.Tensor,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    settings: ControlSettings,
    *,
    entropy: torch.Tensor | None = None,
    old_logp: torch.Tensor | None = None,
    sampled_logp: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> TokenControls:
    """Returns the TokenControls of one micro-batch.

    logp: [n, T] current log-probs (detached here); mask: [n, T] tokens in the loss; advantages: [n] or
    [n, T]; entropy: [n, T] token entropies (needed by the high-entropy mask); old_logp: π_old's log-probs
    (None at μ = 1, where it equals the detached current ones); sampled_logp: the sampler's log-probs (needed
    by a sampler correction; the off-policy mask's anchor, else old_logp, else the current log-probs, as TRL);
    generator: Clip-Cov's random draws. Metrics are fractions of the mask's tokens,
    and the importance ratio's mean / min / max (keys ending _min / _max are extremes, not means).
    """
    weights: torch.Tensor | None = None

    def times(w: torch.Tensor) -> torch.Tensor:
        w = w.to(logp.dtype)
        return w if weights is None else weights * w

    n_tok = max(float(mask.sum()), 1.0)
    kept = kl_cov = None
    metrics: dict[str, float] = {}
    s = settings
    if s.needs_entropy:
        if entropy is None:
            raise ValueError("top_entropy_quantile needs token entropies, but none were computed")
        kept = top_entropy_mask(entropy.detach(), mask, s.top_entropy_quantile)
        weights = times(kept)
        metrics["entropy_mask/kept_frac"] = float(kept.sum()) / n_tok
    if s.cov_method != "none":
        cov = token_covariance(logp.detach(), advantages, mask)
        ratio = COV_RATIOS[s.cov_method] if s.cov_ratio is None else s.cov_ratio
        if s.cov_method == "clip_cov":
            low, high = s.clip_cov_bounds
            chosen = clip_cov_mask(cov, mask, ratio=ratio, low=low, high=high, generator=generator)
            weights = times(~chosen)
        else:
            chosen = kl_cov = kl_cov_mask(cov, mask, ratio=ratio)
        metrics["cov/selected_frac"] = float(chosen.sum()) / n_tok
    if s.off_policy_mask_threshold is not None:
        anchor = sampled_logp if sampled_logp is not None else old_logp if old_logp is not None else logp
        keep = off_policy_mask(advantages, logp, anchor, mask, s.off_policy_mask_threshold)
        weights = times(keep)
        metrics["off_policy_mask/dropped_frac"] = float((mask.bool() & ~keep).sum()) / n_tok
    sampler_weights = unsampled = None
    correction = SAMPLER_CORRECTIONS[s.sampler_correction]
    if correction is not None:
        if sampled_logp is None:
            raise ValueError(
                f"sampler_correction={s.sampler_correction} needs the sampler's log-probs, but this rollout engine "
                "returned none; use rollout.engine=builtin or hf"
            )
        level, mode = correction
        w, m = sampler_correction(
            logp.detach() if old_logp is None else old_logp,
            sampled_logp,
            mask,
            level=level,
            mode=mode,
            max_ratio=s.sampler_is_max,
            min_ratio=s.sampler_is_min,
        )
        unsampled = weights
        sampler_weights = w.to(logp.dtype)
        weights = times(w)
        metrics.update({f"sampler/is_ratio_{k.split('/')[-1]}": float(v) for k, v in m.items()})
    if sampler_weights is None:
        unsampled = weights
    return TokenControls(weights, kl_cov, kept, sampler_weights, unsampled, metrics)
