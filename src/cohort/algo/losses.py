"""The policy-gradient losses of GRPO and its descendants, as pure functions.

A loss type is a per-token loss (what each completion token contributes) and an aggregation (how those are
averaged into one scalar). Per token t of completion i, with ratio rho = pi_theta / pi_old and advantage A:

    clip  (grpo, bnpo, dapo, dr_grpo; PPO, DeepSeekMath arXiv 2402.03300):
          l_it = -min(min(rho, delta) * A, clip(rho, 1 - eps_low, 1 + eps_high) * A)
    cispo (MiniMax-M1 arXiv 2506.13585, ScaleRL arXiv 2510.13786): the clipped, detached ratio weighs a plain
          policy gradient, so no token's gradient is ever zeroed: l_it = -sg(clip(rho, min_ratio, max_ratio)) * A * r
    sapo  (Soft Adaptive Policy Optimization, arXiv 2511.20347): a sigmoid gate instead of the hard clip,
          l_it = -sigma(tau * (rho - 1)) * 4 / tau * A, tau = tau_pos for A > 0 and tau_neg otherwise
    gmpo  (Geometric-Mean Policy Optimization, arXiv 2507.20673): the sequence's geometric-mean ratio,
          R_i = exp(mean_t pess_t), pess_t the token log-ratio clipped to [-clip, clip] on the side the
          advantage pushes; every token of i carries l_it = -R_i * A_i (so the "grpo" mean gives -mean_i R_i A_i)
    luspo (arXiv 2602.05261): the clip loss, aggregated as each sequence's token sum averaged over sequences
    vespo (arXiv 2602.10693): l_it = -phi_i * A * r, phi_i = e^lam w_i^k e^(-lam w_i) a detached gamma weight of
          the sequence's whole importance weight w_i (sampler weights folded in)
    dppo_tv / dppo_kl (arXiv 2602.04879): l_it = -(1 - drop_it) * sg(min(rho, C)) * A * r, drop_it when the
          token's divergence from the anchor (|p - p_old| or its binary KL) passes the threshold in the
          direction the advantage pushes
    dro (verl): l_it = -A * r, with the squared log-ratio penalty kl_tau * (log rho)^2 that policy_loss adds
    loss = aggregate(l + beta * k3)   (plus KL-Cov's penalty, kl_tau's squared log-ratio and token weights when
                                        given, see policy_loss)

Here r = exp(log pi_theta - sg(log pi_theta)) (value 1, gradient grad log pi_theta): cispo's loss then has
the value -w * A and the gradient -w * A * grad log pi_theta, so its logged loss reads like the others'.

Dual-clip PPO (Ye et al. 2020, arXiv 1912.09729) bounds the loss of a negative advantage by c * |A|:
-max(min(rho A, clip(rho) A), c A) for A < 0. That is `delta` = c here (INTELLECT-2's two-sided clipping,
arXiv 2505.07291, is the same cap): capping rho at delta inside the unclipped term gives the same value and
gradient for either sign of A (a test checks this against the dual-clip form).

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

A loss from the user's own module is registered under its spec (`algo.loss_type: my_pkg.losses:my_loss`):
`my_loss(inputs: LossInputs, **loss_kwargs) -> Tensor [N, T]` (the per-token loss to minimise, or a LossTerms
to report clipped tokens); cohort masks it, adds the KL term and aggregates it.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, NamedTuple

import torch

from ._checks import check_choice, check_nonneg, check_tensor
from .kl import LOG_RATIO_CLAMP, kl_estimate
from .options import (
    AGGREGATIONS,
    BUILTIN_LOSSES,
    IMPORTANCE_LEVELS,
    KL_KINDS,
    LOSS_KINDS,
    LOSS_PARAMETERS,
    LossKind,
    check_clip,
    check_loss_parameters,
)

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


@_register("dapo")
@_register("bnpo")  # the inner decorator registers first: the names keep their documented order
def _aggregate_token_mean(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    *,
    num_items: Normaliser,
    num_sequences: Normaliser,
    **_: object,
) -> torch.Tensor:
    """Return sum_it l_it / num_items: the mean over tokens (bnpo and dapo; see TOKEN_COUNT_SCOPE for the count)."""
    # bnpo and dapo differ only in the count the trainer passes: this process's tokens or every process's.
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


@_register("luspo")
def _aggregate_luspo(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    *,
    num_items: Normaliser,
    num_sequences: Normaliser,
    **_: object,
) -> torch.Tensor:
    """Return sum_it l_it / num_sequences: each sequence's token sum, averaged over sequences (LUSPO)."""
    # A sequence weighs its length here, which is LUSPO's point (arXiv 2602.05261): long answers are not diluted.
    return per_token.sum() / (per_token.shape[0] if num_sequences is None else num_sequences)


if tuple(LOSS_AGGREGATIONS) != AGGREGATIONS:  # the names the config checks are the functions registered here
    raise ImportError(f"cohort.algo.options.AGGREGATIONS {AGGREGATIONS} != {tuple(LOSS_AGGREGATIONS)}")

TOKEN_COUNT_SCOPE: dict[str, str | None] = {
    "grpo": None,
    "bnpo": "process",
    "dapo": "global",
    "dr_grpo": None,
    "luspo": None,
}
"""Which token count each aggregation divides by: this process's minibatch ("process", BNPO), the minibatch
summed over every process ("global", DAPO: every token of the batch weighs the same), or none (the grpo
dr_grpo and luspo normalisers count sequences). On one process bnpo and dapo are the same loss."""


