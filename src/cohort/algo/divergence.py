"""Top-K divergences between the sampler's next-token distribution and the policy's (DPPO's top-K masks).

The sampler returns, per completion token, its K most likely tokens' log-probs (the sampled token forced in);
both distributions are reduced to those K tokens plus one "rest" bucket holding the remaining mass, and the
divergence of the two K + 1-point distributions stands in for the full-vocabulary one (DPPO, arXiv 2602.04879;
Stable-RL's compute_topk_kl). Computed in at least float32.
"""

from __future__ import annotations

import torch

from ._checks import check_tensor

#: Floor of a rest bucket's mass, so that its log stays finite when the K tokens hold (nearly) everything.
REST_FLOOR = 1e-12


def topk_divergence(
    logits: torch.Tensor, topk_ids: torch.Tensor, topk_logprobs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (kl [N, T], tv [N, T]): KL(P || Q) and TV(P, Q) over the sampler's top-K tokens plus the rest.

    logits [N, T, V]: the policy's next-token logits (at the sampling temperature); topk_ids [N, T, K] (long):
    the sampler's top-K token ids; topk_logprobs [N, T, K]: the sampler's log-probs of them. P is the sampler's
    K probabilities and its rest 1 - sum (floored at 1e-12); Q the policy's at the same ids and its rest.
    KL = sum_k p_k (log p_k - log q_k) + p_rest (log p_rest - log q_rest); TV = (sum_k |p_k - q_k| +
    |p_rest - q_rest|) / 2. Differentiable in logits (detach the result to use it as a mask).
    """
    for name, t in (("logits", logits), ("topk_ids", topk_ids), ("topk_logprobs", topk_logprobs)):
        check_tensor(name, t)
    if logits.dim() != 3 or topk_ids.dim() != 3 or topk_ids.shape != topk_logprobs.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} must be [N, T, V] and topk_ids {tuple(topk_ids.shape)} / "
            f"topk_logprobs {tuple(topk_logprobs.shape)} both [N, T, K]."
        )
    if topk_ids.shape[:2] != logits.shape[:2]:
        raise ValueError(
            f"topk_ids {tuple(topk_ids.shape)} and logits {tuple(logits.shape)} must share [N, T] (one top-K per "
            "completion token)."
        )
    if topk_ids.is_floating_point() or topk_ids.dtype == torch.bool:
        raise TypeError(f"topk_ids must hold integer token ids, got dtype {topk_ids.dtype}.")
    wide = torch.promote_types(logits.dtype, torch.float32)
    log_q = torch.log_softmax(logits.to(wide), dim=-1).gather(-1, topk_ids.long())  # [N, T, K]
    return topk_divergence_from_logprobs(log_q, topk_logprobs)


def topk_divergence_from_logprobs(
    policy_topk_logprobs: torch.Tensor, anchor_topk_logprobs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (kl [...], tv [...]): KL(P || Q) and TV(P, Q) of the K + 1-point distributions over the last dim.

    policy_topk_logprobs [..., K]: the policy's log-probs log q_k at the sampler's top-K ids (a gather of its
    log-softmax, e.g. LogProbs.topk_logp from the chunked LM head); anchor_topk_logprobs [..., K]: the anchor's
    log p_k at the same ids (the sampler's, or pi_old's). The rests are 1 - sum (floored at 1e-12). Computed in
    the policy's dtype promoted to at least float32; the anchor is detached, the policy side is not.
    topk_divergence is this function applied to its logits' gathered log-softmax, so both agree exactly.
    """
    check_tensor("policy_topk_logprobs", policy_topk_logprobs)
    check_tensor("anchor_topk_logprobs", anchor_topk_logprobs)
    if policy_topk_logprobs.shape != anchor_topk_logprobs.shape or policy_topk_logprobs.dim() < 1:
        raise ValueError(
            f"policy_topk_logprobs {tuple(policy_topk_logprobs.shape)} and anchor_topk_logprobs "
            f"{tuple(anchor_topk_logprobs.shape)} must have one shape [..., K] (the same K ids per token)"
        )
    wide = torch.promote_types(policy_topk_logprobs.dtype, torch.float32)
    log_q = policy_topk_logprobs.to(wide)  # [..., K]
    log_p = anchor_topk_logprobs.detach().to(wide)  # [..., K]
    p, q = log_p.exp(), log_q.exp()
    p_rest = (1 - p.sum(-1)).clamp(min=REST_FLOOR)  # [...]
    q_rest = (1 - q.sum(-1)).clamp(min=REST_FLOOR)  # [...]
    kl = (p * (log_p - log_q)).sum(-1) + p_rest * (p_rest.log() - q_rest.log())  # [...]
    tv = 0.5 * ((p - q).abs().sum(-1) + (p_rest - q_rest).abs())  # [...]
    return kl, tv
