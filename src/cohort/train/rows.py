"""A step's rows over every process, gathered once: what the advantages, the update's placement of this
process's groups in the global batch and the step's metrics read, with the per-process numbers the metrics
add up (tokens, the collapse share, dynamic sampling's counts). One all-gather where these were nine
collectives; one process gathers nothing (docs/architecture.md, "Collectives")."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cohort.runtime import distributed as dist
from cohort.train.draw import Drawn
from cohort.train.metrics import metric_columns, rollout_tokens

MOST = ("sampling/rounds", "serve/staleness")
"""Drawn.metrics taken as the largest over the processes (the most rounds any took); the others are summed."""


@dataclass
class StepRows:
    """Every process's metric columns (`metric_columns`) and per-process numbers of one step."""

    columns: torch.Tensor | None
    """[N_all, R + 4] float64 over every process in rank order; None on one process (nothing gathered)."""
    start: int
    """Index of this process's first row."""
    groups: list[int]
    """Each process's number of groups, in rank order."""
    tokens: int
    """Tokens of the step's rollouts over every process (`rollout_tokens`)."""
    collapse: float | None
    """Share of the first round's groups collapsed onto one sub-par answer, over every process (None: off)."""
    drawn_metrics: dict[str, float]
    """Drawn.metrics over every process."""
    reward: torch.Tensor | None = None
    per_func: torch.Tensor | None = None

    def gather(self, t: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Returns (every process's rows of `t`, this process's first row): from the gathered columns when `t` is
        the step's reward or rewards per function (no collective), else by `distributed.all_gather_rows`."""
        if self.columns is not None and t is self.reward:
            return self.columns[:, 0].to(t.device, t.dtype), self.start
        if self.columns is not None and t is self.per_func:
            return self.columns[:, 1 : 1 + t.shape[1]].to(t.device, t.dtype), self.start
        return dist.all_gather_rows(t)

    @property
    def lengths(self) -> torch.Tensor | None:
        """Returns every process's loss lengths, float64 [N_all] (None on one process)."""
        return None if self.columns is None else self.columns[:, -3]


def gather_rows(
    drawn: Drawn, zero_std: torch.Tensor | None, collapse: float | None, first_groups: int, capacity: int
) -> StepRows:
    """Returns the step's rows over every process in one all-gather (none on one process); `collapse` is this
    process's share of its `first_groups` first-round groups (None when that check is off), `capacity` the
    rows every process expects at most (the same on every process: a process with more costs a second
    all-gather)."""
    rollout = drawn.rollout
    groups, tokens, extra = len(rollout.prompt_ids), rollout_tokens(rollout), drawn.metrics()
    if not dist.is_distributed():
        return StepRows(None, 0, [groups], tokens, collapse, extra)
    assert zero_std is not None
    share = 0.0 if collapse is None else collapse * first_groups
    head = [groups, tokens, share, first_groups, *extra.values()]
    columns = metric_columns(rollout, drawn.per_func, drawn.reward, zero_std)
    parts, heads = dist.all_gather_table(columns, head, capacity)
    counts = [int(h[0]) for h in heads]
    # Added in rank order: whole numbers exactly, the collapse share's float parts with the bits an all-reduce
    # gives two processes (a + b == b + a); with more, the order may differ from the backend's in the last bit.
    total = [sum(h[k] for h in heads) for k in range(len(head))]
    merged = {
        name: float(max(int(h[4 + k]) for h in heads)) if name in MOST else total[4 + k]
        for k, name in enumerate(extra)
    }
    return StepRows(
        torch.cat(parts),
        sum(p.shape[0] for p in parts[: dist.rank()]),
        counts,
        int(total[1]),
        None if collapse is None else total[2] / max(int(total[3]), 1),
        merged,
        drawn.reward,
        drawn.per_func,
    )
