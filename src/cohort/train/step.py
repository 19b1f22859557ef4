"""One training step as a function over the run's parts: draw → rewards → advantages → update → metrics.

Read :func:`train_step` top to bottom; each stage below it is a few lines calling the part that owns the work.
`GRPOTrainer.step` calls it with the trainer's run, and `cohort.train.loop` calls that step.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from cohort.algo import zero_std_group_mask
from cohort.episodes.multiturn import episode_metrics
from cohort.errors import NonFiniteError, TrainingError
from cohort.rewards import score
from cohort.rewards.process_rewards import process_metrics
from cohort.runtime import distributed as dist
from cohort.runtime import seeds
from cohort.runtime.sharding import gathered
from cohort.train.advantage_step import Advantaged, advantage_batch, own_rows
from cohort.train.draw import Drawn
from cohort.train.health import collapsed_share
from cohort.train.metrics import sample_rows, step_metrics
from cohort.train.rows import StepRows, gather_rows
from cohort.train.run import Run, StepResult
from cohort.train.update import PolicyBatch, UpdateStats

__all__ = ["train_step"]


def train_step(run: Run) -> StepResult:
    """Returns the metrics of one training step over the run's parts (generation batch → μ updates)."""
    t0 = time.perf_counter()
    step = run.step_idx + 1
    drawn, collapse, first_groups = _draw_groups(run, step)  # 1-3. prompts, G rollouts, rewards [N, R]
    # Every process's rows and counts in one collective: the advantages, placement and metrics read them.
    signal = run.drawer.signal(drawn)
    zero_std = zero_std_group_mask(signal, drawn.rollout.group_size) if dist.is_distributed() else None
    rows = gather_rows(drawn, zero_std, collapse, first_groups, run.cfg.rollout.batch_size)
    adv = _advantage(run, drawn, signal, rows)  # 4. advantages [N] and the loss filters
    t_score = time.perf_counter()
    t_gen = t_score - drawn.seconds_score  # scoring may interleave with generation rounds
    run.health.check_batch(step, drawn.per_func, adv.advantages, adv.in_loss)
    batch = _policy_batch(run, drawn, adv, rows)
    # 5. Policy update: from here on the step completes even when interrupted: a signal waits until the loop
    # has logged and saved the step (StopSignals.hold), since a step cut short after its update could be
    # neither rewound nor logged.
    _hold_signals(run)
    stats = _update(run, batch, step)
    t_update = time.perf_counter()
    if run.remote is not None:  # the workers sample the next batch with the weights of this update
        run.remote.weights_changed()
        run.remote.push_weights()
    run.health.check_gradient(step, stats.grad_norm, adv.advantages, adv.in_loss, run.cfg.optim.lr)
    run.step_idx = step
    # 6. Reference sync (recipes that let the anchor follow the policy), iterative GRPO's reward model.
    synced = run.reference is not None and run.reference.maybe_sync(step, stats.kl)
    it = run.cfg.iterative
    it_metrics = _iterate(run) if run.iterative is not None and step % it.every == 0 else {}
    metrics = _step_metrics(run, drawn, adv, stats, rows, synced, it_metrics)
    if run.remote is not None:
        metrics.update(run.remote.metrics())
    metrics.update(
        {
            "step_time": t_update - t0,
            "time/generate": t_gen - t0,
            "time/score": t_score - t_gen,
            "time/update": t_update - t_score,
        }
    )
    samples = sample_rows(
        drawn, adv, run.reward_names, run.cfg.data.prompt_column, run.cfg.num_samples_logged
    )
    return StepResult(metrics, samples)


def _draw_groups(run: Run, step: int) -> tuple[Drawn, float | None, int]:
    """Returns the step's groups (refilled under dynamic sampling), the share of the first round's groups
    collapsed onto one sub-par answer (None when that check is off) and the first round's groups, this
    process's (gather_rows sums them over every process)."""
    want = run.cfg.prompts_per_step
    # Sharded: the weights stay gathered over every round, since processes need different numbers of rounds.
    # Rollout workers sample instead: nothing is gathered, and a process that loses them stops them all.
    with gathered(run.model) if run.remote is None else dist.failing_together():
        drawn = run.drawer.draw(want, step, first=True)
        collapse = _collapse(run, drawn)  # judged on the first round: refilled groups are never all-equal
        groups = len(drawn.rollout.prompt_ids)
        if run.cfg.algo.dynamic_sampling:
            drawn = run.drawer.refill(drawn, want, step)
    run.reward_logs = drawn.logs
    return drawn, collapse, groups


def _advantage(run: Run, drawn: Drawn, signal: torch.Tensor, rows: StepRows) -> Advantaged:
    """Returns the drawn batch's advantages and loss filters, over every process's rewards."""
    return advantage_batch(
        drawn.per_func,
        drawn.reward,
        signal,
        drawn.rollout,
        run.cfg.algo,
        run.reward_weights,
        steps=drawn.steps,
        process_column=run.scorer.process_column,
        gather=rows.gather if dist.is_distributed() else dist.all_gather_rows,
        lengths=rows.lengths,
    )


