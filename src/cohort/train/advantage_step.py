"""Advantages of a drawn batch: the chosen estimator over every process's rewards, process rewards' per-token
advantages, and which completions enter the loss."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from cohort.algo import combine_rewards, process_advantages, process_advantages_to_tokens, zero_std_group_mask
from cohort.algo.estimators import estimate_advantages
from cohort.algo.options import advantage_arguments
from cohort.rollout import RolloutBatch
from cohort.train.scorer import StepSpans

GatherRows = Callable[[torch.Tensor], tuple[torch.Tensor, int]]
"""Returns (every process's rows concatenated, where this process's rows start): `distributed.all_gather_rows`."""


def own_rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Returns (x, 0): this process's rows alone (held-out evaluation, alike on every process)."""
    return x, 0


@dataclass
class Advantaged:
    """A batch's advantages and the completions that enter the loss."""

    advantages: torch.Tensor
    """[N] per completion (a process reward: the mean of its token advantages)."""
    in_loss: torch.Tensor
    """[N] bool: not filtered out (zero-std groups under algo.filter_zero_std, truncated under mask_truncated)."""
    zero_std: torch.Tensor
    """[N] bool: the completion's group has all-equal rewards."""
    token_advantages: list[torch.Tensor] | None = None
    """Per completion a [T_i] tensor, with a process reward; None otherwise."""


def estimate(
    reward: torch.Tensor,
    rollout: RolloutBatch,
    algo: Any,
    gather: GatherRows = own_rows,
    lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """Returns this process's rows of the chosen estimator's advantages [N], computed over the rows `gather`
    collects (every process's, so batch statistics do not depend on the process count); `lengths`: every
    process's loss lengths (float64) when already gathered."""
    rows, start = gather(reward)
    if lengths is None:
        lengths = rollout.loss_lengths.cpu().to(torch.float64)  # tokens the policy generated
        if gather is not own_rows:
            lengths, _ = gather(lengths)
    adv = estimate_advantages(
        algo.advantage,
        rows,
        rollout.group_size,
        lengths.tolist(),
        **advantage_arguments(algo.advantage, algo),
    )
    return adv[start : start + reward.shape[0]]


def outcome_advantages(
    per_func: torch.Tensor,
    reward: torch.Tensor,
    rollout: RolloutBatch,
    algo: Any,
    weights: torch.Tensor,
    gather: GatherRows = own_rows,
    lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """Returns this process's rows of the advantages [N]; GDPO ("decoupled") normalises each reward before
    combining them, every other mode estimates from the weighted sum `reward` (`lengths`: see `estimate`)."""
    if algo.reward_mode != "decoupled":
        return estimate(reward, rollout, algo, gather, lengths)
    rows, start = gather(per_func)
    adv = combine_rewards(rows, weights, rollout.group_size, mode="decoupled", std=algo.std, eps=algo.adv_eps)
    return adv[start : start + reward.shape[0]]


def token_advantages(
    per_func: torch.Tensor,
    steps: StepSpans,
    rollout: RolloutBatch,
    algo: Any,
    weights: torch.Tensor,
    column: int,
    gather: GatherRows = own_rows,
    loss_lengths: torch.Tensor | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Returns (per-row mean advantage [N], per-token advantages, one [T_i] tensor per row) of a batch with a
    process reward in column `column`: A_it = A_outcome_i + w_p * A_process_it, where A_outcome is the chosen
    estimator over the other (outcome) reward functions (0 when there are none) and A_process the return-to-go
    of the group-normalised step rewards (DeepSeekMath), w_p the process function's reward weight."""
    G = rollout.group_size
    lengths = [len(c) for c in rollout.completion_ids]
    others = [k for k in range(per_func.shape[1]) if k != column]
    if others:
        outcome = combine_rewards(per_func[:, others], weights[others], G, mode="sum")
        adv_out = estimate(outcome, rollout, algo, gather, loss_lengths)  # [N]
    else:
        adv_out = torch.zeros(len(lengths))
    step_rewards = [torch.tensor(s[0] if s else [], dtype=torch.float64) for s in steps]
    per_step = process_advantages(step_rewards, G, std=algo.std, eps=algo.adv_eps)  # N tensors [K_i]
    weight = float(weights[column])
    out = []
    for i, (s, steps_adv) in enumerate(zip(steps, per_step, strict=True)):
        if s is None or lengths[i] == 0:
            tok = torch.zeros(lengths[i], dtype=torch.float64)
        else:
            ends = torch.tensor(s[1], dtype=torch.long)
            tok = process_advantages_to_tokens([steps_adv], [ends], lengths[i])[0]
        out.append((float(adv_out[i]) + weight * tok).to(torch.float32))
    row_mean = torch.tensor([float(t.mean()) if t.numel() else 0.0 for t in out])
    return row_mean, out


def advantage_batch(
    per_func: torch.Tensor,
    reward: torch.Tensor,
    signal: torch.Tensor,
    rollout: RolloutBatch,
    algo: Any,
    weights: torch.Tensor,
    *,
    steps: StepSpans | None = None,
    process_column: int | None = None,
    gather: GatherRows = own_rows,
    lengths: torch.Tensor | None = None,
) -> Advantaged:
    """Returns the batch's advantages (per token with a process reward's `steps`) and its loss filters;
    `signal` is the reward whose all-equal groups count as zero-std (Drawer.signal); `lengths`: every
    process's loss lengths when already gathered (float64)."""
    token_adv = None
    if steps is not None:
        assert process_column is not None
        adv, token_adv = token_advantages(
            per_func, steps, rollout, algo, weights, process_column, gather, lengths
        )
    else:
        adv = outcome_advantages(per_func, reward, rollout, algo, weights, gather, lengths)  # [N]
    in_loss = torch.ones_like(adv, dtype=torch.bool)
    zero_std = zero_std_group_mask(signal, rollout.group_size)  # [N]
    if algo.filter_zero_std:
        in_loss &= ~zero_std
    if algo.mask_truncated:
        in_loss &= ~rollout.truncated.cpu()
    return Advantaged(adv, in_loss, zero_std, token_adv)
