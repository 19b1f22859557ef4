"""Group-relative advantages: GRPO's z-score, Dr. GRPO's mean-only variant, GDPO's multi-reward
normalisation and DeepSeekMath's process supervision.

N completions are stored group-contiguous: prompt j's G completions are rows j*G ... j*G+G-1.

Where cohort departs from the papers (each one is a named option, see docs/algorithms.md):
- `std="sample"` (the unbiased estimator, as TRL) is the default; the DeepSeekMath paper and the seeds'
  worked examples divide by the population std (`std="population"`).
- `eps` is *added* to the std (as TRL, default 1e-4) rather than clamping the std; a group whose rewards
  are all equal gets advantage exactly 0 whatever `eps` is, instead of relying on 0 / eps.
- NaN rewards mean "no reward function applied to this row": such rows get advantage 0 and are left out of
  the group (and batch) statistics instead of poisoning them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch

from ._checks import as_float, check_choice, check_group_size, check_nonneg
from .options import COMBINE_MODES, SCALES, STD_KINDS


def _masked_stats(
    values: torch.Tensor, valid: torch.Tensor, std: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return (mean [B], std [B], constant [B]) of each row of `values` [B, M] over its `valid` entries."""
    count = valid.sum(-1)  # [B]
    mean = torch.where(valid, values, 0).sum(-1) / count.clamp(min=1)  # [B]
    dev = torch.where(valid, values - mean[:, None], 0)  # [B, M]
    dof = count - 1 if std == "sample" else count
    sd = ((dev * dev).sum(-1) / dof.clamp(min=1)).sqrt()  # [B]
    # Exact equality instead of sd == 0: the mean of equal floats need not round back to the value, so
    # centring alone can leave ~1e-17 residues that eps-division would turn into a spurious signal.
    hi = torch.where(valid, values, float("-inf")).amax(-1)  # [B]
    lo = torch.where(valid, values, float("inf")).amin(-1)  # [B]
    constant = (hi == lo) | (count <= 1)  # [B]
    return mean, sd, constant