def _policy_batch(run: Run, drawn: Drawn, adv: Advantaged, rows: StepRows) -> PolicyBatch:
    """Returns the update's batch, placed in the global batch (minibatches are drawn from every process's)."""
    rollout = drawn.rollout
    return PolicyBatch(
        rollout.prompt_ids,
        rollout.completion_ids,
        rollout.group_size,
        adv.advantages,
        adv.in_loss,
        rollout.sampling_logprobs,
        token_advantages=adv.token_advantages,
        topk_ids=rollout.topk_ids,
        topk_logprobs=rollout.topk_logprobs,
        group_offset=sum(rows.groups[: dist.rank()]),
        total_groups=sum(rows.groups),
        loss_masks=rollout.loss_masks,
        rewards=drawn.reward if run.cfg.algo.advantage == "optimal_token_baseline" else None,
    )


def _update(run: Run, batch: PolicyBatch, step: int) -> UpdateStats:
    """Returns the statistics of the μ × minibatch updates on `batch`; a typed error names the step."""
    try:
        return run.updater.update(batch, run.shuffle_generator)
    except NonFiniteError as e:  # the one check that stops the step: recorded like the others
        run.health.warn("non_finite", step, math.nan, 0.0, str(e))
        raise NonFiniteError(f"step {step}: {e}") from None
    except TrainingError as e:
        raise TrainingError(f"step {step}: {e}") from None


def _step_metrics(
    run: Run,
    drawn: Drawn,
    adv: Advantaged,
    stats: UpdateStats,
    rows: StepRows,
    synced: bool,
    it_metrics: dict[str, float],
) -> dict[str, Any]:
    """Returns the step's metrics row over every process (the health checks observe it)."""
    rollout = drawn.rollout
    run.num_tokens += rows.tokens
    metrics = step_metrics(
        run.step_idx,
        rollout,
        drawn.per_func,
        drawn.reward,
        adv.zero_std,
        stats,
        run.reward_names,
        run.num_tokens,
        own_rows,
        rows.columns,
    )
    metrics.update(rows.drawn_metrics)  # over every process: the most rounds any took, summed counts
    if drawn.steps is not None:
        metrics.update(process_metrics(drawn.steps))
    if rollout.episodes is not None:
        metrics.update(episode_metrics(rollout.episodes, dist.all_sum_float))
    metrics.update(it_metrics)
    if run.reference is not None and run.reference.follows_policy:
        metrics.update({"ref/synced": float(synced), "ref/syncs": float(run.reference.syncs)})
    if run.curriculum is not None:
        metrics.update(run.curriculum.metrics(run.step_idx))
    run.health.observe(run.step_idx, metrics, rows.collapse)
    metrics.update(drawn.logs.metric_means())  # rewards/<func>/<name> from log_metric
    return metrics


def _iterate(run: Run) -> dict[str, float]:
    """Returns the metrics of one iterative-GRPO iteration: reference reset, fresh labelled samples, the
    reward model retrained on them with replay (its pairwise accuracy on them before and after)."""
    cfg, it, G = run.cfg, run.cfg.iterative, run.cfg.rollout.group_size
    assert run.iterative is not None and run.labeler is not None
    if run.reference is not None:
        run.reference.sync(alpha=1.0)
    pick = seeds.generator(seeds.iterative_prompts(cfg.seed, run.step_idx))
    idx = torch.randperm(len(run.train_rows), generator=pick)[: it.prompts].tolist()
    rows = [run.train_rows[i] for i in idx]
    stream = seeds.generator(seeds.iterative_samples(cfg.seed, run.step_idx), run.device)
    rollout = run.drawer.generate(idx, run.step_idx, stream)
    completions = run.scorer.decode(rollout, rows)
    prompts, columns = run.scorer.inputs(rows, G)
    verdict = score(
        [run.labeler],
        prompts=prompts,
        completions=completions,
        completion_ids=rollout.completion_ids,
        columns=columns,
    )[:, 0]
    labels = [bool(v >= it.label_threshold) for v in verdict.tolist()]  # NaN (no verdict) counts as wrong
    fresh = run.iterative.pairs(prompts, completions, labels, G)
    out = run.iterative.retrain(fresh, seed=seeds.iterative_retrain(cfg.seed, run.step_idx))
    out["iterative/fresh_correct_frac"] = sum(labels) / max(len(labels), 1)
    return out


def _collapse(run: Run, drawn: Drawn) -> float | None:
    """Returns the share of drawn groups collapsed onto one sub-par answer (None when that check is off)."""
    if not run.health.active("collapse"):
        return None
    return collapsed_share(drawn.rollout.completion_ids, drawn.reward.tolist(), drawn.rollout.group_size)


def _hold_signals(run: Run) -> None:
    if run.stop_signals is not None:
        run.stop_signals.hold()
