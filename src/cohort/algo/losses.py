"""The clipped policy-gradient loss of GRPO and its descendants (DAPO, Dr. GRPO, GSPO), as one pure function.

Per token t of completion i, with ratio rho = pi_theta / pi_old and advantage A (per sequence or per token):

    objective_it = min(min(rho, delta) * A, clip(rho, 1 - eps_low, 1 + eps_high) * A) - beta * k3_it
    loss         = aggregate(-objective)          (the loss is the negated objective, to minimise)

Where cohort departs from the papers (each one is a named option, see docs/algorithms.md):
- The default aggregation is "grpo" (DeepSeekMath's mean of per-sequence token means); TRL now defaults to
  "dapo". The choice is `loss_type`; presets pick the recipe's own.
- Normalisers are explicit arguments (`num_items`, `num_sequences`) so that micro-batches, and processes,
  whose losses are *summed* give exactly the gradient of the whole batch; the papers define the loss on the
  whole batch only.
- The log-ratio is clamped to [-20, 20] before exponentiation so that log-probs of -1e4 stay finite; beyond
  that (rho > 4.8e8) the token's gradient is 0.
- `importance="sequence"` (GSPO) is applied at token level in GSPO-token form,
  rho_it = sg[s_i] * pi_theta(y_it) / sg[pi_theta(y_it)] with s_i = exp(mean_t log(pi_theta / pi_old)):
  the value of every token's ratio is s_i (so clipping acts on s_i) and its gradient is s_i * grad log
  pi_theta(y_it); with loss_type="grpo" and per-sequence advantages this is exactly GSPO's gradient.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ._checks import check_choice, check_nonneg, check_tensor
from .kl import KL_KINDS, LOG_RATIO_CLAMP, kl_estimate

IMPORTANCE_LEVELS = ("token", "sequence")

Normaliser = int | float | torch.Tensor | None
#: (per_token_loss [N, T] (0 where masked), mask bool [N, T], *, num_items, num_sequences,
#:  max_completion_length) -> scalar loss
LossAggregation = Callable[..., torch.Tensor]

#: Registry of loss aggregations by `loss_type` name (verl's `loss_agg_mode`, TRL's `loss_type`).
LOSS_AGGREGATIONS: dict[str, LossAggregation] = {}


def _register(name: str) -> Callable[[LossAggregation], LossAggregation]:
    def deco(fn: LossAggregation) -> LossAggregation:
        LOSS_AGGREGATIONS[name] = fn
        return fn

    return deco


@_register("grpo")
def _aggregate_grpo(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    *,
    num_items: Normaliser,
    num_sequences: Normaliser,
    **_: object,
) -> torch.Tensor:
    """Return sum_i (sum_t l_it / |o_i|) / num_sequences: the mean over sequences of each one's token mean."""
    lengths = mask.sum(-1).clamp(min=1)  # [N]
    per_seq = per_token.sum(-1) / lengths  # [N]
    return per_seq.sum() / (per_token.shape[0] if num_sequences is None else num_sequences)


@_register("bnpo")
def _aggregate_bnpo(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    *,
    num_items: Normaliser,
    num_sequences: Normaliser,
    **_: object,
) -> torch.Tensor:
    """Return sum_it l_it / num_items, with num_items the token count of the (process-local) batch."""
    return per_token.sum() / (mask.sum().clamp(min=1) if num_items is None else num_items)


@_register("dapo")
def _aggregate_dapo(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    *,
    num_items: Normaliser,
    num_sequences: Normaliser,
    **_: object,
) -> torch.Tensor:
    """Return sum_it l_it / num_items, with num_items the token count of the whole generation batch."""
    # Same formula as bnpo; the two differ in which count the trainer passes (all processes vs this one).
    return per_token.sum() / (mask.sum().clamp(min=1) if num_items is None else num_items)


@_register("dr_grpo")
def _aggregate_dr_grpo(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    *,
    num_items: Normaliser,
    num_sequences: Normaliser,
    max_completion_length: int,
    **_: object,
) -> torch.Tensor:
    """Return sum_it l_it / (num_sequences * max_completion_length): a constant normaliser (Dr. GRPO)."""
    n = per_token.shape[0] if num_sequences is None else num_sequences
    return per_token.sum() / (n * max_completion_length)


LOSS_TYPES = tuple(LOSS_AGGREGATIONS)

TOKEN_COUNT_SCOPE: dict[str, str | None] = {
    "grpo": None,
    "bnpo": "process",
    "dapo": "global",
    "dr_grpo": None,
}
"""Which token count each loss type divides by: this process's minibatch ("process", BNPO), the minibatch
summed over every process ("global", DAPO: every token of the batch weighs the same), or none (the grpo
and dr_grpo normalisers count sequences). On one process bnpo and dapo are the same loss."""