def group_advantages(
    rewards: torch.Tensor,
    group_size: int,
    *,
    scale: str = "group",
    std: str = "sample",
    eps: float = 1e-4,
) -> torch.Tensor:
    """Return the group-relative advantage of each completion, [N], from its scalar reward [N].

    A_i = (r_i - mean_g) / (std + eps), where mean_g is the mean of row i's group and std is
      - scale="group": the std of row i's group (GRPO, DeepSeekMath),
      - scale="batch": the std of all N rewards (group mean, batch std: "Tricks or Traps", Lite PPO),
      - scale="none":  no division at all, A_i = r_i - mean_g (Dr. GRPO).
    std="sample" divides the sum of squares by (n - 1) (TRL), "population" by n (DeepSeekMath paper).
    Groups whose rewards are all equal get exactly 0; NaN rewards get 0 and are left out of the statistics.
    """
    r = as_float("rewards", rewards)
    out_dtype, r = r.dtype, _wide(r)
    if r.dim() != 1:
        raise ValueError(
            f"rewards must be 1-D [N] (one scalar per completion), got shape {tuple(r.shape)}. "
            "Fix: combine several reward functions first with combine_rewards(rewards[N, R], ...)."
        )
    n = r.shape[0]
    g = check_group_size(n, group_size)
    check_choice("scale", scale, SCALES)
    check_choice("std", std, STD_KINDS)
    eps = check_nonneg("eps", eps)

    grouped = r.view(n // g, g)  # [B, G]
    valid = ~torch.isnan(grouped)  # [B, G]
    mean, sd, constant = _masked_stats(grouped, valid, std)  # [B] each
    centred = grouped - mean[:, None]  # [B, G]
    if scale == "group":
        adv = centred / (sd[:, None] + eps)  # [B, G]
    elif scale == "batch":
        _, batch_sd, _ = _masked_stats(r.view(1, n), valid.view(1, n), std)  # [1]
        adv = centred / (batch_sd + eps)  # [B, G]
    else:
        adv = centred  # [B, G]
    adv = torch.where(valid & ~constant[:, None], adv, 0)  # [B, G]
    return adv.reshape(n).to(out_dtype)  # [N]


def _wide(r: torch.Tensor) -> torch.Tensor:
    """Returns `r` in float64 where the device has it: squared deviations of float32 rewards above ~1e19
    overflow to inf in float32, which would zero every advantage without a word."""
    return r if r.device.type == "mps" else r.to(torch.float64)


def _reward_matrix(rewards: object) -> torch.Tensor:
    """Return rewards as a float tensor [N, R], turning None entries of nested lists into NaN."""
    if isinstance(rewards, torch.Tensor):
        return as_float("rewards", rewards)
    nested = cast("Sequence[Sequence[float | None]]", rewards)
    rows = [[float("nan") if v is None else v for v in row] for row in nested]
    return torch.tensor(rows, dtype=torch.get_default_dtype())


def combine_rewards(
    rewards: torch.Tensor,
    weights: Sequence[float] | torch.Tensor | None,
    group_size: int,
    *,
    mode: str = "sum",
    std: str = "sample",
    eps: float = 1e-4,
) -> torch.Tensor:
    """Return one value per completion, [N], from R reward columns [N, R] (NaN/None = not applicable).

    mode="sum": the weighted sum sum_k w_k r_ik over the columns that apply to row i (TRL); a row to which
      no reward applies stays NaN, so group_advantages leaves it out. Pass the result to group_advantages.
    mode="decoupled" (GDPO): each column is normalised inside its group first (as group_advantages with
      scale="group"), the normalised columns are summed with the weights, and the sum is normalised over
      the batch: A_i = (s_i - mean(s)) / (std(s) + eps). The result is already the advantage; rows with no
      applicable reward get 0 and are left out of the batch statistics.
    `weights` None means 1 for every column; `group_size` is only used by mode="decoupled" but always checked.
    """
    check_choice("mode", mode, COMBINE_MODES)
    check_choice("std", std, STD_KINDS)
    eps = check_nonneg("eps", eps)
    r = _reward_matrix(rewards)
    out_dtype, r = r.dtype, _wide(r)
    if r.dim() == 1:
        r = r[:, None]
    if r.dim() != 2:
        raise ValueError(
            f"rewards must be [N, R] (N completions, R reward functions), got shape {tuple(r.shape)}. "
            "Fix: stack one column per reward function."
        )
    n, n_funcs = r.shape
    g = check_group_size(n, group_size)
    if weights is None:
        w = torch.ones(n_funcs, dtype=r.dtype, device=r.device)  # [R]
    else:
        w = torch.as_tensor(weights, dtype=r.dtype, device=r.device).reshape(-1)  # [R]
        if w.shape[0] != n_funcs:
            raise ValueError(
                f"got {w.shape[0]} reward weights for {n_funcs} reward columns; they must match one to one. "
                f"Fix: pass {n_funcs} weights (or weights=None for all 1.0)."
            )
    valid = ~torch.isnan(r)  # [N, R]
    any_valid = valid.any(-1)  # [N]

    if mode == "sum":
        total = torch.where(valid, r * w, 0).sum(-1)  # [N]
        return torch.where(any_valid, total, float("nan")).to(out_dtype)  # [N]

    # Decoupled: one z-score per (group, reward column), computed for all columns at once.
    b = n // g
    cols = r.view(b, g, n_funcs).permute(0, 2, 1).reshape(b * n_funcs, g)  # [B*R, G]
    cols_valid = valid.view(b, g, n_funcs).permute(0, 2, 1).reshape(b * n_funcs, g)  # [B*R, G]
    mean, sd, constant = _masked_stats(cols, cols_valid, std)  # [B*R] each
    z = (cols - mean[:, None]) / (sd[:, None] + eps)  # [B*R, G]
    z = torch.where(cols_valid & ~constant[:, None], z, 0)  # [B*R, G]
    z = z.view(b, n_funcs, g).permute(0, 2, 1).reshape(n, n_funcs)  # [N, R]
    summed = (z * w).sum(-1)  # [N]
    bmean, bsd, bconst = _masked_stats(summed.view(1, n), any_valid.view(1, n), std)  # [1] each
    adv = (summed - bmean) / (bsd + eps)  # [N]
    # A group in which every column is constant has no signal: exactly 0, not the batch centring's residue.
    informative = (~constant).view(b, n_funcs).any(-1).repeat_interleave(g)  # [N]
    return torch.where(any_valid & ~bconst & informative, adv, 0).to(out_dtype)  # [N]


def process_advantages(
    step_rewards: Sequence[torch.Tensor | Sequence[float]],
    group_size: int,
    *,
    std: str = "sample",
    eps: float = 1e-4,
) -> list[torch.Tensor]:
    """Return each completion's per-step advantages, a list of N tensors [K_i], for process supervision.

    DeepSeekMath section 4.1.3: the step rewards of all G completions of a group are normalised together,
    r~ = (r - mean(R)) / (std(R) + eps) with R every step reward of the group, and the advantage of step j
    is the return-to-go A_j = sum_{j' >= j} r~_j' over the same completion. A group whose step rewards are
    all equal gets 0; NaN step rewards are left out of the statistics and count as 0 in the sums.
    """
    check_choice("std", std, STD_KINDS)
    eps = check_nonneg("eps", eps)
    rows = [as_float(f"step_rewards[{i}]", s) for i, s in enumerate(step_rewards)]
    for i, s in enumerate(rows):
        if s.dim() != 1:
            raise ValueError(
                f"step_rewards[{i}] must be 1-D [K_i] (one reward per step), got shape {tuple(s.shape)}."
            )
    n = len(rows)
    g = check_group_size(n, group_size, what="step_rewards")
    if n == 0:
        return []
    dtype, device = rows[0].dtype, rows[0].device
    rows = [s.to(dtype=dtype, device=device) for s in rows]
    lengths = [s.shape[0] for s in rows]
    k_max = max(lengths)
    if k_max == 0:
        return [s.clone() for s in rows]

    padded = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)  # [N, K]
    in_range = torch.arange(k_max, device=device) < torch.tensor(lengths, device=device)[:, None]  # [N, K]
    valid = in_range & ~torch.isnan(padded)  # [N, K]
    b = n // g
    flat = padded.view(b, g * k_max)  # [B, G*K]
    flat_valid = valid.view(b, g * k_max)  # [B, G*K]
    mean, sd, constant = _masked_stats(flat, flat_valid, std)  # [B] each
    norm = (flat - mean[:, None]) / (sd[:, None] + eps)  # [B, G*K]
    norm = torch.where(flat_valid & ~constant[:, None], norm, 0).view(n, k_max)  # [N, K]
    # Padding sits after each row's last step and is 0, so a right-to-left cumsum is the return-to-go.
    to_go = norm.flip(-1).cumsum(-1).flip(-1)  # [N, K]
    return list(to_go[in_range].split(lengths))


