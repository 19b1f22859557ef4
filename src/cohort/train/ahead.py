"""Batches requested ahead of their step (rollout.max_staleness = k > 0): the rollout workers generate the
next steps' batches while the trainer scores, updates and pushes.

The queue holds the requests of the steps to come. At step s, before waiting for its own batch, the trainer
sends the request of step s + k, so it is sampled with the weights after step s - 1 (a worker serves its
requests in order, after the pushes sent before them). The batch trained at step s was therefore sampled
with the weights after step s - 1 - j, 0 <= j <= k; j is logged as serve/staleness and the update weighs each
token by pi_train / pi_sampler (algo.sampler_correction: token_tis unless set otherwise).

A checkpoint holds the queued batches themselves (the save waits for them), so a resumed run trains on
exactly the batches the uninterrupted run would have: with the same workers, kill -9 then resume reproduces
the run at any staleness. An interrupted step puts back the queue it started with; the request it sent is
dropped, and sent again, the same, when the step runs again.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from cohort.rollout import RolloutBatch
from cohort.serve.client import RemoteGeneration, Ticket


@dataclass
class Queued:
    """One step's batch: its prompts, the step whose weights sampled it, and its request or its rollout."""

    step: int
    idx: list[int]
    weights_step: int
    """The batch was sampled with the weights after this many steps."""
    ticket: Ticket | None = None
    rollout: RolloutBatch | None = None


class AheadQueue:
    """The requests of the next steps' batches, sent up to `depth` steps before the step that trains them."""

    def __init__(self, remote: RemoteGeneration, depth: int, last_step: int) -> None:
        self.remote, self.depth, self.last_step = remote, depth, last_step
        self.queue: list[Queued] = []

    def take(self, step: int, request: Callable[[int], tuple[list[int], Ticket]]) -> Queued:
        """Returns step's batch, collected, after sending the requests of the steps up to step + depth
        (`request(for_step)` picks a step's prompts and sends them)."""
        while not self.queue or (self.queue[-1].step < min(step + self.depth, max(self.last_step, step))):
            for_step = self.queue[-1].step + 1 if self.queue else step
            idx, ticket = request(for_step)
            self.queue.append(Queued(for_step, idx, step - 1, ticket))
        queued = self.queue.pop(0)
        if queued.step != step:
            raise RuntimeError(f"the batch queued first is for step {queued.step}, not {step}")
        self._collect(queued)
        return queued

    def _collect(self, q: Queued) -> None:
        if q.rollout is None:
            assert q.ticket is not None
            q.rollout = self.remote.collect(q.ticket)
            q.ticket = None

    def snapshot(self) -> list[Queued]:
        """Returns the queue as it is (an interrupted step puts it back with `rewind`)."""
        return list(self.queue)

    def rewind(self, snap: list[Queued]) -> None:
        """Returns None; puts back a snapshot's queue, dropping the requests sent since."""
        kept = {id(q) for q in snap}
        for q in self.queue:
            if id(q) not in kept and q.ticket is not None:
                self.remote.abandon(q.ticket)
        self.queue = list(snap)

    def state_dict(self) -> dict[str, Any]:
        """Returns the queued batches (waiting for those still being generated), for a checkpoint."""
        for q in self.queue:
            self._collect(q)
        return {
            "depth": self.depth,
            "queued": [
                {
                    "step": q.step,
                    "idx": q.idx,
                    "weights_step": q.weights_step,
                    "rollout": rollout_state(q.rollout),
                }
                for q in self.queue
                if q.rollout is not None
            ],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Returns None; the queue becomes the checkpoint's batches (a run resumed with another
        rollout.max_staleness trains on them all the same, then queues as many as it is set to)."""
        for q in self.queue:
            if q.ticket is not None:
                self.remote.abandon(q.ticket)
        self.queue = [
            Queued(
                int(d["step"]),
                [int(i) for i in d["idx"]],
                int(d["weights_step"]),
                None,
                rollout_from(d["rollout"]),
            )
            for d in state["queued"]
        ]


def rollout_state(batch: RolloutBatch | None) -> dict[str, Any] | None:
    """Returns a single-completion rollout as plain lists and tensors (what a checkpoint loads without code)."""
    if batch is None:
        return None
    return {
        "prompt_ids": batch.prompt_ids,
        "completion_ids": batch.completion_ids,
        "truncated": batch.truncated,
        "group_size": batch.group_size,
        "sampling_logprobs": batch.sampling_logprobs,
        "paths": batch.paths,
        "topk_ids": batch.topk_ids,
        "topk_logprobs": batch.topk_logprobs,
    }


def rollout_from(state: dict[str, Any]) -> RolloutBatch:
    """Returns the RolloutBatch of `rollout_state`'s dict."""
    return RolloutBatch(
        prompt_ids=[list(p) for p in state["prompt_ids"]],
        completion_ids=[list(c) for c in state["completion_ids"]],
        truncated=torch.as_tensor(state["truncated"], dtype=torch.bool),
        group_size=int(state["group_size"]),
        sampling_logprobs=None if state["sampling_logprobs"] is None else list(state["sampling_logprobs"]),
        paths=dict(state["paths"]),
        # checkpoints written before top-K rollouts existed have neither key
        topk_ids=None if state.get("topk_ids") is None else list(state["topk_ids"]),
        topk_logprobs=None if state.get("topk_logprobs") is None else list(state["topk_logprobs"]),
    )
