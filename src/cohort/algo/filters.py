"""Row filters of DAPO: dynamic sampling (drop groups with no reward variance) and overlong filtering."""

from __future__ import annotations

import torch

from ._checks import as_float, check_group_size, check_tensor


def zero_std_group_mask(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Return a bool mask [N], True on every row of a group whose (non-NaN) rewards are all equal.

    rewards: [N] one scalar per completion, or [N, R] one column per reward function, for GDPO's
    decoupled normalisation, where a group carries a signal as soon as any one column varies in it: the
    group is zero-variance only when every column is constant (a column with fewer than two non-NaN
    rewards counts as constant). These are exactly the groups that group_advantages / combine_rewards
    send to advantage 0, so with beta = 0 they carry no gradient (DAPO's dynamic sampling drops and
    resamples them). NaN rewards are ignored.
    """
    r = as_float("rewards", rewards)
    if r.dim() not in (1, 2):
        raise ValueError(
            f"rewards must be [N] (one scalar per completion) or [N, R] (one column per reward function), "
            f"got shape {tuple(r.shape)}."
        )
    n = r.shape[0]
    g = check_group_size(n, group_size)
    grouped = r.view(n // g, g, -1)  # [B, G, R]
    valid = ~torch.isnan(grouped)  # [B, G, R]
    hi = torch.where(valid, grouped, float("-inf")).amax(1)  # [B, R]
    lo = torch.where(valid, grouped, float("inf")).amin(1)  # [B, R]
    constant = (hi == lo) | (valid.sum(1) <= 1)  # [B, R]
    return constant.all(-1).repeat_interleave(g)  # [N]


def truncation_mask(truncated: torch.Tensor, completion_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Return the keep-mask of DAPO's overlong filtering: False on truncated completions.

    truncated [N] bool (hit max_completion_length without EOS). Without completion_mask the result is [N]
    (True = keep the row); with completion_mask [N, T] it is that token mask with truncated rows zeroed,
    ready to pass to policy_loss. Keep the full batch's counts as num_items / num_sequences if the
    dropped rows should still count in the normaliser.
    """
    check_tensor("truncated", truncated)
    if truncated.dim() != 1:
        raise ValueError(
            f"truncated must be 1-D [N] (one flag per completion), got shape {tuple(truncated.shape)}."
        )
    keep = ~truncated.bool()  # [N]
    if completion_mask is None:
        return keep
    check_tensor("completion_mask", completion_mask)
    if completion_mask.dim() != 2 or completion_mask.shape[0] != keep.shape[0]:
        raise ValueError(
            f"completion_mask has shape {tuple(completion_mask.shape)}; it must be [N, T] with "
            f"N={keep.shape[0]} rows to match truncated."
        )
    return completion_mask.bool() & keep[:, None]  # [N, T]