def process_advantages_to_tokens(
    step_advantages: Sequence[torch.Tensor],
    step_end_index: Sequence[torch.Tensor],
    length: int,
) -> torch.Tensor:
    """Return per-token advantages [N, T=length] from per-step advantages and each step's last token index.

    Step j of completion i covers the tokens after step j-1's last token up to and including
    step_end_index[i][j] (0-based positions within the completion); every token of a step gets that
    step's advantage, which with process_advantages' return-to-go is DeepSeekMath's
    A_t = sum over steps ending at or after t. Tokens after the last step get 0.
    Indices must be strictly increasing and lie in [0, length); this check reads them once (one sync).
    """
    if isinstance(length, bool) or not isinstance(length, int) or length < 0:
        raise ValueError(f"length must be a non-negative int (T, the padded token length), got {length!r}.")
    n = len(step_advantages)
    if len(step_end_index) != n:
        raise ValueError(
            f"got {n} step_advantages rows but {len(step_end_index)} step_end_index rows; "
            "they must match one to one (one entry per completion)."
        )
    if n == 0:
        return torch.zeros(0, length)
    advs, ends = [], []
    for i, (a, e) in enumerate(zip(step_advantages, step_end_index)):
        a = as_float(f"step_advantages[{i}]", a)
        e = torch.as_tensor(e, device=a.device)
        if a.dim() != 1 or e.dim() != 1 or a.shape[0] != e.shape[0]:
            raise ValueError(
                f"completion {i}: step_advantages has shape {tuple(a.shape)} and step_end_index has shape "
                f"{tuple(e.shape)}; both must be 1-D [K_i] with one entry per step."
            )
        if e.is_floating_point() or e.dtype == torch.bool:
            raise TypeError(f"step_end_index[{i}] must hold integer token indices, got dtype {e.dtype}.")
        advs.append(a)
        ends.append(e.long())
    dtype, device = advs[0].dtype, advs[0].device
    k_max = max(a.shape[0] for a in advs)
    if k_max == 0 or length == 0:
        return torch.zeros(n, length, dtype=dtype, device=device)

    all_ends = torch.cat(ends)  # [sum K_i]
    steps_increase = all(e.shape[0] < 2 or bool((e[1:] > e[:-1]).all()) for e in ends)
    if not steps_increase or bool((all_ends < 0).any()) or bool((all_ends >= length).any()):
        raise ValueError(
            f"step_end_index must be strictly increasing within each completion and lie in [0, {length}); "
            f"got {[e.tolist() for e in ends]}. Fix: pass the 0-based index of each step's last token."
        )
    # Padded ends equal `length`, beyond every real token position, so searchsorted maps the tokens after
    # the last step to the padded slot K_i, whose advantage is the appended 0.
    ends_pad = torch.nn.utils.rnn.pad_sequence(ends, batch_first=True, padding_value=length)  # [N, K]
    ends_pad = ends_pad.to(device).contiguous()
    adv_pad = torch.zeros(n, k_max + 1, dtype=dtype, device=device)  # [N, K+1]
    adv_pad[:, :k_max] = torch.nn.utils.rnn.pad_sequence([a.to(device) for a in advs], batch_first=True)
    positions = torch.arange(length, device=device).expand(n, length).contiguous()  # [N, T]
    step_of_token = torch.searchsorted(ends_pad, positions)  # [N, T], first j with end_j >= t
    return adv_pad.gather(1, step_of_token)  # [N, T]