@dataclass(frozen=True)
class LossInputs:
    """What a per-token policy loss sees: one micro-batch of N completions padded to T tokens."""

    logp: torch.Tensor
    """[N, T] log pi_theta of the completion tokens (differentiable; 0 at masked positions)."""
    old_logp: torch.Tensor
    """[N, T] log pi_old (detached; equal to logp's value on-policy)."""
    log_ratio: torch.Tensor
    """[N, T] log(pi_theta / pi_old) clamped to +-LOG_RATIO_CLAMP (GSPO-token form at importance="sequence")."""
    advantages: torch.Tensor
    """[N, T] detached advantages, one per token (0 at masked positions)."""
    seq_advantages: torch.Tensor | None
    """[N] the per-completion advantages when they were given that way (None for per-token advantages)."""
    mask: torch.Tensor
    """[N, T] bool, True on completion tokens."""
    eps_low: float
    """Lower clip range of the clip loss."""
    eps_high: float
    """Upper clip range of the clip loss."""
    delta: float | None
    """Cap on rho in the clip loss's unclipped term (dual-clip's c), None for none."""
    sampler_weights: torch.Tensor | None = None
    """[N, T] detached sampler importance weights pi_old / pi_sampler (0 at masked positions), or None; only a
    loss registered with folds_sampler_weights sees them (vespo), every other loss is multiplied by them."""
    divergence: torch.Tensor | None = None
    """[N, T] detached per-token divergence from the anchor (DPPO's top-K TV or KL), or None for the binary one."""

    @property
    def lengths(self) -> torch.Tensor:
        """Return each completion's token count, [N], at least 1."""
        return self.mask.sum(-1).clamp(min=1)

    def policy_gradient_term(self) -> torch.Tensor:
        """Return exp(logp - sg(logp)), [N, T]: value 1, gradient grad log pi_theta (REINFORCE's carrier)."""
        return torch.exp(self.logp - self.logp.detach())


class LossTerms(NamedTuple):
    """A per-token loss and, where the loss clips, which tokens were clipped (for the clip_ratio metrics)."""

    loss: torch.Tensor
    """[N, T] the loss to minimise per token (masked positions are ignored)."""
    clipped_low: torch.Tensor | None = None
    """[N, T] bool: tokens whose ratio was clipped from below while the advantage was negative."""
    clipped_high: torch.Tensor | None = None
    """[N, T] bool: tokens whose ratio was clipped from above while the advantage was positive."""
    metrics: dict[str, torch.Tensor] | None = None
    """Detached scalar metrics of the loss itself (e.g. vespo/phi_seq_mean), merged into policy_loss's."""


#: (inputs, **loss_kwargs) -> LossTerms or a [N, T] tensor of per-token losses
PerTokenLoss = Callable[..., "LossTerms | torch.Tensor"]


@dataclass(frozen=True)
class PolicyLoss:
    """A registered loss type: its per-token loss and the aggregation it uses unless told otherwise."""

    fn: PerTokenLoss
    aggregation: str
    sequence_advantages: bool = False
    """True when the loss is defined for one advantage per completion only (gmpo)."""
    token_importance: bool = False
    """True when the loss needs token-level ratios (importance="sequence" is refused)."""
    folds_sampler_weights: bool = False
    """True when the loss folds the sampler weights into its own weight (vespo): policy_loss then does not
    multiply its tokens by them a second time."""
    reads_divergence: bool = False
    """True when the loss reads LossInputs.divergence (dppo_tv, dppo_kl); policy_loss refuses one otherwise."""


POLICY_LOSSES: dict[str, PolicyLoss] = {}
"""Every loss type by name: the built-in ones and those registered from user modules."""


def register_loss(
    name: str,
    fn: PerTokenLoss,
    aggregation: str = "dapo",
    *,
    sequence_advantages: bool = False,
    token_importance: bool = False,
    folds_sampler_weights: bool = False,
    reads_divergence: bool = False,
) -> PolicyLoss:
    """Return the PolicyLoss registered under `name` (replacing any earlier one of that name)."""
    check_choice("aggregation", aggregation, LOSS_AGGREGATIONS)
    if not callable(fn):
        raise TypeError(f"loss {name!r} must be a function (inputs: LossInputs, **kwargs) -> Tensor [N, T]")
    POLICY_LOSSES[name] = PolicyLoss(
        fn, aggregation, sequence_advantages, token_importance, folds_sampler_weights, reads_divergence
    )
    LOSS_KINDS[name] = LossKind(
        aggregation,
        sequence_advantages,
        token_importance,
        folds_sampler_weights,
        reads_divergence,
        fn is clip_loss,
    )
    return POLICY_LOSSES[name]


def _default(loss_type: str, name: str) -> Any:
    """Returns the default of a built-in loss's parameter (LOSS_PARAMETERS), for its function's signature."""
    return LOSS_PARAMETERS[loss_type][name].default


