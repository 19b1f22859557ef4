"""Draw and refill: a step's prompts, their rollouts and rewards, with dynamic sampling's extra rounds."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from cohort.algo import zero_std_group_mask
from cohort.errors import NonFiniteError
from cohort.rewards import RewardLogs
from cohort.rollout import RolloutBatch, SamplingParams, select_groups
from cohort.train.curriculum import Curriculum
from cohort.train.generation import GenerationSource
from cohort.train.prompt_order import PromptSampler
from cohort.train.scorer import Scorer, StepSpans

if TYPE_CHECKING:  # the serve package is imported only by runs with rollout workers (it needs pyzmq)
    from cohort.serve.client import Ticket
    from cohort.train.ahead import AheadQueue


@dataclass
class Drawn:
    """The prompts of a step (or of one dynamic-sampling round), their rollout and their rewards."""

    idx: list[int]
    rows: list[dict]
    rollout: RolloutBatch
    completions: list[Any]
    per_func: torch.Tensor
    """[N, R] each reward function's score (NaN for None)."""
    reward: torch.Tensor
    """[N] the weighted sum of per_func: what advantages, filters and the logs use."""
    logs: RewardLogs
    seconds_generate: float
    seconds_score: float
    steps: StepSpans | None = None
    """Per completion the process reward function's (step rewards, step end token indices); None without one."""
    rounds: int = 1
    groups_generated: int | None = None
    """Set by dynamic sampling only: groups generated over every round."""
    groups_kept: int | None = None
    completion_tokens: int | None = None
    staleness: int | None = None
    """Set for a batch requested ahead (rollout.max_staleness > 0): steps between the weights that sampled its
    first round and the weights it trains (0 ... k)."""

    def metrics(self) -> dict[str, float]:
        """Returns the dynamic-sampling metrics of a refilled batch and the staleness of one requested ahead ({} for
        a plain one)."""
        out = {"serve/staleness": float(self.staleness)} if self.staleness is not None else {}
        if self.groups_generated is None:
            return out
        return {
            **out,
            "sampling/rounds": float(self.rounds),
            "sampling/groups_generated": float(self.groups_generated),
            "sampling/groups_kept": float(self.groups_kept or 0),
            "sampling/completion_tokens": float(self.completion_tokens or 0),
        }