def _scalar_rewards(rewards: object, group_size: int) -> tuple[torch.Tensor, torch.dtype, int, int]:
    """Returns (rewards [N] widened to float64, their dtype, N, G) after checking one reward per completion."""
    r = as_float("rewards", rewards)
    out_dtype, r = r.dtype, _wide(r)
    if r.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N] (one scalar per completion), got shape {tuple(r.shape)}.")
    return r, out_dtype, r.shape[0], check_group_size(r.shape[0], group_size)


def rloo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Return RLOO's advantages [N]: each reward minus the mean of the other rewards of its group.

    REINFORCE leave-one-out (Kool et al. 2019; Ahmadian et al. 2024, arXiv 2402.14740):
    A_i = r_i - sum_{j != i} r_j / (G - 1) = G / (G - 1) * (r_i - mean_g). NaN rewards get 0 and are left out
    of the others' means; a row with no valid other in its group gets 0. No scaling by a std.
    """
    r, out_dtype, n, g = _scalar_rewards(rewards, group_size)
    grouped = r.view(n // g, g)  # [B, G]
    valid = ~torch.isnan(grouped)  # [B, G]
    values = torch.where(valid, grouped, 0)  # [B, G]
    total, count = values.sum(-1, keepdim=True), valid.sum(-1, keepdim=True)  # [B, 1]
    others = count - valid.to(count.dtype)  # [B, G], valid others of each row
    baseline = (total - values) / others.clamp(min=1)  # [B, G]
    adv = torch.where(valid & (others > 0), grouped - baseline, 0)  # [B, G]
    return adv.reshape(n).to(out_dtype)


def reinforce_pp_advantages(
    rewards: torch.Tensor,
    group_size: int,
    *,
    baseline: bool = True,
    std: str = "sample",
    eps: float = 1e-4,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Return REINFORCE++'s advantages [N]: rewards whitened over the whole batch.

    REINFORCE++ (Hu 2025, arXiv 2501.03262): A = (r - mean_batch(r)) / (std_batch(r) + eps). With
    baseline=True (REINFORCE++-baseline) each group's mean is subtracted first, a_i = r_i - mean_g, and then
    a is whitened over the batch the same way. `weights` [N] (e.g. token counts: a whitening over the batch's
    tokens, as OpenRLHF does) weigh the batch mean and std (std="sample" uses the frequency-weighted
    unbiased form, dividing by sum(w) - 1); None weighs every completion once. NaN rewards get 0 and are left
    out; a batch whose values are all equal gives exactly 0.
    """
    check_choice("std", std, STD_KINDS)
    eps = check_nonneg("eps", eps)
    r, out_dtype, n, g = _scalar_rewards(rewards, group_size)
    valid = ~torch.isnan(r)  # [N]
    if weights is None:
        w = torch.ones_like(r)
    else:
        w = as_float("weights", weights).to(r)
        if w.shape != r.shape:
            raise ValueError(f"weights has shape {tuple(w.shape)}; it must be [N]={n}, one per completion.")
        if bool((w < 0).any()):
            raise ValueError("weights must be >= 0 (token counts or importance of each completion).")
    w = torch.where(valid, w, 0)  # [N]
    values = r
    if baseline:
        grouped = r.view(n // g, g)
        gvalid = valid.view(n // g, g)
        gmean = torch.where(gvalid, grouped, 0).sum(-1, keepdim=True) / gvalid.sum(-1, keepdim=True).clamp(
            min=1
        )
        values = (grouped - gmean).reshape(n)  # [N]
    values = torch.where(valid, values, 0)
    total = w.sum()
    mean = (w * values).sum() / total.clamp(min=torch.finfo(r.dtype).tiny)
    dev = torch.where(valid, values - mean, 0)
    dof = total - 1 if std == "sample" else total
    sd = ((w * dev * dev).sum() / dof.clamp(min=1)).sqrt()
    hi = torch.where(valid & (w > 0), values, float("-inf")).max()
    lo = torch.where(valid & (w > 0), values, float("inf")).min()
    constant = bool(hi == lo) or int((valid & (w > 0)).sum()) <= 1
    adv = torch.zeros_like(values) if constant else torch.where(valid, dev / (sd + eps), 0)
    return adv.to(out_dtype)


def max_rl_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Return MaxRL's advantages [N]: (r - mean_g) / mean_g, 0 in a group whose mean reward is <= 0.

    MaxRL (arXiv 2602.02710; prime-rl's max_rl): dividing by the group's mean reward (its pass rate for 0/1
    rewards) weighs a prompt by about 1 / p, so hard prompts that are sometimes solved count most. No eps: a
    group whose mean is <= 0 has nothing to learn from and gets 0; a group whose rewards are all equal gets
    exactly 0; NaN rewards get 0 and are left out of the mean.
    """
    r, out_dtype, n, g = _scalar_rewards(rewards, group_size)
    grouped = r.view(n // g, g)  # [B, G]
    valid = ~torch.isnan(grouped)  # [B, G]
    mean, _, constant = _masked_stats(grouped, valid, "population")  # [B] each
    usable = (mean > 0) & ~constant  # [B]
    adv = (grouped - mean[:, None]) / torch.where(usable, mean, 1)[:, None]  # [B, G]
    adv = torch.where(valid & usable[:, None], adv, 0)  # [B, G]
    return adv.reshape(n).to(out_dtype)


def optimal_token_baseline(
    rewards: torch.Tensor,
    group_size: int,
    *,
    old_logp: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    mask: torch.Tensor,
    is_weights: torch.Tensor | None = None,
    handle_zero_tail: bool = True,
    eps: float = 1e-8,
) -> torch.Tensor:
    """Return the Optimal Token Baseline's per-token advantages [N, T] for outcome rewards [N].

    OTB (arXiv 2602.07078; verl's optimal_token_baseline): with the outcome reward on the last token, the
    reward-to-go is G_it = r_i on every completion token. Each token's variance proxy is
    w_it = 1 - 2 pi_old(y_it) + sum_v pi_old(v)^2 (times the sampler weight squared when is_weights [N, T] is
    given), W_it = sum_{j <= t} mask * w_ij, and each group's baseline per position t is
    B_t = sum_i G_it W_it m_it / (sum_i W_it m_it + eps); A_it = (G_it - B_t) m_it. handle_zero_tail: when
    one completion is strictly the longest of its group, its baseline past the second-longest length is 0
    (no other completion estimates it). old_logp, sum_pi_squared, mask: [N, T] (sum_pi_squared at the
    sampling temperature). NaN rewards get 0 and are left out of their group's baseline. Groups are the
    contiguous rows of `group_size`.
    """
    r, _, n, g = _scalar_rewards(rewards, group_size)
    for name, v in (("old_logp", old_logp), ("sum_pi_squared", sum_pi_squared), ("mask", mask)):
        if not isinstance(v, torch.Tensor) or v.dim() != 2 or v.shape[0] != n:
            got = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
            raise ValueError(
                f"{name} must be a tensor [N={n}, T] (one value per completion token), got {got}."
            )
    shape = mask.shape
    for name, v in (("old_logp", old_logp), ("sum_pi_squared", sum_pi_squared)):
        if v.shape != shape:
            raise ValueError(f"{name} has shape {tuple(v.shape)}; it must match mask {tuple(shape)}.")
    if is_weights is not None and (not isinstance(is_weights, torch.Tensor) or is_weights.shape != shape):
        raise ValueError(f"is_weights must be None or a tensor of mask's shape {tuple(shape)}.")
    eps = check_nonneg("eps", eps)
    wide = r.dtype  # float64 where the device has it
    out_dtype = old_logp.dtype if old_logp.is_floating_point() else torch.get_default_dtype()
    valid_row = ~torch.isnan(r)  # [N]
    m = mask.bool() & valid_row[:, None]  # [N, T]
    w = 1 - 2 * torch.exp(old_logp.detach().to(wide)) + sum_pi_squared.detach().to(wide)  # [N, T]
    if is_weights is not None:
        w = w * is_weights.detach().to(wide).square()
    big_w = torch.where(m, w, 0).cumsum(-1)  # [N, T]
    ret = torch.where(m, torch.nan_to_num(r, nan=0.0)[:, None], 0)  # [N, T], the reward-to-go
    t = shape[1]
    b = n // g
    mw = torch.where(m, big_w, 0).view(b, g, t)  # [B, G, T]
    num = (ret.view(b, g, t) * mw).sum(1)  # [B, T]
    den = mw.sum(1) + eps  # [B, T]
    baseline = (num / den)[:, None, :].expand(b, g, t).clone()  # [B, G, T]
    if g == 1:
        baseline.zero_()  # a lone completion has no baseline: its advantage is its return
    elif handle_zero_tail:
        lengths = m.sum(-1).view(b, g)  # [B, G]
        top2 = lengths.topk(2, dim=-1).values  # [B, 2], longest and second-longest
        unique_longest = (lengths == top2[:, :1]).sum(-1) == 1  # [B]
        past = torch.arange(t, device=mask.device)[None, None, :] >= top2[:, 1, None, None]  # [B, 1, T]
        longest = (lengths == top2[:, :1]) & unique_longest[:, None]  # [B, G]
        baseline = torch.where(longest[:, :, None] & past, 0, baseline)
    adv = torch.where(m, ret - baseline.reshape(n, t), 0)  # [N, T]
    return adv.to(out_dtype)