def loss_normalisers(
    loss_type: str, lengths: Sequence[int], all_sum: Callable[[int], int] = int, world_size: int = 1
) -> tuple[int, int]:
    """Returns (num_items, num_sequences) to pass to policy_loss for a minibatch whose in-loss rows on this
    process have token counts `lengths`; all_sum(x) sums an int over the `world_size` processes (identity on
    one process).

    The loss of a batch split over processes is the sum of the per-process losses (gradients are summed
    across processes), so num_sequences counts every process's sequences, and num_items is the token count
    of TOKEN_COUNT_SCOPE[loss_type]: for "global" (dapo) the tokens of every process; for "process" (bnpo)
    this process's tokens times world_size, which makes the summed gradient the mean of the per-process
    token means (what TRL gets from DDP's gradient averaging) instead of world_size times it. Both are at
    least 1, so an empty minibatch gives a zero loss instead of a division by zero.
    """
    check_choice("loss_type", loss_type, LOSS_AGGREGATIONS)
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    tokens = int(sum(lengths))
    scope = TOKEN_COUNT_SCOPE.get(loss_type)
    num_items = (
        all_sum(tokens) if scope == "global" else tokens * world_size if scope == "process" else tokens
    )
    return max(int(num_items), 1), max(int(all_sum(len(lengths))), 1)


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Return the mean of `values` over the True entries of `mask` (0 when the mask is empty), a scalar."""
    mask = mask.bool()
    return torch.where(mask, values, 0).sum() / mask.sum().clamp(min=1)


def _check_normaliser(name: str, value: object) -> None:
    if value is None:
        return
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be a scalar, got a tensor of shape {tuple(value.shape)}.")
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(
            f"{name} must be a positive number (a count over the whole batch) or None, got {value!r}. "
            f"Fix: pass the count over the full batch, or None to use this micro-batch's own."
        )


def _check_same_shape(name: str, value: torch.Tensor, shape: torch.Size) -> None:
    if value.shape != shape:
        raise ValueError(
            f"{name} has shape {tuple(value.shape)} but logp has shape {tuple(shape)}; both must be [N, T] "
            "(per-token values of the same padded completion tokens)."
        )


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    loss_type: str = "grpo",
    eps_low: float = 0.2,
    eps_high: float | None = None,
    delta: float | None = None,
    beta: float = 0.0,
    ref_logp: torch.Tensor | None = None,
    max_completion_length: int | None = None,
    num_items: Normaliser = None,
    num_sequences: Normaliser = None,
    importance: str = "token",
    kl_kind: str = "k3",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Return (loss, metrics): the negated clipped-surrogate objective (scalar) and detached tensor metrics.

    logp [N, T]: log pi_theta of the completion tokens (differentiable); old_logp [N, T] or None
    (on-policy: the ratio is taken against logp.detach(), value 1, gradient grad log pi_theta);
    advantages [N] (one per completion) or [N, T] (per token, process supervision); mask [N, T], True on
    completion tokens. Masked positions may hold anything (even inf/NaN): they get exactly zero gradient.
    loss_type "grpo" | "bnpo" | "dapo" | "dr_grpo" (see LOSS_AGGREGATIONS); eps_high None means eps_low;
    delta caps rho from above for the unclipped term (two-sided clipping), None = no cap; beta > 0 adds
    beta * KL(logp, ref_logp) with the estimator kl_kind ("k1" | "k2" | "k3", see kl_estimate; k3 is
    DeepSeekMath's) and needs ref_logp; importance "token" | "sequence" (GSPO).
    num_sequences (grpo, dr_grpo) and num_items (bnpo, dapo) are the counts of the whole batch this
    micro-batch belongs to (None: its own); summing the micro-batch losses then equals the full-batch loss.
    Metrics: clip_ratio/low_mean, clip_ratio/high_mean, clip_ratio/region_mean, ratio/mean, and kl (masked
    mean of the kl_kind estimate) when ref_logp is given.
    """
    check_tensor("logp", logp)
    check_tensor("advantages", advantages)
    check_tensor("mask", mask)
    if logp.dim() != 2 or not logp.is_floating_point():
        raise ValueError(
            f"logp must be a floating tensor [N, T], got dtype {logp.dtype} and shape {tuple(logp.shape)}. "
            "Fix: pass per-token log-probs of the completion tokens, padded to a common length."
        )
    shape = logp.shape
    n, t = shape
    _check_same_shape("mask", mask, shape)
    if old_logp is not None:
        check_tensor("old_logp", old_logp)
        _check_same_shape("old_logp", old_logp, shape)
    if advantages.shape not in ((n,), shape):
        raise ValueError(
            f"advantages has shape {tuple(advantages.shape)}; it must be [N]={n} (one per completion) or "
            f"[N, T]={tuple(shape)} (per token) to match logp."
        )
    check_choice("loss_type", loss_type, LOSS_AGGREGATIONS)
    check_choice("importance", importance, IMPORTANCE_LEVELS)
    check_choice("kl_kind", kl_kind, KL_KINDS)
    eps_low = check_nonneg("eps_low", eps_low)
    if eps_low >= 1:
        raise ValueError(f"eps_low must be in [0, 1) so that 1 - eps_low > 0, got {eps_low!r}.")
    eps_high = eps_low if eps_high is None else check_nonneg("eps_high", eps_high)
    if delta is not None:
        delta = check_nonneg("delta", delta)
        if delta <= 1 + eps_high:
            raise ValueError(
                f"delta must be > 1 + eps_high = {1 + eps_high!r}, got {delta!r}; it caps the ratio above the "
                "clip range for negative advantages. Fix: pass e.g. delta=4.0, or delta=None for no cap."
            )
    beta = check_nonneg("beta", beta)
    if beta > 0 and ref_logp is None:
        raise ValueError(
            f"beta={beta!r} > 0 needs ref_logp (the reference model's per-token log-probs [N, T]). "
            "Fix: pass ref_logp, or beta=0.0 to drop the KL penalty."
        )
    if ref_logp is not None:
        check_tensor("ref_logp", ref_logp)
        _check_same_shape("ref_logp", ref_logp, shape)
    if max_completion_length is not None:
        if (
            isinstance(max_completion_length, bool)
            or not isinstance(max_completion_length, int)
            or max_completion_length < t
        ):
            raise ValueError(
                f"max_completion_length must be an int >= T={t} (the padded completion length), got "
                f"{max_completion_length!r}. Fix: pass the generation limit used for these completions."
            )
    elif loss_type == "dr_grpo":
        raise ValueError(
            "loss_type='dr_grpo' divides by N * max_completion_length, but max_completion_length is None. "
            "Fix: pass max_completion_length (the generation limit)."
        )
    _check_normaliser("num_items", num_items)
    _check_normaliser("num_sequences", num_sequences)

    mask = mask.bool()  # [N, T]
    # Sanitise masked positions before any arithmetic: where() alone would still send 0 * inf = NaN
    # gradients through exp() at padding that holds -inf or garbage.
    logp = torch.where(mask, logp, 0)  # [N, T]
    old = logp.detach() if old_logp is None else torch.where(mask, old_logp.detach(), 0)  # [N, T]
    adv = advantages.detach()
    adv = adv[:, None] if adv.dim() == 1 else adv  # [N, 1] or [N, T]
    adv = torch.where(mask, adv, 0)  # [N, T]

    log_ratio = (logp - old).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # [N, T]
    if importance == "sequence":
        lengths = mask.sum(-1).clamp(min=1)  # [N]
        seq_log_ratio = log_ratio.sum(-1) / lengths  # [N], masked entries are already 0
        log_ratio = logp - logp.detach() + seq_log_ratio.detach()[:, None]  # [N, T], value log s_i
    ratio = torch.exp(log_ratio)  # [N, T]

    low, high = 1.0 - eps_low, 1.0 + eps_high
    capped = ratio if delta is None else ratio.clamp(max=delta)  # [N, T]
    surrogate = torch.minimum(capped * adv, ratio.clamp(low, high) * adv)  # [N, T]
    objective = surrogate
    kl = None
    if ref_logp is not None:
        ref = torch.where(mask, ref_logp.detach(), 0)  # [N, T]
        kl = kl_estimate(logp, ref, kl_kind)  # [N, T]
        if beta > 0:
            objective = surrogate - beta * kl
    per_token = torch.where(mask, -objective, 0)  # [N, T]

    loss = LOSS_AGGREGATIONS[loss_type](
        per_token,
        mask,
        num_items=num_items,
        num_sequences=num_sequences,
        max_completion_length=max_completion_length,
    )

    with torch.no_grad():
        # Metrics in at least float32: bf16 cannot even count past 256 exactly.
        ratio_d = ratio.detach().to(torch.promote_types(ratio.dtype, torch.float32))  # [N, T]
        # A clip only matters in the direction the advantage pushes: below 1 - eps_low for A < 0, above
        # 1 + eps_high for A > 0 (TRL's definition).
        is_low = (ratio_d < low) & (adv < 0) & mask  # [N, T]
        is_high = (ratio_d > high) & (adv > 0) & mask  # [N, T]
        metrics = {
            "clip_ratio/low_mean": masked_mean(is_low.to(ratio_d.dtype), mask),
            "clip_ratio/high_mean": masked_mean(is_high.to(ratio_d.dtype), mask),
            "clip_ratio/region_mean": masked_mean((is_low | is_high).to(ratio_d.dtype), mask),
            "ratio/mean": masked_mean(ratio_d, mask),
        }
        if kl is not None:
            metrics["kl"] = masked_mean(kl.detach().to(ratio_d.dtype), mask)
    return loss, metrics