def clip_loss(x: LossInputs) -> LossTerms:
    """Return PPO's clipped per-token loss -min(min(rho, delta) A, clip(rho, 1-eps_low, 1+eps_high) A)."""
    ratio = torch.exp(x.log_ratio)  # [N, T]
    low, high = 1.0 - x.eps_low, 1.0 + x.eps_high
    capped = ratio if x.delta is None else ratio.clamp(max=x.delta)  # [N, T]
    adv = x.advantages
    surrogate = torch.minimum(capped * adv, ratio.clamp(low, high) * adv)  # [N, T]
    with torch.no_grad():
        # A clip only matters in the direction the advantage pushes (TRL's definition).
        clipped_low = (ratio < low) & (adv < 0)
        clipped_high = (ratio > high) & (adv > 0)
    return LossTerms(-surrogate, clipped_low, clipped_high)


def cispo_loss(
    x: LossInputs,
    *,
    max_ratio: float = _default("cispo", "max_ratio"),
    min_ratio: float | None = _default("cispo", "min_ratio"),
) -> LossTerms:
    """Return CISPO's per-token loss -sg(clip(rho, min_ratio, max_ratio)) * A * r (r: value 1, grad log pi)."""
    ratio = torch.exp(x.log_ratio)  # [N, T]
    weight = ratio.detach().clamp(min=min_ratio, max=max_ratio)  # [N, T]
    with torch.no_grad():
        clipped_high = (ratio > max_ratio) & (x.advantages > 0)
        clipped_low = (ratio < min_ratio) & (x.advantages < 0) if min_ratio is not None else None
    return LossTerms(-weight * x.advantages * x.policy_gradient_term(), clipped_low, clipped_high)


def sapo_loss(
    x: LossInputs,
    *,
    tau_pos: float = _default("sapo", "tau_pos"),
    tau_neg: float = _default("sapo", "tau_neg"),
) -> LossTerms:
    """Return SAPO's per-token loss -sigma(tau (rho - 1)) * 4 / tau * A, with tau by the advantage's sign."""
    ratio = torch.exp(x.log_ratio)  # [N, T]
    tau = torch.full_like(ratio, tau_neg).masked_fill(x.advantages > 0, tau_pos)  # [N, T]
    gate = torch.sigmoid(tau * (ratio - 1)) * 4 / tau  # [N, T]; slope 1 at rho = 1, like the plain gradient
    return LossTerms(-gate * x.advantages)


def gmpo_loss(x: LossInputs, *, clip: float = _default("gmpo", "clip")) -> LossTerms:
    """Return GMPO's per-token loss: -R_i A_i on every token of i, R_i the clipped geometric-mean ratio."""
    if x.seq_advantages is None:
        raise ValueError(
            "loss_type='gmpo' needs one advantage per completion (its objective is R_i * A_i per sequence); "
            "got per-token advantages. Fix: use another loss type with process rewards."
        )
    adv = x.seq_advantages.detach()[:, None]  # [N, 1]
    clipped = x.log_ratio.clamp(-clip, clip)  # [N, T]
    # Pessimistic per token: for A > 0 the smaller log-ratio, for A < 0 the larger (PPO's min, in log space).
    pess = torch.where(adv > 0, torch.minimum(x.log_ratio, clipped), torch.maximum(x.log_ratio, clipped))
    pess = torch.where(x.mask, pess, 0)  # [N, T]
    seq_ratio = torch.exp(pess.sum(-1, keepdim=True) / x.lengths[:, None])  # [N, 1]
    with torch.no_grad():
        clipped_low = (x.log_ratio < -clip) & (adv < 0)
        clipped_high = (x.log_ratio > clip) & (adv > 0)
    return LossTerms((-seq_ratio * adv).expand_as(x.log_ratio), clipped_low, clipped_high)


#: Bounds of VESPO's sequence log-weight (TRL's get_gamma_weights): log 1e-8 below, 20 above.
VESPO_LOG_W_MIN = -18.420680743952367
VESPO_LOG_W_MAX = 20.0


def vespo_loss(
    x: LossInputs,
    *,
    k_pos: float = _default("vespo", "k_pos"),
    lambda_pos: float = _default("vespo", "lambda_pos"),
    k_neg: float = _default("vespo", "k_neg"),
    lambda_neg: float = _default("vespo", "lambda_neg"),
) -> LossTerms:
    """Return VESPO's per-token loss -phi_i * A * r, phi_i = e^lam w_i^k e^(-lam w_i) a detached gamma weight.

    w_i is the sequence's whole importance weight, trainer ratio times sampler ratio:
    log w_i = clamp(sum_t log(pi/pi_old) + sum_t clamp(log W_it, log 1e-8, 20), log 1e-8, 20), summed over the
    completion's tokens (a sum, not a mean: the product of the token ratios); (k, lam) are (k_pos, lambda_pos)
    where A >= 0, else (k_neg, lambda_neg). phi(1) = 1, so on-policy VESPO is REINFORCE; NaN/inf phi count 0.
    """
    with torch.no_grad():
        wide = torch.promote_types(x.logp.dtype, torch.float32)
        own = torch.where(x.mask, x.log_ratio.detach().to(wide), 0).sum(-1)  # [N]
        if x.sampler_weights is None:
            sampler = torch.zeros_like(own)
        else:
            # Sum over the mask only: cohort's sampler weights are 0 at padding, whose log would be -inf.
            log_is = torch.log(x.sampler_weights.detach().to(wide)).clamp(VESPO_LOG_W_MIN, VESPO_LOG_W_MAX)
            sampler = torch.where(x.mask, log_is, 0).sum(-1)  # [N]
        log_w = (own + sampler).clamp(VESPO_LOG_W_MIN, VESPO_LOG_W_MAX)[:, None]  # [N, 1]
        positive = x.advantages >= 0  # [N, T]; per-sequence advantages give one sign per row
        k = torch.where(positive, k_pos, k_neg).to(wide)  # [N, T]
        lam = torch.where(positive, lambda_pos, lambda_neg).to(wide).clamp(min=1e-4)  # [N, T]
        phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))  # [N, T]
        phi = torch.where(torch.isfinite(phi), phi, 0)
        rows = x.mask.any(-1)  # [N]
        phi_row = torch.where(x.mask, phi, 0).sum(-1) / x.lengths  # [N]; constant per row for [N] advantages
        phi_mean = torch.where(rows, phi_row, 0).sum() / rows.sum().clamp(min=1)
    loss = -phi.to(x.logp.dtype) * x.advantages * x.policy_gradient_term()  # [N, T]
    return LossTerms(loss, metrics={"vespo/phi_seq_mean": phi_mean})


