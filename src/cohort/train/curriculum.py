"""Curriculum by pass rate: prompts that every or no completion solves are set aside, then retried.

A group whose completions all pass, or all fail, has advantage 0 under GRPO: it costs a full rollout
and teaches nothing (seed 002; R1's pass-rate filter removes such prompts before training). The
curriculum keeps, for each training prompt, how many of its completions passed since it was last
judged. Once a prompt has been sampled ``min_samplings`` times and its pass rate is exactly 0 or 1, it
is set aside for ``retry_after`` steps; then it returns to the pool with its counts cleared and is
judged afresh (a prompt the policy could not solve may have become solvable, and a solved one may have
been forgotten). A completion passes when the first reward function (the one evaluation uses) scores it
at least ``pass_threshold``.

The state is a few integers per prompt; it goes into checkpoints, so a resumed run skips the same
prompts as the uninterrupted one.
"""

from __future__ import annotations

from typing import Any

import torch

SOLVED, UNSOLVED = 1, 2
"""Why a prompt is set aside (0 = in the pool)."""


class Curriculum:
    """Per-prompt pass counts and the set-aside schedule of a run's training prompts."""

    def __init__(self, n: int, *, pass_threshold: float = 1.0, min_samplings: int = 1, retry_after: int = 50):
        self.n = n
        self.pass_threshold, self.min_samplings, self.retry_after = pass_threshold, min_samplings, retry_after
        self.samplings = torch.zeros(n, dtype=torch.long)
        self.passes = torch.zeros(n, dtype=torch.long)
        self.trials = torch.zeros(n, dtype=torch.long)
        self.aside_until = torch.zeros(n, dtype=torch.long)  # the step from which the prompt is back
        self.reason = torch.zeros(n, dtype=torch.long)  # SOLVED, UNSOLVED or 0

    def active(self, index: int, step: int) -> bool:
        """Returns True when prompt `index` may be sampled at step `step` (returning prompts are reset)."""
        if self.reason[index] == 0:
            return True
        if step < int(self.aside_until[index]):
            return False
        self.reason[index] = 0
        self.samplings[index] = self.passes[index] = self.trials[index] = 0
        return True

    def record(self, indices: list[int], scores: torch.Tensor, step: int) -> None:
        """Adds one sampling of each prompt in `indices` (scores [len(indices), G] of the first reward function,
        NaN for None) and sets aside the prompts whose pass rate is now exactly 0 or 1."""
        scores = scores.detach().float().cpu()
        valid = ~torch.isnan(scores)
        passed = (scores >= self.pass_threshold) & valid
        for row, i in enumerate(indices):
            self.samplings[i] += 1
            self.trials[i] += int(valid[row].sum())
            self.passes[i] += int(passed[row].sum())
            if self.samplings[i] < self.min_samplings or self.trials[i] == 0:
                continue
            if self.passes[i] == 0 or self.passes[i] == self.trials[i]:
                self.reason[i] = SOLVED if self.passes[i] else UNSOLVED
                self.aside_until[i] = step + self.retry_after

    def metrics(self, step: int) -> dict[str, float]:
        """Returns the curriculum's per-step metrics: prompts in the pool and set aside (solved / unsolved)."""
        aside = (self.reason != 0) & (self.aside_until > step)
        judged = self.trials > 0
        rate = (
            (self.passes[judged].float() / self.trials[judged].float()).mean()
            if judged.any()
            else torch.tensor(0.0)
        )
        return {
            "curriculum/active": float(self.n - int(aside.sum())),
            "curriculum/aside_solved": float(int((aside & (self.reason == SOLVED)).sum())),
            "curriculum/aside_unsolved": float(int((aside & (self.reason == UNSOLVED)).sum())),
            "curriculum/mean_pass_rate": float(rate),
        }

    def state_dict(self) -> dict[str, Any]:
        """Returns the counts and schedule to save in a checkpoint."""
        return {
            k: getattr(self, k).clone() for k in ("samplings", "passes", "trials", "aside_until", "reason")
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores a :meth:`state_dict` (ValueError when it was saved for a different number of prompts)."""
        if int(state["reason"].numel()) != self.n:
            raise ValueError(
                f"the checkpoint's curriculum tracks {int(state['reason'].numel())} prompts, this run has {self.n}: "
                "the training data changed"
            )
        for k, v in state.items():
            getattr(self, k).copy_(v)
