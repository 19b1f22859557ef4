"""The training loop: steps until done, logging, evaluating and saving on the schedule and the callbacks' word,
stopping cleanly on a signal (the step being prepared is rewound, the one being committed completes)."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from transformers import TrainerControl

from cohort.config import save_config, to_dict
from cohort.report import MetricsLogger, Progress, read_jsonl, write_report, write_summary
from cohort.runtime import distributed as dist
from cohort.runtime.rundir import StopSignals, eval_row, logged_eval, trim_logs
from cohort.train.health import HealthAbort
from cohort.train.metrics import final_metrics
from cohort.train.run import Run, StepResult


def run(job: Run, step: Callable[[], StepResult], main: bool) -> dict[str, Any]:
    """Returns the run's summary after stepping `job` with `step` until done (see GRPOTrainer.train)."""
    cfg = job.cfg
    sharded = job.strategy != "none"  # every process writes its shard of a checkpoint
    logger = None
    if main:
        job.run_dir.mkdir(parents=True, exist_ok=True)
        if job.saved_step is not None:  # resumed (at step 0 too: a run interrupted before its first step)
            removed = trim_logs(job.run_dir, job.step_idx)  # rows of the attempt after the checkpoint
            if any(removed.values()):
                print(f"resume at step {job.step_idx}: removed rows logged after it {removed}", flush=True)
        save_config(cfg, job.run_dir / "config.yaml")
        logger = MetricsLogger(
            job.run_dir,
            tensorboard=cfg.tensorboard,
            wandb=cfg.wandb,
            wandb_project=cfg.wandb_project,
            config=to_dict(cfg),
        )
    progress = Progress(
        cfg.steps, start=job.step_idx, enabled=cfg.progress and main, logging_steps=cfg.logging_steps
    )
    health_log = logger.log_health if logger is not None else None
    job.health.log = (lambda finding: health_log(finding.row())) if health_log is not None else None
    summary: dict[str, Any] = {"start_step": job.step_idx}
    last_metrics: dict[str, Any] | None = None
    t_start = time.perf_counter()
    interrupted = False
    # Several processes stop together at a step boundary (their checkpoint is a collective save): a signal
    # is held until the step ends, then every process learns of it.
    signals = StopSignals(defer=dist.is_distributed())
    losses: list[float] = []  # this attempt's step losses: TRL's train_loss
    try:
        with signals:
            job.stop_signals = signals
            job.clock.sync()
            control = job.callbacks.fire("on_train_begin")
            # A resumed run's first evaluation is in evals.jsonl: read, not run again (nor lost from the summary).
            first = eval_row(job.run_dir, 0) if job.saved_step is not None else None
            if first is not None:
                summary["accuracy_before"] = first.get("accuracy")
            elif cfg.eval_at_ends and job.step_idx == 0 and job.eval_rows:
                before = _evaluate_and_log(job, logger, progress)
                summary["accuracy_before"] = before.get("accuracy")
            while job.step_idx < cfg.steps and not control.should_training_stop:
                snap = job.parts.snapshot()
                job.callbacks.fire("on_step_begin")
                try:
                    result = step()
                except KeyboardInterrupt:
                    if not signals.torn:
                        job.parts.rewind(snap)  # interrupted while preparing: back to the step's start
                    raise
                with signals.committing():
                    job.clock.sync()
                    if logger:
                        logger.log(result.metrics)
                        logger.log_samples(job.step_idx, result.samples)
                    progress.update(job.step_idx, result.metrics)
                    last_metrics = result.metrics
                    losses.append(float(result.metrics["loss"]))
                    job.callbacks.window.add(result.metrics)
                    at, control = job.step_idx, job.callbacks.control
                    control.should_log |= at % cfg.logging_steps == 0
                    # The last step's evaluation is the closing one when eval_at_ends runs it (not twice).
                    control.should_evaluate |= (
                        bool(cfg.eval_every)
                        and at % cfg.eval_every == 0
                        and (at < cfg.steps or not cfg.eval_at_ends)
                    )
                    control.should_save |= bool(cfg.save_every) and at % cfg.save_every == 0
                    job.callbacks.fire("on_step_end")
                    control = _act(job, logger, progress, save=main or sharded)
                    fired = job.health.take_pending()
                    # Every process aborts when one does (the save is collective) and stops when one has a signal:
                    # both agreed in one reduction.
                    flags = dist.Reductions()
                    if cfg.health.abort:
                        flags.max("abort", int(bool(fired)))
                    flags.max("stop", int(signals.pending is not None))
                    agreed = flags.reduce()
                    if agreed.get("abort"):
                        if (main or sharded) and job.saved_step != job.step_idx:
                            job.save()
                        what = (
                            f"the check {fired[0].check!r} fired ({fired[0].message})"
                            if fired
                            else "a health check fired on another process"
                        )
                        raise HealthAbort(
                            f"step {job.step_idx}: health.abort=true and {what}; checkpoint "
                            f"{job.run_dir / 'checkpoints'}/step-{job.step_idx} is saved"
                        )
                # one process reads its own flag here, after the block: a signal during it still counts
                if agreed["stop"] if dist.is_distributed() else signals.pending is not None:
                    raise KeyboardInterrupt
    except KeyboardInterrupt:
        interrupted = True
    finally:
        job.stop_signals = None
        progress.close()
    # The final save, evaluation and report: a signal now waits for them (a second one is obeyed).
    with signals, signals.committing():
        if job.strategy == "replicate":
            dist.assert_in_sync(job.model)
        if (main or sharded) and not signals.torn and job.saved_step != job.step_idx:
            summary["checkpoint"] = str(job.save())
        elif job.saved_step == job.step_idx:  # every process: each one's message names it
            summary["checkpoint"] = str(job.run_dir / "checkpoints" / f"step-{job.step_idx}")
        # A run resumed after its last step (killed before it could finish) may have logged this already.
        finished_before = summary["start_step"] == job.step_idx and logged_eval(job.run_dir, job.step_idx)
        if not interrupted and cfg.eval_at_ends and job.eval_rows and not finished_before:
            after = _evaluate_and_log(job, logger, progress)
            summary["accuracy_after"] = after.get("accuracy")
        seconds = time.perf_counter() - t_start
        summary.update(
            {
                "steps": job.step_idx,
                "total_steps": cfg.steps,
                "seconds_train": seconds,
                "interrupted": interrupted,
            }
        )
        if job.step_idx > summary["start_step"]:
            summary["seconds_per_step"] = seconds / (job.step_idx - summary["start_step"])
        # A resume with nothing left to train keeps the finished run's summary (its timings and evaluations) and
        # returns it; rewriting it from this empty attempt lost them.
        nothing_new = job.step_idx == summary["start_step"] and "accuracy_after" not in summary
        kept = _finished_summary(job.run_dir, job.step_idx) if nothing_new else None
        if main and kept is None:
            # This attempt's last step; a run resumed after its last step has the one metrics.jsonl holds.
            last = last_metrics or next(iter(read_jsonl(job.run_dir / "metrics.jsonl")[-1:]), None)
            if last is not None:
                summary["final_metrics"] = final_metrics(last)
            write_summary(job.run_dir, summary)
        if logger:
            logger.close()
            write_report(job.run_dir)
        if not interrupted:
            _log_summary(job, summary, losses, seconds)
            job.callbacks.fire("on_train_end")
    if interrupted:
        again = (
            "trainer.train(resume_from_checkpoint=True) continues"
            if job.trl_form
            else "the same command with resume=auto continues"
        )
        where = (
            f"checkpoint saved in {summary.get('checkpoint')}; {again} from it"
            if not signals.torn
            else f"interrupted twice mid-update: nothing saved; {again} from the last checkpoint"
        )
        stop = KeyboardInterrupt(f"training interrupted at step {job.step_idx}; {where}")
        stop.signal = signals.received  # type: ignore[attr-defined]
        raise stop
    return kept if kept is not None else summary