def _dppo_loss(
    x: LossInputs,
    *,
    kind: str,
    mask_low: float,
    mask_high: float,
    max_ratio: float | None,
) -> LossTerms:
    """Return DPPO's per-token loss -(1 - drop) * sg(min(rho, max_ratio)) * A * r for divergence `kind`.

    drop = (D > mask_high and p > p_anchor) where A > 0, else (D > mask_low and p < p_anchor), with p = pi(y_t)
    and p_anchor = pi_old(y_t) (the sampler's under trust_region_anchor=sampler). D is x.divergence when given
    (top-K), else the binary one: |p - p_anchor| ("tv") or the Bernoulli KL of the sampled token ("kl").
    """
    ratio = torch.exp(x.log_ratio)  # [N, T]
    with torch.no_grad():
        wide = torch.promote_types(x.logp.dtype, torch.float32)
        p = torch.exp(x.logp.detach().to(wide))  # [N, T]
        p_old = torch.exp(x.old_logp.to(wide))  # [N, T]
        if x.divergence is not None:
            div = x.divergence.detach().to(wide)
        elif kind == "tv":
            div = (p - p_old).abs()
        else:
            # KL(Bernoulli(p_old) || Bernoulli(p)) over "the sampled token or not" (verl's dppo_kl, its 1e-8 guard).
            div = p_old * (x.old_logp.to(wide) - x.logp.detach().to(wide)) + (1 - p_old) * torch.log(
                (1 - p_old + 1e-8) / (1 - p + 1e-8)
            )
        positive = x.advantages > 0
        drop_high = positive & (div > mask_high) & (p > p_old)  # [N, T]
        drop_low = ~positive & (div > mask_low) & (p < p_old)  # [N, T]
        keep = ~(drop_high | drop_low)
        weight = ratio.detach() if max_ratio is None else ratio.detach().clamp(max=max_ratio)  # [N, T]
    loss = -(keep * weight) * x.advantages * x.policy_gradient_term()  # [N, T]
    return LossTerms(loss, drop_low & (x.advantages < 0), drop_high)


def dppo_tv_loss(
    x: LossInputs,
    *,
    mask_low: float = _default("dppo_tv", "mask_low"),
    mask_high: float = _default("dppo_tv", "mask_high"),
    max_ratio: float | None = _default("dppo_tv", "max_ratio"),
) -> LossTerms:
    """Return DPPO's per-token loss with the total-variation mask |pi - pi_anchor| (or x.divergence)."""
    return _dppo_loss(x, kind="tv", mask_low=mask_low, mask_high=mask_high, max_ratio=max_ratio)


def dppo_kl_loss(
    x: LossInputs,
    *,
    mask_low: float = _default("dppo_kl", "mask_low"),
    mask_high: float = _default("dppo_kl", "mask_high"),
    max_ratio: float | None = _default("dppo_kl", "max_ratio"),
) -> LossTerms:
    """Return DPPO's per-token loss with the binary KL mask of the sampled token (or x.divergence)."""
    return _dppo_loss(x, kind="kl", mask_low=mask_low, mask_high=mask_high, max_ratio=max_ratio)


def dro_loss(x: LossInputs) -> LossTerms:
    """Return the policy part of verl's DRO, -A * r; its squared log-ratio penalty is policy_loss's kl_tau."""
    return LossTerms(-x.advantages * x.policy_gradient_term())


_BUILTIN_FUNCTIONS: dict[str, PerTokenLoss] = {
    **{name: clip_loss for name in ("grpo", "bnpo", "dapo", "dr_grpo", "luspo")},
    "cispo": cispo_loss,
    "sapo": sapo_loss,
    "gmpo": gmpo_loss,
    "vespo": vespo_loss,
    "dppo_tv": dppo_tv_loss,
    "dppo_kl": dppo_kl_loss,
    "dro": dro_loss,
}
for _name, _kind in BUILTIN_LOSSES.items():  # what each reads is written once, in cohort.algo.options
    register_loss(
        _name,
        _BUILTIN_FUNCTIONS[_name],
        _kind.aggregation,
        sequence_advantages=_kind.sequence_advantages,
        token_importance=_kind.token_importance,
        folds_sampler_weights=_kind.folds_sampler_weights,
        reads_divergence=_kind.reads_divergence,
    )
    if LOSS_KINDS[_name] != _kind:
        raise ImportError(
            f"loss {_name!r}: cohort.algo.options says {_kind}, its function says {LOSS_KINDS[_name]}"
        )

