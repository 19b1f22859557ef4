"""Rewards of a rollout: completions decoded, every reward function called, a process reward's steps resolved."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from cohort.algo import combine_rewards
from cohort.data import as_completions, is_conversational
from cohort.errors import TrainingError
from cohort.rewards import RewardLogs, StepRewards, score
from cohort.rewards.process_rewards import resolve_step_ends
from cohort.rollout import RolloutBatch

StepSpans = list[tuple[list[float], list[int]] | None]
"""Per completion the process reward function's (step rewards, step end token indices); None where it gave none."""


def as_text(x: Any) -> str:
    """Returns a prompt or completion as one string (a conversation as `role: content` lines)."""
    if is_conversational(x):
        return "\n".join(f"{m.get('role', '')}: {m.get('content', '')}" for m in x)
    return str(x)


class Scorer:
    """Calls the run's reward functions on rollouts, in TRL's calling convention."""

    def __init__(
        self,
        reward_funcs: list[Any],
        reward_names: list[str],
        reward_weights: torch.Tensor,
        tokenizer: Any,
        *,
        prompt_column: str,
        step_separator: str,
        loss_type: str,
        sequence_advantages: bool,
    ):
        self.funcs, self.names, self.weights = reward_funcs, reward_names, reward_weights
        self.tokenizer, self.prompt_column, self.step_separator = tokenizer, prompt_column, step_separator
        self.loss_type, self.sequence_advantages = loss_type, sequence_advantages
        self.process_column: int | None = None
        """The reward function that returns step rewards, once one has."""

    def decode(self, rollout: RolloutBatch, rows: list[dict]) -> list[Any]:
        """Returns the completions as the reward functions see them (messages for a conversational dataset; an
        episode's messages after its prompt, tool calls and results included, for a multi-turn rollout)."""
        if rollout.episodes is not None:
            return [record.messages for record in rollout.episodes]
        texts = self.tokenizer.batch_decode(rollout.completion_ids, skip_special_tokens=True)
        return as_completions(texts, rows[0][self.prompt_column])

    def prefetcher(self, rows: list[dict], G: int) -> Callable[[int, list[int]], None] | None:
        """Returns the hook that hands each completion of `rows` finishing during generation to the reward
        functions that can start on it early (a `prefetch(completion, row)` attribute, as the code reward's);
        None when no function can, so generation pays nothing."""
        early = [f for f in self.funcs if callable(getattr(f, "prefetch", None))]
        if not early:
            return None
        prompt = rows[0][self.prompt_column]

        def finished(row: int, completion_ids: list[int]) -> None:
            text = self.tokenizer.decode(completion_ids, skip_special_tokens=True)
            (completion,) = as_completions([text], prompt)  # as `decode` gives it to the reward
            for f in early:
                f.prefetch(completion, rows[row // G])

        return finished

    def inputs(self, rows: list[dict], G: int) -> tuple[list[Any], dict[str, list[Any]]]:
        """Returns (prompts, other columns) for reward functions, each repeated once per completion of a group."""
        pc = self.prompt_column
        columns = {k: [r[k] for r in rows for _ in range(G)] for k in rows[0] if k != pc}
        return [r[pc] for r in rows for _ in range(G)], columns

    def combine(self, per_func: torch.Tensor, G: int) -> torch.Tensor:
        """Returns the weighted sum of the functions' scores [N] (NaN-aware, as TRL)."""
        return combine_rewards(per_func, self.weights, G, mode="sum")

    def score(
        self,
        rows: list[dict],
        rollout: RolloutBatch,
        completions: list[Any],
        trainer_state: Any = None,
        *,
        steps_only_mean: bool = False,
    ) -> tuple[torch.Tensor, RewardLogs, StepSpans | None]:
        """Returns (scores [N, R], what the functions logged, a process reward's step spans or None);
        `steps_only_mean`: a process reward's column is its mean step reward and no spans are resolved
        (held-out scoring)."""
        prompts, columns = self.inputs(rows, rollout.group_size)
        live: dict[str, list[Any]] = {}
        if rollout.episodes is not None:  # each rollout's own conversation and environment
            prompts = [record.prompt for record in rollout.episodes]
            live = {"episodes": list(rollout.episodes)}
            if any(
                record.environment is not None for record in rollout.episodes
            ):  # TRL passes it with a factory
                live["environments"] = [record.environment for record in rollout.episodes]
        logs = RewardLogs()  # log_metric → this step's metrics, log_extra → its samples
        steps: dict[int, list[StepRewards | None]] = {}  # filled by a function that returns step rewards
        scores = score(
            self.funcs,
            prompts=prompts,
            completions=completions,
            completion_ids=rollout.completion_ids,
            columns=columns,
            trainer_state=trainer_state,
            logs=logs,
            steps=steps,
            live=live,
        )  # [N, R]
        if not steps or steps_only_mean:
            return scores, logs, None
        if len(steps) > 1:
            names = [self.names[j] for j in steps]
            raise TrainingError(
                f"reward functions {names} all returned step rewards; one process reward per run is supported "
                "(combine them into one function)"
            )
        ((j, parsed),) = steps.items()
        if self.sequence_advantages:
            raise TrainingError(
                f"reward function {self.names[j]!r} returned step rewards, which give per-token advantages, "
                f"but algo.loss_type={self.loss_type!r} needs one advantage per completion; use another "
                "loss type (e.g. grpo) or return one number per completion"
            )
        resolved = resolve_step_ends(
            parsed,
            rollout.completion_ids,
            lambda ids: [self.tokenizer.decode([t]) for t in ids],
            self.step_separator,
            self.names[j],
        )
        self.process_column = j
        return scores, logs, resolved