def _finished_summary(run_dir: Path, step: int) -> dict[str, Any] | None:
    """Returns the summary.json of a run that finished at `step` without interruption (None: none, or another)."""
    try:
        earlier = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    finished = isinstance(earlier, dict) and earlier.get("steps") == step and not earlier.get("interrupted")
    return earlier if finished else None


def _act(job: Run, logger: MetricsLogger | None, progress: Progress, save: bool) -> TrainerControl:
    """Logs, evaluates and saves as the control says (the loop's schedule and the callbacks), firing
    on_log / on_evaluate / on_save; returns the control."""
    control = job.callbacks.control
    if job.callbacks.callbacks and dist.is_distributed():  # every process acts alike (saves are collective)
        flags = dist.Reductions()
        for name in ("should_log", "should_evaluate", "should_save", "should_training_stop"):
            flags.max(name, int(getattr(control, name)))
        for name, value in flags.reduce().items():
            setattr(control, name, bool(value))
    if control.should_log:
        control.should_log = False
        if job.callbacks.window.rows:
            job.callbacks.log(job.callbacks.window.flush())
    if control.should_evaluate:
        control.should_evaluate = False
        if job.eval_rows:
            _evaluate_and_log(job, logger, progress)
    if control.should_save:
        control.should_save = False
        if save:
            job.save()
        control = job.callbacks.fire("on_save")
    return control


def _evaluate_and_log(job: Run, logger: MetricsLogger | None, progress: Progress) -> dict[str, float]:
    """Returns an evaluation, logged to evals.jsonl, the progress line and log_history (TRL's eval_* names),
    after on_evaluate."""
    ev = job.evaluate(k=job.cfg.eval_k, sampled=job.trl_form)
    if logger:
        logger.log_eval(job.step_idx, ev)
    progress.evaluated(job.step_idx, ev)
    row = {(k if k.startswith("eval_") else f"eval_{k}"): v for k, v in ev.items()}
    job.callbacks.log(row)
    job.callbacks.fire("on_evaluate", metrics=row)
    job.callbacks.track_best(row)
    return ev


def _log_summary(job: Run, summary: dict[str, Any], losses: list[float], seconds: float) -> None:
    """Appends TRL's closing row to log_history: train_runtime, train_samples_per_second,
    train_steps_per_second and train_loss, over this attempt's optimizer steps."""
    updates = (job.step_idx - summary["start_step"]) * job.updates_per_step
    completions = job.cfg.rollout.batch_size * dist.world_size() // job.cfg.algo.num_minibatches
    seconds = max(seconds, 1e-9)
    # Metrics of steps since the last logged row close the run's log, as TRL's log() merges what it holds.
    pending = job.callbacks.window.flush() if job.callbacks.window.rows else {}
    job.callbacks.log(
        {
            **pending,
            "train_runtime": seconds,
            "train_samples_per_second": updates * completions / seconds,
            "train_steps_per_second": updates / seconds,
            "train_loss": math.fsum(losses) / len(losses) if losses else 0.0,
        }
    )