class Drawer:
    """Draws a step's groups: prompts from the sampler (past the curriculum), rollouts from the generation
    source, rewards from the scorer; `refill` swaps groups that teach nothing for new ones."""

    def __init__(
        self,
        source: GenerationSource,
        scorer: Scorer,
        sampler: PromptSampler,
        *,
        rows: list[dict],
        prompt_ids: list[list[int]],
        group_size: int,
        params: SamplingParams,
        generator: torch.Generator,
        curriculum: Curriculum | None = None,
        decoupled: bool = False,
        max_rounds: int = 1,
        live_state: Callable[[], Any] = lambda: None,
        warn_once: Callable[[str, str], None] = lambda key, message: None,
        ahead: AheadQueue | None = None,
    ):
        """decoupled: rewards are normalised per function (GDPO), so any varying weighted column teaches;
        live_state: returns TRL's trainer state brought to the step, for reward functions that read it;
        ahead: the queue of batches requested ahead (rollout.max_staleness > 0; the source is then remote)."""
        self.source, self.scorer, self.sampler, self.curriculum = source, scorer, sampler, curriculum
        self.rows, self.prompt_ids, self.G = rows, prompt_ids, group_size
        self.params, self.generator = params, generator
        self.decoupled, self.max_rounds = decoupled, max_rounds
        self.live_state, self.warn_once = live_state, warn_once
        self.ahead = ahead

    def generate(self, idx: list[int], step: int, generator: torch.Generator | None = None) -> RolloutBatch:
        """Returns G completions for each training prompt in `idx`, sampled from the current policy (on the
        training stream unless `generator` is given)."""
        rows = [self.rows[i] for i in idx]
        hook = self.scorer.prefetcher(rows, self.G)
        try:
            return self.source.generate(
                [self.prompt_ids[i] for i in idx],
                self.G,
                self.params,
                self.generator if generator is None else generator,
                rows=rows,
                **({"on_finished": hook} if hook is not None else {}),
            )
        except NonFiniteError as e:
            raise NonFiniteError(f"step {step}: {e}") from None

    def take(self, k: int, step: int) -> list[int]:
        """Returns k new prompts for `step` from the sampler, past the curriculum."""
        curriculum = self.curriculum
        allow = (lambda i: curriculum.active(i, step)) if curriculum is not None else None
        return self.sampler.take(k, allow=allow)

    def draw(self, k: int, step: int, *, first: bool = False) -> Drawn:
        """Returns k new prompts from the sampler, their rollout and its rewards (the curriculum records them);
        `first`: the step's first round, which comes from the queue of batches requested ahead when there is one."""
        staleness = None
        t0 = time.perf_counter()
        if first and self.ahead is not None:
            queued = self.ahead.take(step, lambda s: self._request(k, s))
            idx, rollout = queued.idx, queued.rollout
            assert rollout is not None
            staleness = step - 1 - queued.weights_step
        else:
            idx = self.take(k, step)
            t0 = time.perf_counter()
            rollout = self.generate(idx, step)
        rows = [self.rows[i] for i in idx]
        t1 = time.perf_counter()
        completions = self.scorer.decode(rollout, rows)
        # Reward functions get the live state, as in TRL, brought to the step being scored.
        per_func, logs, steps = self.scorer.score(rows, rollout, completions, self.live_state())
        if self.curriculum is not None:
            self.curriculum.record(idx, per_func[:, 0].view(-1, rollout.group_size), step)
        reward = self.scorer.combine(per_func, rollout.group_size)
        return Drawn(
            idx,
            rows,
            rollout,
            completions,
            per_func,
            reward,
            logs,
            t1 - t0,
            time.perf_counter() - t1,
            steps,
            staleness=staleness,
        )

    def _request(self, k: int, step: int) -> tuple[list[int], Ticket]:
        """Returns the prompts picked for `step` and the ticket of their batch, requested from the workers now."""
        assert self.ahead is not None
        idx = self.take(k, step)
        ticket = self.ahead.remote.submit(
            [self.prompt_ids[i] for i in idx], self.G, self.params, self.generator
        )
        return idx, ticket

    def signal(self, drawn: Drawn) -> torch.Tensor:
        """Returns the rewards whose spread decides whether a group teaches anything: each function's column
        [N, R] under decoupled (GDPO) normalisation, where any one varying column gives an advantage, else
        the weighted sum [N]."""
        if not self.decoupled:
            return drawn.reward
        weighted = self.scorer.weights != 0  # [R] a column of weight 0 adds nothing
        return drawn.per_func[:, weighted]

    def refill(self, first: Drawn, want: int, step: int) -> Drawn:
        """Returns a step's batch of `want` groups with unequal rewards, drawing groups for new prompts in
        batched rounds (at most max_rounds in all) to replace the all-equal ones.

        A round asks for the missing groups divided by the share of informative groups seen so far (a full
        batch at most), so a run where half the groups teach nothing usually needs one extra round. When the
        rounds run out the step trains on the informative groups it has (all of the first round's if none)."""
        G = self.G

        def informative(d: Drawn) -> list[int]:
            same = zero_std_group_mask(self.signal(d), G).view(-1, G)[:, 0].tolist()
            return [g for g, s in enumerate(same) if not s]

        parts = [(first, informative(first))]
        kept, generated = len(parts[0][1]), want
        while kept < want and len(parts) < self.max_rounds:
            need = want - kept
            k = want if kept == 0 else min(want, max(need, math.ceil(need * generated / kept)))
            d = self.draw(k, step)
            parts.append((d, informative(d)))
            kept, generated = kept + len(parts[-1][1]), generated + k
        if kept == 0:
            self.warn_once(
                "refill-empty",
                f"dynamic sampling: no group with unequal rewards in {len(parts)} rounds ({generated} groups); the "
                "step trains on the first round as it is (raise algo.dynamic_sampling.max_rounds, or check the rewards)",
            )
            chosen = [(first, list(range(len(first.idx))))]
        else:
            if kept < want:
                self.warn_once(
                    "refill-short",
                    f"dynamic sampling: {kept} of {want} groups with unequal rewards after {len(parts)} rounds; "
                    "the step trains on those (raise algo.dynamic_sampling.max_rounds to fill the batch)",
                )
            chosen, room = [], want
            for d, groups in parts:
                if room > 0 and groups:
                    chosen.append((d, groups[:room]))
                    room -= len(chosen[-1][1])
        return _assemble(first, parts, chosen, G, generated, min(kept, want))


def _assemble(
    first: Drawn,
    parts: list[tuple[Drawn, list[int]]],
    chosen: list[tuple[Drawn, list[int]]],
    G: int,
    generated: int,
    kept: int,
) -> Drawn:
    """Returns one Drawn of the chosen groups of every round, with the rounds' counts and timings."""
    rows_of = [[g * G + i for g in groups for i in range(G)] for _, groups in chosen]
    picked = list(zip(chosen, rows_of, strict=True))
    # Rounds none of whose groups were kept still logged metrics (log_metric) while being scored.
    none: list[int] = []
    unused = [(d.logs, none) for d, _ in parts if all(d is not c for c, _ in chosen)]
    return Drawn(
        idx=[d.idx[g] for d, groups in chosen for g in groups],
        rows=[d.rows[g] for d, groups in chosen for g in groups],
        rollout=select_groups([(d.rollout, groups) for d, groups in chosen]),
        completions=[d.completions[r] for (d, _), rows in picked for r in rows],
        per_func=torch.cat([d.per_func[rows] for (d, _), rows in picked]),
        reward=torch.cat([d.reward[rows] for (d, _), rows in picked]),
        steps=None if first.steps is None else [(d.steps or [])[r] for (d, _), rows in picked for r in rows],
        logs=RewardLogs.merged([(d.logs, rows) for (d, _), rows in picked] + unused),
        seconds_generate=sum(d.seconds_generate for d, _ in parts),
        seconds_score=sum(d.seconds_score for d, _ in parts),
        rounds=len(parts),
        groups_generated=generated,
        groups_kept=kept,
        completion_tokens=sum(int(d.rollout.loss_lengths.sum()) for d, _ in parts),
        staleness=first.staleness,
    )