LOSS_TYPES = tuple(POLICY_LOSSES)
"""The built-in loss types (user losses registered later are in POLICY_LOSSES only)."""


def check_loss_kwargs(loss_type: str, kwargs: Mapping[str, object]) -> dict[str, object]:
    """Return `kwargs` after checking each is a parameter of `loss_type` inside its valid range."""
    if loss_type not in POLICY_LOSSES:
        valid = ", ".join(repr(o) for o in POLICY_LOSSES)
        raise ValueError(
            f"unknown loss_type {loss_type!r}; valid options: {valid}, or 'my_pkg.module:function' for your own."
        )
    fn = POLICY_LOSSES[loss_type].fn
    if fn is _BUILTIN_FUNCTIONS.get(loss_type):
        return check_loss_parameters(loss_type, kwargs)
    kwargs = dict(kwargs)
    check_loss_signature(loss_type, fn, kwargs)
    return kwargs


def check_loss_signature(name: str, fn: Callable, kwargs: Mapping[str, object]) -> None:
    """Raise a ValueError naming the expected signature when fn(inputs, **kwargs) cannot be called."""
    try:
        inspect.signature(fn).bind(None, **kwargs)
    except TypeError as exc:
        raise ValueError(
            f"loss {name!r} cannot be called as fn(inputs, **{dict(kwargs)!r}): {exc}. Expected signature: "
            "def my_loss(inputs: cohort.algo.LossInputs, **loss_kwargs) -> torch.Tensor  "
            "(the per-token loss [N, T] to minimise; algo.loss_kwargs supplies the keyword arguments)"
        ) from None
    except ValueError:  # builtins without an introspectable signature: checked when called
        return


def aggregation_of(loss_type: str, aggregation: str | None = None) -> str:
    """Return the aggregation a loss type uses: `aggregation` when given, else the loss type's own."""
    if aggregation is not None:
        return check_choice("aggregation", aggregation, LOSS_AGGREGATIONS)
    if loss_type in POLICY_LOSSES:
        return POLICY_LOSSES[loss_type].aggregation
    return check_choice("loss_type", loss_type, POLICY_LOSSES)


def loss_normalisers(
    loss_type: str,
    lengths: Sequence[int],
    all_sum: Callable[[int], int] = int,
    world_size: int = 1,
    aggregation: str | None = None,
) -> tuple[int, int]:
    """Returns (num_items, num_sequences) to pass to policy_loss for a minibatch whose in-loss rows on this
    process have token counts `lengths`; all_sum(x) sums an int over the `world_size` processes (identity on
    one process).

    The loss of a batch split over processes is the sum of the per-process losses (gradients are summed
    across processes), so num_sequences counts every process's sequences, and num_items is the token count
    of TOKEN_COUNT_SCOPE of the loss type's aggregation: for "global" (dapo) the tokens of every process; for
    "process" (bnpo) this process's tokens times world_size, which makes the summed gradient the mean of the
    per-process token means (what TRL gets from DDP's gradient averaging) instead of world_size times it.
    Both are at least 1, so an empty minibatch gives a zero loss instead of a division by zero.
    """
    agg = aggregation_of(loss_type, aggregation)
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    tokens = int(sum(lengths))
    scope = TOKEN_COUNT_SCOPE.get(agg)
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


@dataclass(frozen=True)
class LossOptions:
    """policy_loss's settings that stay the same through an update, checked once (made by check_loss_options)."""

    loss_type: str
    aggregation: str
    """The aggregation the loss uses: the one asked for, else the loss type's own."""
    loss_kwargs: Mapping[str, object]
    """The loss's keyword parameters, checked against LOSS_PARAMETERS or the user loss's signature."""
    eps_low: float
    eps_high: float
    """eps_low when none was given."""
    delta: float | None
    beta: float
    max_completion_length: int | None
    """Checked by each policy_loss call against its padded length T."""
    importance: str
    kl_kind: str
    kl_tau: float = 0.0
    """Coefficient of the squared log-ratio penalty kl_tau * (log pi/pi_old)^2 per completion token (0: off)."""
    use_bias_correction_kl: bool = False
    """Multiply the beta term's KL estimate by the token ratio pi/pi_old (DeepSeek-V3.2's unbiased KL)."""


