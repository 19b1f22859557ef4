"""A step's logged numbers: TRL's reward and length metrics over every process's completions, the samples
logged with them, and the headline metrics a run's summary keeps."""

from __future__ import annotations

import math
from typing import Any

import torch

from cohort.rollout import RolloutBatch
from cohort.train.accumulate import UpdateStats
from cohort.train.advantage_step import Advantaged, GatherRows, own_rows
from cohort.train.draw import Drawn
from cohort.train.scorer import as_text


def rollout_stats(
    reward: torch.Tensor,
    per_func: torch.Tensor,
    lengths: torch.Tensor,
    truncated: torch.Tensor,
    zero_std: torch.Tensor,
    G: int,
    names: list[str],
) -> dict[str, float]:
    """Returns TRL's reward and completion metrics of N completions in groups of G: reward, reward_std (mean
    in-group std), rewards/<name>/mean and std, completions/* lengths and clipped_ratio, frac_reward_zero_std."""
    lengths = lengths.float()
    # Completions that ended with EOS (TRL's convention: all three are 0 when none did).
    terminated = lengths[~truncated.to(lengths.device)]
    if terminated.numel() == 0:
        terminated = torch.zeros(1)
    m = {
        "reward": float(torch.nanmean(reward)),
        "reward_std": float(torch.nanmean(nanstd(reward.view(-1, G)))),
    }
    for j, name in enumerate(names):
        col = per_func[:, j]
        m[f"rewards/{name}/mean"] = float(torch.nanmean(col))
        m[f"rewards/{name}/std"] = float(nanstd(col.view(1, -1))[0])
    m.update(
        {
            "completions/mean_length": float(lengths.mean()),
            "completions/min_length": float(lengths.min()),
            "completions/max_length": float(lengths.max()),
            "completions/mean_terminated_length": float(terminated.mean()),
            "completions/min_terminated_length": float(terminated.min()),
            "completions/max_terminated_length": float(terminated.max()),
            "completions/clipped_ratio": float(truncated.float().mean()),
            "frac_reward_zero_std": float(zero_std.view(-1, G)[:, 0].float().mean()),
        }
    )
    return m


def step_metrics(
    step: int,
    rollout: RolloutBatch,
    per_func: torch.Tensor,
    reward: torch.Tensor,
    zero_std: torch.Tensor,
    stats: UpdateStats,
    names: list[str],
    num_tokens: int,
    gather: GatherRows = own_rows,
    columns: torch.Tensor | None = None,
) -> dict[str, Any]:
    """Returns a step's metrics row: the rollout statistics over the rows `gather` collects (every process's
    completions), the update's statistics, the tokens seen so far and the fast paths the rollout took.
    Lengths count the tokens the policy generated (a tool's output inserted into an episode is left out).
    `columns`: every process's `metric_columns`, when already gathered (then nothing is gathered here)."""
    G = rollout.group_size
    lengths = rollout.loss_lengths.float()
    truncated = rollout.truncated.cpu()
    # the step's statistics are over every process's completions
    if columns is None and gather is not own_rows:
        columns, _ = gather(metric_columns(rollout, per_func, reward, zero_std))
    if columns is not None:
        reward, per_func = columns[:, 0].float(), columns[:, 1 : 1 + per_func.shape[1]].float()
        lengths, truncated, zero_std = (columns[:, -3].float(), columns[:, -2].bool(), columns[:, -1].bool())
    m: dict[str, Any] = {"step": step}
    m.update(rollout_stats(reward, per_func, lengths, truncated, zero_std, G, names))
    m["num_tokens"] = num_tokens
    m.update(stats.metrics())
    m.update({f"fast/{k}": float(v) for k, v in rollout.paths.items()})
    return m


def metric_columns(
    rollout: RolloutBatch, per_func: torch.Tensor, reward: torch.Tensor, zero_std: torch.Tensor
) -> torch.Tensor:
    """Returns the [N, R + 4] float64 columns a step's statistics read per completion: reward, each function's
    reward, length in the loss, truncated, in a zero-std group (all exact in float64)."""
    return torch.cat(
        [reward[:, None].double(), per_func.double(), rollout.loss_lengths.float()[:, None].double(),
         rollout.truncated.cpu()[:, None].double(), zero_std[:, None].double()],
        dim=1,
    )  # fmt: skip


