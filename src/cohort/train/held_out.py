"""Held-out evaluation during training: cohort's greedy accuracy (pass@k, maj@k) and TRL's sampled eval_* metrics."""

from __future__ import annotations

import contextlib
import math
import time
from collections import Counter
from collections.abc import Callable
from typing import Any, cast

import torch

from cohort.algo import zero_std_group_mask
from cohort.commands.evaluation import evaluate
from cohort.episodes.multiturn import episode_metrics
from cohort.rewards import extract_answer, final_text
from cohort.rollout import RolloutBatch, SamplingParams
from cohort.rollout.base import EpisodeRecord, RolloutEngine
from cohort.runtime import distributed as dist
from cohort.runtime import seeds
from cohort.runtime.sharding import gathered
from cohort.train.accumulate import WeightedMeans
from cohort.train.advantage_step import outcome_advantages
from cohort.train.generation import GenerationSource, LocalGeneration
from cohort.train.metrics import rollout_stats
from cohort.train.scorer import Scorer
from cohort.train.update import PolicyBatch, PolicyUpdater


class HeldOut:
    """Evaluates the policy on the held-out rows, each evaluation on random streams of its own (seeded by the
    step), so evaluating never changes the training trajectory."""

    def __init__(
        self,
        rows: list[dict],
        prompt_ids: list[list[int]],
        *,
        model: torch.nn.Module,
        engine: RolloutEngine,
        scorer: Scorer,
        updater: PolicyUpdater,
        cfg: Any,
        params: SamplingParams,
        device: torch.device,
        autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
        trainer_state: Any = None,
        episodes: GenerationSource | None = None,
        remote: GenerationSource | None = None,
    ):
        """cfg: the run's TrainConfig (rollout, algo, eval_batch_size, data.prompt_column and seed are read);
        episodes: a multi-turn run's episode source (with its own environments), which then samples every
        held-out rollout, greedy ones included; remote: the rollout workers, which then sample every held-out
        rollout with the current weights (the trainer never gathers a sharded model to evaluate)."""
        self.rows, self.prompt_ids, self.model = rows, prompt_ids, model
        self.scorer, self.updater, self.cfg, self.params = scorer, updater, cfg, params
        self.device, self.autocast, self.trainer_state = device, autocast, trainer_state
        # Sampled as in training, but from the policy itself (never a low-precision sampling copy).
        self.source: GenerationSource = (
            episodes or remote or LocalGeneration(engine, model, autocast=autocast)
        )
        self.engine: RolloutEngine = (
            engine if remote is None else cast(RolloutEngine, _SourceAsEngine(remote))
        )
        self.gather = remote is None
        self.multi_turn = episodes is not None

    def evaluate(self, step: int, *, k: int = 1, sampled: bool = True) -> dict[str, float]:
        """Returns held-out greedy accuracy (and pass@k / maj@k when k > 1) under the first reward function, and
        with `sampled` TRL's eval_* metrics (eval_loss, eval_reward, eval_rewards/<name>/mean, ...) of
        group_size sampled completions per held-out prompt, with eval_runtime and its rates."""
        if not self.rows:
            return {}
        t0 = time.perf_counter()
        out = self.greedy(step, k)
        if sampled:
            out.update(self.sampled(step))
            seconds = time.perf_counter() - t0
            n, G = len(self.rows), self.cfg.rollout.group_size
            calls = math.ceil(n / max(1, self.cfg.eval_batch_size // G))
            out["eval_runtime"] = seconds
            out["eval_samples_per_second"] = n * G / seconds
            out["eval_steps_per_second"] = calls / seconds
        return out

    def sampled(self, step: int) -> dict[str, float]:
        """Returns TRL's eval_* metrics: group_size completions per held-out prompt, sampled as in training,
        scored by every reward function, and the objective's value on them (eval_loss)."""
        cfg, G = self.cfg, self.cfg.rollout.group_size
        per_call = max(1, cfg.eval_batch_size // G)
        generator = seeds.generator(seeds.held_out_sampling(cfg.seed, step), self.device)
        parts: list[tuple[torch.Tensor, ...]] = []
        loss = WeightedMeans()
        for start in range(0, len(self.rows), per_call):
            rows = self.rows[start : start + per_call]
            rollout = self._sample(self.prompt_ids[start : start + per_call], G, self.params, generator, rows)
            # a process reward scores its mean step reward here
            per_func, _, _ = self.scorer.score(
                rows, rollout, self.scorer.decode(rollout, rows), self.trainer_state, steps_only_mean=True
            )
            reward = self.scorer.combine(per_func, G)
            # this process's rows alone: every process evaluates alike
            adv = outcome_advantages(per_func, reward, rollout, cfg.algo, self.scorer.weights)
            batch = PolicyBatch(
                rollout.prompt_ids,
                rollout.completion_ids,
                G,
                adv,
                torch.ones_like(adv, dtype=torch.bool),
                loss_masks=rollout.loss_masks,
            )
            with self.autocast():
                for key, value in self.updater.evaluate_loss(batch).items():
                    loss.add(key, value, len(adv))
            zero_std = zero_std_group_mask(reward, G)
            parts.append(
                (reward, per_func, rollout.loss_lengths.cpu(), rollout.truncated.cpu(), zero_std.cpu())
            )
        reward, per_func, lengths, truncated, zero_std = (torch.cat(p) for p in zip(*parts))
        stats = rollout_stats(reward, per_func, lengths, truncated, zero_std, G, self.scorer.names)
        stats.update(loss.means())
        return {f"eval_{k}": v for k, v in stats.items()}

    def _sample(
        self,
        prompt_ids: list[list[int]],
        group_size: int,
        params: SamplingParams,
        generator: torch.Generator,
        rows: list[dict],
    ) -> RolloutBatch:
        """Returns the source's rollout of one chunk of held-out rows; with workers, a failure one process meets
        (every worker lost) is raised on every process before any of them goes on to the loss passes'
        collectives."""
        with contextlib.nullcontext() if self.gather else dist.failing_together():
            return self.source.generate(prompt_ids, group_size, params, generator, rows=rows)

    def greedy(self, step: int, k: int) -> dict[str, float]:
        """Returns cohort's held-out metrics: greedy accuracy, mean_length, n (pass@k / maj@k when k > 1)."""
        cfg = self.cfg
        if self.multi_turn:
            return self._greedy_episodes(step, k)
        # Workers: a failure one process meets (every worker lost) is raised on all, as in a step's draw.
        with self.autocast(), gathered(self.model) if self.gather else dist.failing_together():
            return evaluate(
                self.model,
                self.scorer.tokenizer,
                self.rows,
                self.scorer.funcs[0],
                prompt_ids=self.prompt_ids,
                engine=self.engine,
                max_completion_length=cfg.rollout.max_completion_length,
                prompt_column=cfg.data.prompt_column,
                k=k,
                batch_prompts=max(1, cfg.eval_batch_size // k),
                temperature=cfg.rollout.logprob_temperature(),  # pass@k samples even when training is greedy
                generator=seeds.generator(seeds.logged_samples(cfg.seed, step), self.device),
            )

    def _greedy_episodes(self, step: int, k: int) -> dict[str, float]:
        """Returns a multi-turn run's held-out metrics: greedy episodes scored by the first reward (accuracy: the
        share scoring 1 or more), their policy tokens (mean_length) and tool use; with k > 1, pass@k and maj@k of
        k sampled episodes per row (maj@k: the most common answer of the episodes' last assistant messages)."""
        cfg = self.cfg
        params = SamplingParams(max_completion_length=cfg.rollout.max_completion_length, greedy=True)
        generator = seeds.generator(seeds.logged_samples(cfg.seed, step), self.device)
        greedy = self._episodes(params, 1, generator, max(1, cfg.eval_batch_size))
        n = len(self.rows)
        tools = episode_metrics([r for _, _, _, records in greedy for r in records])
        out = {
            "accuracy": sum(rewards[0] >= 1.0 for rewards, _, _, _ in greedy) / n,
            "mean_length": sum(lengths[0] for _, _, lengths, _ in greedy) / n,
            "n": float(n),
            "tool_calls": tools["tools/call_frequency"],
            "tool_failures": tools["tools/failure_frequency"],
        }
        if k > 1:
            params = SamplingParams(
                max_completion_length=cfg.rollout.max_completion_length,
                temperature=cfg.rollout.logprob_temperature(),
            )
            sampled = self._episodes(params, k, generator, max(1, cfg.eval_batch_size // k))
            out[f"pass@{k}"] = sum(any(x >= 1.0 for x in rewards) for rewards, _, _, _ in sampled) / n
            maj = 0
            for rewards, answers, _, _ in sampled:
                counts = Counter(a for a in answers if a is not None)
                if counts:
                    maj += rewards[answers.index(counts.most_common(1)[0][0])] >= 1.0
            out[f"maj@{k}"] = maj / n
        return out

    def _episodes(
        self, params: SamplingParams, k: int, generator: torch.Generator, per_call: int
    ) -> list[tuple[list[float], list[str | None], list[int], list[EpisodeRecord]]]:
        """Returns per held-out row (first-reward scores of its k episodes, their final answers, their policy
        tokens, their records), played by the episode source with its own environments."""
        out = []
        for start in range(0, len(self.rows), per_call):
            rows = self.rows[start : start + per_call]
            rollout = self._sample(self.prompt_ids[start : start + per_call], k, params, generator, rows)
            completions = self.scorer.decode(rollout, rows)
            per_func, _, _ = self.scorer.score(
                rows, rollout, completions, self.trainer_state, steps_only_mean=True
            )
            rewards = per_func[:, 0].nan_to_num(0.0).tolist()
            answers = [extract_answer(final_text(c)) for c in completions]
            lengths = rollout.loss_lengths.tolist()
            records = rollout.episodes or []
            for i in range(len(rows)):
                sl = slice(i * k, (i + 1) * k)
                out.append((rewards[sl], answers[sl], lengths[sl], records[sl]))
        return out


class _SourceAsEngine:
    """The engine call `cohort.commands.evaluation.evaluate` makes, answered by a generation source (rollout workers, which
    hold the current weights: the model argument is not needed)."""

    def __init__(self, source: GenerationSource) -> None:
        self.source = source

    def generate(
        self,
        model: torch.nn.Module,
        prompt_ids: list[list[int]],
        group_size: int,
        params: SamplingParams,
        generator: torch.Generator | None = None,
        **_: Any,
    ) -> RolloutBatch:
        """Returns the source's rollout of the prompts."""
        return self.source.generate(prompt_ids, group_size, params, generator)