def _checked_options(
    *,
    loss_type: str,
    aggregation: str | None,
    loss_kwargs: Mapping[str, object] | None,
    eps_low: float,
    eps_high: float | None,
    delta: float | None,
    beta: float,
    max_completion_length: int | None,
    importance: str,
    kl_kind: str,
    kl_tau: float = 0.0,
    use_bias_correction_kl: bool = False,
) -> LossOptions:
    """Returns the LossOptions of policy_loss's settings after their checks (in policy_loss's order)."""
    agg = aggregation_of(loss_type, aggregation)
    spec = POLICY_LOSSES[loss_type]
    kwargs = check_loss_kwargs(loss_type, loss_kwargs or {})
    check_choice("importance", importance, IMPORTANCE_LEVELS)
    if spec.token_importance and importance != "token":
        raise ValueError(
            f"loss_type={loss_type!r} is built on token-level ratios; importance={importance!r} is not defined "
            "for it. Fix: importance='token'."
        )
    check_choice("kl_kind", kl_kind, KL_KINDS)
    eps_low, eps_high, delta = check_clip(eps_low, eps_high, delta)
    beta = check_nonneg("beta", beta)
    kl_tau = check_nonneg("kl_tau", kl_tau)
    if loss_type == "dro" and kl_tau == 0:
        raise ValueError(
            "loss_type='dro' is -A * r plus the squared log-ratio penalty kl_tau * (log pi/pi_old)^2, and "
            "kl_tau=0 leaves only a plain policy gradient. Fix: pass kl_tau > 0 (verl's dro_beta = 2 * kl_tau)."
        )
    if not isinstance(use_bias_correction_kl, bool):
        raise TypeError(f"use_bias_correction_kl must be True or False, got {use_bias_correction_kl!r}.")
    return LossOptions(
        loss_type=loss_type,
        aggregation=agg,
        loss_kwargs=MappingProxyType(kwargs),
        eps_low=eps_low,
        eps_high=eps_high,
        delta=delta,
        beta=beta,
        max_completion_length=max_completion_length,
        importance=importance,
        kl_kind=kl_kind,
        kl_tau=kl_tau,
        use_bias_correction_kl=use_bias_correction_kl,
    )


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    loss_type: str = "grpo",
    aggregation: str | None = None,
    loss_kwargs: Mapping[str, object] | None = None,
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
    token_weights: torch.Tensor | None = None,
    kl_cov_mask: torch.Tensor | None = None,
    kl_cov_coef: float = 1.0,
    kl_tau: float = 0.0,
    use_bias_correction_kl: bool = False,
    sampler_weights: torch.Tensor | None = None,
    divergence: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Return (loss, metrics): the aggregated policy loss (scalar) and detached tensor metrics.

    logp [N, T]: log pi_theta of the completion tokens (differentiable); old_logp [N, T] or None
    (on-policy: the ratio is taken against logp.detach(), value 1, gradient grad log pi_theta);
    advantages [N] (one per completion) or [N, T] (per token, process supervision); mask [N, T], True on
    completion tokens. Masked positions may hold anything (even inf/NaN): they get exactly zero gradient.
    loss_type: a name in POLICY_LOSSES (grpo, bnpo, dapo, dr_grpo: the clip loss with that aggregation;
    cispo, sapo, gmpo; or a registered user loss), called with `loss_kwargs`; aggregation None uses the loss
    type's own. eps_high None means eps_low; delta caps rho from above for the unclipped term (two-sided /
    dual clipping), None = no cap; beta > 0 adds beta * KL(logp, ref_logp) with the estimator kl_kind
    ("k1" | "k2" | "k3", see kl_estimate; k3 is DeepSeekMath's) and needs ref_logp; importance "token" |
    "sequence" (GSPO). token_weights [N] or [N, T] (detached) multiply each token's policy loss before the KL
    term is added: entropy masks, Clip-Cov's detached tokens, importance weights for the sampler. kl_cov_mask
    [N, T] bool adds KL-Cov's kl_cov_coef * |log(pi_theta / pi_old)| on the selected tokens.
    kl_tau >= 0 adds kl_tau * (log pi_theta / pi_old)^2 on every completion token (the token log-ratio, also at
    importance="sequence"), after and unscaled by token_weights / sampler_weights (prime-rl's penalty; verl's
    dro). use_bias_correction_kl multiplies the beta term's estimate by the token ratio pi_theta / pi_old
    (DeepSeek-V3.2's unbiased KL; differentiable, so it changes the gradient even on-policy).
    sampler_weights [N, T] (detached): the sampler correction's importance weights; they multiply each token's
    policy loss like token_weights, except for a loss that folds them into its own weight (vespo), which sees
    them once. divergence [N, T] (detached): DPPO's per-token divergence from the anchor (top-K TV or KL,
    topk_divergence), in place of the binary one; only dppo_tv / dppo_kl read it.
    num_sequences (grpo, dr_grpo) and num_items (bnpo, dapo) are the counts of the whole batch this
    micro-batch belongs to (None: its own); summing the micro-batch losses then equals the full-batch loss.
    Metrics: clip_ratio/low_mean, clip_ratio/high_mean, clip_ratio/region_mean (for dppo: the tokens its mask
    dropped), ratio/mean, kl (masked mean of the kl_kind estimate, bias-corrected when asked) when ref_logp is
    given, kl_tau/penalty_mean (the masked mean of (log pi/pi_old)^2) when kl_tau > 0, and the loss's own
    (vespo/phi_seq_mean).
    The settings (loss_type through use_bias_correction_kl, LossOptions' fields) are checked on the first call
    that gives them and remembered (_settings_checked), so the micro-batches of an update check them once.
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
    o = _settings_checked(
        loss_kwargs,
        (
            loss_type,
            aggregation,
            eps_low,
            eps_high,
            delta,
            beta,
            max_completion_length,
            importance,
            kl_kind,
            kl_tau,
            use_bias_correction_kl,
        ),
    )
    loss_type, agg, kwargs = o.loss_type, o.aggregation, o.loss_kwargs
    importance, kl_kind, max_completion_length = o.importance, o.kl_kind, o.max_completion_length
    eps_low, eps_high, delta, beta = o.eps_low, o.eps_high, o.delta, o.beta
    kl_tau, bias_kl = o.kl_tau, o.use_bias_correction_kl
    spec = POLICY_LOSSES[loss_type]
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
    elif agg == "dr_grpo":
        raise ValueError(
            "aggregation 'dr_grpo' divides by N * max_completion_length, but max_completion_length is None. "
            "Fix: pass max_completion_length (the generation limit)."
        )
    _check_normaliser("num_items", num_items)
    _check_normaliser("num_sequences", num_sequences)
    if token_weights is not None:
        check_tensor("token_weights", token_weights)
        if token_weights.shape not in ((n,), shape):
            raise ValueError(
                f"token_weights has shape {tuple(token_weights.shape)}; it must be [N] or [N, T]."
            )
    if sampler_weights is not None:
        check_tensor("sampler_weights", sampler_weights)
        _check_same_shape("sampler_weights", sampler_weights, shape)
    if divergence is not None:
        check_tensor("divergence", divergence)
        _check_same_shape("divergence", divergence, shape)
        if not spec.reads_divergence:
            readers = [name for name, s in POLICY_LOSSES.items() if s.reads_divergence]
            raise ValueError(
                f"divergence is read by {', '.join(readers)} only; loss_type={loss_type!r} would ignore it. "
                "Fix: leave divergence out, or use loss_type='dppo_tv' / 'dppo_kl'."
            )
    if kl_cov_mask is not None:
        check_tensor("kl_cov_mask", kl_cov_mask)
        _check_same_shape("kl_cov_mask", kl_cov_mask, shape)
        kl_cov_coef = check_nonneg("kl_cov_coef", kl_cov_coef)

    mask = mask.bool()  # [N, T]
    # Sanitise masked positions before any arithmetic: where() alone would still send 0 * inf = NaN
    # gradients through exp() at padding that holds -inf or garbage.
    logp = torch.where(mask, logp, 0)  # [N, T]
    old = logp.detach() if old_logp is None else torch.where(mask, old_logp.detach(), 0)  # [N, T]
    seq_adv = advantages.detach() if advantages.dim() == 1 else None  # [N]
    if spec.sequence_advantages and seq_adv is None:
        raise ValueError(
            f"loss_type={loss_type!r} needs one advantage per completion ([N]), got per-token advantages "
            f"{tuple(advantages.shape)}. Fix: use another loss type with process rewards."
        )
    adv = advantages.detach()
    adv = adv[:, None] if adv.dim() == 1 else adv  # [N, 1] or [N, T]
    adv = torch.where(mask, adv, 0)  # [N, T]

    log_ratio = (logp - old).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # [N, T]
    token_log_ratio = log_ratio
    if importance == "sequence":
        lengths = mask.sum(-1).clamp(min=1)  # [N]
        seq_log_ratio = log_ratio.sum(-1) / lengths  # [N], masked entries are already 0
        log_ratio = logp - logp.detach() + seq_log_ratio.detach()[:, None]  # [N, T], value log s_i

    sampler_w = None if sampler_weights is None else torch.where(mask, sampler_weights.detach(), 0)  # [N, T]
    div = None if divergence is None else torch.where(mask, divergence.detach(), 0)  # [N, T]
    inputs = LossInputs(
        logp,
        old,
        log_ratio,
        adv,
        seq_adv,
        mask,
        eps_low,
        eps_high,
        delta,
        sampler_weights=sampler_w if spec.folds_sampler_weights else None,
        divergence=div,
    )
    terms = spec.fn(inputs, **kwargs)
    if not isinstance(terms, LossTerms):
        terms = LossTerms(terms)
    per_token_policy = terms.loss
    if not isinstance(per_token_policy, torch.Tensor) or per_token_policy.shape != shape:
        got = (
            tuple(per_token_policy.shape) if isinstance(per_token_policy, torch.Tensor) else type(terms.loss)
        )
        raise ValueError(
            f"loss {loss_type!r} returned {got}; a loss must return the per-token loss as a tensor of shape "
            f"[N, T]={tuple(shape)} (or a cohort.algo.LossTerms holding one)."
        )
    weights = None if token_weights is None else token_weights.detach()
    if weights is not None and weights.dim() == 1:
        weights = weights[:, None]  # [N, 1]
    if sampler_w is not None and not spec.folds_sampler_weights:
        # One product of the weights, then one multiplication: the same numbers as sampler weights folded
        # into token_weights by the caller.
        weights = sampler_w if weights is None else weights * sampler_w
    if weights is not None:
        per_token_policy = per_token_policy * weights.to(per_token_policy.dtype)
    if kl_cov_mask is not None and kl_cov_coef > 0:
        per_token_policy = per_token_policy + kl_cov_coef * token_log_ratio.abs() * kl_cov_mask.bool()
    per_token = per_token_policy
    if kl_tau > 0:
        # Unweighted: the leash holds on every token, those the weights silence included (decision D4).
        per_token = per_token + kl_tau * token_log_ratio.square()
    kl = None
    if ref_logp is not None:
        ref = torch.where(mask, ref_logp.detach(), 0)  # [N, T]
        kl = kl_estimate(logp, ref, kl_kind)  # [N, T]
        if bias_kl:
            # DeepSeek-V3.2: samples come from pi_old, so the estimate is reweighted by pi_theta / pi_old per
            # token; the factor keeps its gradient (TRL's coef_1).
            kl = kl * torch.exp(token_log_ratio)
        if beta > 0:
            per_token = per_token + beta * kl
    per_token = torch.where(mask, per_token, 0)  # [N, T]

    loss = LOSS_AGGREGATIONS[agg](
        per_token,
        mask,
        num_items=num_items,
        num_sequences=num_sequences,
        max_completion_length=max_completion_length,
    )

    with torch.no_grad():
        # Metrics in at least float32: bf16 cannot even count past 256 exactly.
        ratio_d = torch.exp(log_ratio.detach()).to(torch.promote_types(logp.dtype, torch.float32))  # [N, T]
        count = mask.sum().clamp(min=1)  # masked_mean's denominator, counted once for every metric

        def mean(values: torch.Tensor) -> torch.Tensor:
            return torch.where(mask, values.to(ratio_d.dtype), 0).sum() / count

        if terms.clipped_low is None or terms.clipped_high is None:
            none = torch.zeros_like(mask)
        is_low = (none if terms.clipped_low is None else terms.clipped_low.bool()) & mask  # [N, T]
        is_high = (none if terms.clipped_high is None else terms.clipped_high.bool()) & mask  # [N, T]
        metrics = {
            "clip_ratio/low_mean": mean(is_low),
            "clip_ratio/high_mean": mean(is_high),
            "clip_ratio/region_mean": mean(is_low | is_high),
            "ratio/mean": mean(ratio_d),
        }
        if kl is not None:
            metrics["kl"] = mean(kl.detach())
        if kl_tau > 0:
            metrics["kl_tau/penalty_mean"] = mean(token_log_ratio.detach().square())
        for key, value in (terms.metrics or {}).items():
            metrics[key] = value.detach()
    return loss, metrics


_CHECKED_SETTINGS: dict[tuple, tuple[PolicyLoss | None, LossOptions]] = {}
"""The LossOptions of the settings policy_loss has seen, by _settings_key, with the registered loss they were
checked against (held so that its id, part of the key, stays its own): an update calls policy_loss once per
micro-batch with the same settings, which are then checked once."""
_CHECKED_SETTINGS_MAX = 32
"""More distinct settings than this and the memo starts over (an update uses one; tests use a few dozen)."""


_KEYED_SETTINGS = (
    "loss_type",
    "aggregation",
    "eps_low",
    "eps_high",
    "delta",
    "beta",
    "max_completion_length",
    "importance",
    "kl_kind",
    "kl_tau",
    "use_bias_correction_kl",
)
"""The settings policy_loss passes to _settings_checked as one tuple, in this order (loss_kwargs apart)."""


def _settings_checked(loss_kwargs: Mapping[str, object] | None, values: tuple) -> LossOptions:
    """Returns the LossOptions of policy_loss's settings (`values` in _KEYED_SETTINGS's order): checked by
    _checked_options the first time, then remembered, so that the micro-batches of an update pay for one
    dictionary look-up instead of the checks."""
    key: tuple | None
    known: tuple[PolicyLoss | None, LossOptions] | None
    try:
        spec = POLICY_LOSSES.get(values[0])
        # Types and signs are part of the key: True == 1 and -0.0 == 0.0, yet use_bias_correction_kl=1 is
        # refused and a loss may tell the zeros apart. So is the registered loss (by id: a dataclass's hash costs
        # more than the rest of the key), so that a loss registered again is checked again.
        key = (
            id(spec),
            values,
            tuple(map(type, values)),
            *[math.copysign(1, v) for v in values if isinstance(v, float)],
        )
        if loss_kwargs:  # an empty one (None, {}) is checked as {}: the same key
            items = tuple(loss_kwargs.items())
            key += (items, *[(type(v), math.copysign(1, v) if isinstance(v, float) else 0) for _, v in items])
        known = _CHECKED_SETTINGS.get(key)
    except Exception:  # an unhashable or odd setting: checked on every call, with the checks' own errors
        key = known = None
    if known is not None:
        return known[1]
    options = _checked_options(loss_kwargs=loss_kwargs, **dict(zip(_KEYED_SETTINGS, values)))
    if key is not None:  # settings that fail their checks raise above and are never remembered
        if len(_CHECKED_SETTINGS) >= _CHECKED_SETTINGS_MAX:
            _CHECKED_SETTINGS.clear()  # atomic, unlike evicting one entry while another thread adds one
        _CHECKED_SETTINGS[key] = (spec, options)
    return options


_SETTING_DEFAULTS: dict[str, Any] = {
    name: p.default
    for name, p in inspect.signature(policy_loss).parameters.items()
    if name in {f.name for f in dataclasses.fields(LossOptions)}
}
"""policy_loss's keywords that stay the same through an update (LossOptions' fields), with its defaults for
them: check_loss_options's defaults too."""


def check_loss_options(**settings: Any) -> LossOptions:
    """Returns the checked LossOptions of policy_loss's settings keywords (its defaults for those not given).

    A pre-check, e.g. when a trainer is built, before any tensor exists: the same checks and error messages
    as a policy_loss call given the keywords (which checks each distinct settings once, see _settings_checked).
    """
    unknown = sorted(set(settings) - set(_SETTING_DEFAULTS))
    if unknown:
        raise TypeError(
            f"check_loss_options() got unexpected keyword arguments {unknown}; it takes policy_loss's "
            f"settings: {', '.join(_SETTING_DEFAULTS)}"
        )
    return _checked_options(**{**_SETTING_DEFAULTS, **settings})
