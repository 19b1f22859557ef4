"""Token selections for entropy control, applied to one micro-batch's tokens by the caller.

- top_entropy_mask: "Beyond the 80/20 Rule" (Wang et al. 2025, arXiv 2506.01939) trains only on the
  highest-entropy "forking" tokens: the top `quantile` share of the valid tokens by entropy.
- token_covariance, clip_cov_mask, kl_cov_mask: Cui et al. 2025 (arXiv 2505.22617, "The Entropy Mechanism of
  Reinforcement Learning for Reasoning Language Models"): entropy falls fastest through tokens whose
  log-probability and advantage covary most; Clip-Cov detaches the gradient of a few such tokens drawn at
  random among those with covariance in [low, high], KL-Cov penalises the top ones by covariance.

Where cohort departs from the papers: the statistics (quantile, covariance means, the token counts the
ratios apply to) are taken over one micro-batch, the unit of the log-prob pass, as TRL and verl take them
over theirs; the papers state them over the batch. So `micro_batch_tokens` changes which tokens are chosen.
"""

from __future__ import annotations

import torch

from ._checks import check_tensor

COV_RATIOS = {"clip_cov": 2e-4, "kl_cov": 2e-3}
"""The share of tokens each covariance method acts on in Cui et al. 2025 (Clip-Cov r, KL-Cov k)."""


def _check_ratio(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ValueError(f"{name} must be in (0, 1] (a share of the valid tokens), got {value!r}")
    return float(value)


def _check_pair(a: torch.Tensor, mask: torch.Tensor, name: str) -> torch.Tensor:
    check_tensor(name, a)
    check_tensor("mask", mask)
    if a.dim() != 2 or a.shape != mask.shape:
        raise ValueError(
            f"{name} has shape {tuple(a.shape)} and mask {tuple(mask.shape)}; both must be [N, T] (per token)."
        )
    return mask.bool()


def _count(ratio: float, n_valid: int) -> int:
    """Returns max(1, floor(ratio * n_valid)), or 0 when there is no valid token."""
    return 0 if n_valid == 0 else max(1, int(ratio * n_valid))


def top_entropy_mask(entropy: torch.Tensor, mask: torch.Tensor, quantile: float) -> torch.Tensor:
    """Return a bool [N, T] mask of the valid tokens whose entropy is in the top `quantile` share (ties kept)."""
    mask = _check_pair(entropy, mask, "entropy")
    quantile = _check_ratio("quantile", quantile)
    if quantile == 1.0:
        return mask.clone()
    valid = entropy.detach()[mask].float()  # [M]
    if valid.numel() == 0:
        return torch.zeros_like(mask)
    threshold = torch.quantile(valid, 1.0 - quantile)
    return (entropy.detach().float() >= threshold) & mask


def token_covariance(logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Return [N, T]: (logp - mean(logp)) * (A - mean(A)) per valid token (means over valid tokens), 0 elsewhere."""
    mask = _check_pair(logp, mask, "logp")
    check_tensor("advantages", advantages)
    adv = advantages.detach()
    if adv.shape == (logp.shape[0],):
        adv = adv[:, None].expand_as(logp)
    elif adv.shape != logp.shape:
        raise ValueError(
            f"advantages has shape {tuple(advantages.shape)}; it must be [N] or [N, T] like logp."
        )
    lp = logp.detach()
    count = mask.sum().clamp(min=1)
    lp_mean = torch.where(mask, lp, 0).sum() / count
    adv_mean = torch.where(mask, adv, 0).sum() / count
    return torch.where(mask, (lp - lp_mean) * (adv - adv_mean), 0)  # [N, T]


def clip_cov_mask(
    cov: torch.Tensor,
    mask: torch.Tensor,
    *,
    ratio: float,
    low: float,
    high: float,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Return a bool [N, T] mask of the tokens Clip-Cov detaches: k = max(1, floor(ratio * valid tokens)) drawn
    uniformly (with `generator`) among the valid tokens with low <= cov <= high (all of them if fewer)."""
    mask = _check_pair(cov, mask, "cov")
    ratio = _check_ratio("ratio", ratio)
    if not low < high:
        raise ValueError(
            f"low must be < high (the covariance band; the paper's is [1, 5]), got [{low}, {high}]"
        )
    k = _count(ratio, int(mask.sum()))
    candidates = (mask & (cov >= low) & (cov <= high)).flatten().nonzero().squeeze(-1)  # [C]
    out = torch.zeros(mask.numel(), dtype=torch.bool, device=mask.device)
    if candidates.numel() and k:
        device = generator.device if generator is not None else torch.device("cpu")
        order = torch.randperm(candidates.numel(), generator=generator, device=device).to(candidates.device)
        out[candidates[order[:k]]] = True
    return out.view_as(mask)


def kl_cov_mask(cov: torch.Tensor, mask: torch.Tensor, *, ratio: float) -> torch.Tensor:
    """Return a bool [N, T] mask of the top k = max(1, floor(ratio * valid tokens)) valid tokens by covariance."""
    mask = _check_pair(cov, mask, "cov")
    ratio = _check_ratio("ratio", ratio)
    k = _count(ratio, int(mask.sum()))
    out = torch.zeros(mask.numel(), dtype=torch.bool, device=mask.device)
    if k:
        scores = torch.where(mask, cov, float("-inf")).flatten()
        out[torch.topk(scores, k).indices] = True
    return out.view_as(mask)