def rollout_tokens(rollout: RolloutBatch) -> int:
    """Returns the tokens a rollout processed, as TRL counts them: every prompt once per completion, plus the
    tokens the policy generated (not those a tool inserted into an episode)."""
    prompt_tokens = sum(len(p) for p in rollout.prompt_ids) * rollout.group_size
    return int(prompt_tokens + rollout.loss_lengths.float().sum())


def sample_rows(
    drawn: Drawn, adv: Advantaged, names: list[str], prompt_column: str, wanted: int
) -> list[dict[str, Any]]:
    """Returns the completions logged this step: whole groups (at least `wanted` completions), each completion
    with every reward function's score, the combined reward, its advantage and whether it was in the loss
    (with a process reward also the step rewards, their end tokens and every token's advantage)."""
    rows, rollout, per_func = drawn.rows, drawn.rollout, drawn.per_func
    G = rollout.group_size
    n_groups = min(len(rows), -(-wanted // G))
    if n_groups == 0:
        return []
    lengths, truncated = rollout.loss_lengths.tolist(), rollout.truncated.tolist()
    token_adv, steps = adv.token_advantages, drawn.steps
    out = []
    for g in range(0, len(rows), max(1, len(rows) // n_groups))[:n_groups]:
        prompt = as_text(rows[g][prompt_column])
        for i in range(g * G, (g + 1) * G):
            scores = {f"rewards/{n}": finite_or_none(float(per_func[i, j])) for j, n in enumerate(names)}
            out.append(
                {
                    "group": g,
                    "prompt": prompt,
                    "completion": as_text(drawn.completions[i]),
                    "reward": float(drawn.reward[i]),
                    **scores,
                    "advantage": float(adv.advantages[i]),
                    "in_loss": bool(adv.in_loss[i]),
                    "length": int(lengths[i]),
                    "truncated": bool(truncated[i]),
                    **drawn.logs.extras_at(i),  # columns from log_extra
                }
            )
            if rollout.episodes is not None:  # the episode turn by turn, tool calls and results apart
                record = rollout.episodes[i]
                out[-1]["prompt"] = as_text(record.prompt)
                out[-1]["turns"] = [episode_turn(m) for m in record.messages]
                out[-1]["stop"] = record.stop
            if token_adv is not None and steps is not None:
                span = steps[i]
                out[-1]["step_rewards"] = span[0] if span else None
                out[-1]["step_ends"] = span[1] if span else None
                out[-1]["token_advantages"] = [round(float(x), 6) for x in token_adv[i]]
    return out


def episode_turn(message: dict[str, Any]) -> dict[str, Any]:
    """Returns one message of an episode as a sample shows it: role and text, a call's name and arguments, a
    tool result's tool name."""
    turn: dict[str, Any] = {"role": message.get("role"), "content": message.get("content", "")}
    if message.get("tool_calls"):
        turn["tool_calls"] = [
            {"name": c.get("function", c).get("name"), "arguments": c.get("function", c).get("arguments")}
            for c in message["tool_calls"]
        ]
    if message.get("role") == "tool":
        turn["name"] = message.get("name")
    return turn


FINAL_METRICS = (
    "reward",
    "reward_std",
    "loss",
    "kl",
    "entropy",
    "grad_norm",
    "lr",
    "completions/mean_length",
    "completions/clipped_ratio",
    "clip_ratio/region_mean",
    "frac_reward_zero_std",
    "num_tokens",
)
"""The metrics of the last step that summary.json keeps (with each rewards/<func>/mean); metrics.jsonl has all."""


def final_metrics(row: dict[str, Any]) -> dict[str, Any]:
    """Return the headline metrics of one metrics row (those present and not None)."""
    keys = [*FINAL_METRICS, *(k for k in row if k.startswith("rewards/") and k.endswith("/mean"))]
    return {k: row[k] for k in keys if row.get(k) is not None}


def finite_or_none(x: float) -> float | None:
    """Returns x, or None for a NaN (a reward function's None) or an infinity."""
    return x if math.isfinite(x) else None


def nanstd(x: torch.Tensor) -> torch.Tensor:
    """Return the unbiased std of each row ignoring NaN (NaN where fewer than two values)."""
    valid = ~torch.isnan(x)
    cnt = valid.sum(-1)
    mean = torch.where(valid, x, 0).sum(-1) / cnt.clamp(min=1)
    var = torch.where(valid, (x - mean[:, None]) ** 2, 0).sum(-1) / (cnt - 1).clamp(min=1)
    return torch.where(cnt > 1, var.sqrt(), torch.nan)
