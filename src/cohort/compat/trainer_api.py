"""transformers' Trainer methods and attributes that TRL scripts call on a GRPOTrainer, over cohort's run parts:
`args`, `processing_class`, the datasets, callbacks added and removed, `log`, `log_metrics` / `save_metrics` /
`save_state`, the process predicates, and `train()`'s result read as a `TrainOutput` (`TrainResult`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from cohort.runtime import distributed as dist

__all__ = ["TrainResult", "TrainerAPI"]


class TrainResult(dict):
    """`train()`'s result: cohort's run summary (a dict, as before) that also reads as transformers'
    `TrainOutput`: `global_step` (optimizer steps), `training_loss` and `metrics` (train_runtime,
    train_samples_per_second, train_steps_per_second, train_loss, epoch)."""

    def __init__(self, summary: dict[str, Any], global_step: int, metrics: dict[str, Any]):
        super().__init__(summary)
        self.global_step = global_step
        self.metrics = metrics
        self.training_loss = float(metrics.get("train_loss", 0.0))


_CLOSING = ("train_runtime", "train_samples_per_second", "train_steps_per_second", "train_loss", "epoch")
"""The closing log row's keys that TrainOutput.metrics holds."""


class TrainerAPI:
    """transformers' Trainer surface on GRPOTrainer (mixed in; reads the run's parts through the trainer)."""

    run: Any
    callbacks: Any
    state: Any
    tokenizer: Any
    scheduler: Any
    cfg: Any
    reward_names: list[str]
    run_dir: Path

    @property
    def args(self) -> Any:
        """Returns the GRPOConfig callbacks receive: the one given in TRL's form, else the config in TRL's terms."""
        return self.callbacks.args

    @property
    def processing_class(self) -> Any:
        """Returns the tokenizer."""
        return self.tokenizer

    @property
    def lr_scheduler(self) -> Any:
        """Returns the learning-rate scheduler."""
        return self.scheduler

    @property
    def reward_func_names(self) -> list[str]:
        """Returns the reward functions' names, as their metrics are logged."""
        return list(self.reward_names)

    @property
    def num_generations(self) -> int:
        """Returns the completions sampled per prompt (G)."""
        return int(self.cfg.rollout.group_size)

    def add_callback(self, callback: Any) -> None:
        """Adds a TrainerCallback (an instance or a class)."""
        self.callbacks.add(callback)

    def pop_callback(self, callback: Any) -> Any:
        """Returns the callback removed (an instance, or the first of a class), None when there is none."""
        return self.callbacks.pop(callback)

    def remove_callback(self, callback: Any) -> None:
        """Removes a callback (an instance, or the first of a class)."""
        self.callbacks.pop(callback)

    def is_world_process_zero(self) -> bool:
        """Returns whether this is the main process of the run."""
        return dist.is_main()

    def is_local_process_zero(self) -> bool:
        """Returns whether this is the main process of its machine."""
        return dist.local_rank() == 0

    def log(self, logs: dict[str, Any], start_time: float | None = None) -> None:
        """Appends `logs` to state.log_history with the epoch and step, and fires on_log."""
        self.callbacks.log(dict(logs))

    def log_metrics(self, split: str, metrics: dict[str, Any]) -> None:
        """Prints `metrics` under `split` (main process only), as Trainer.log_metrics."""
        if not self.is_world_process_zero():
            return
        print(f"***** {split} metrics *****")
        width = max((len(k) for k in metrics), default=0)
        for key in sorted(metrics):
            print(f"  {key:<{width}} = {metrics[key]}")

    def save_metrics(self, split: str, metrics: dict[str, Any], combined: bool = True) -> None:
        """Writes `metrics` to out_dir/<split>_results.json and, with `combined`, merges them into
        all_results.json (main process only)."""
        if not self.is_world_process_zero():
            return
        (self.run_dir / f"{split}_results.json").write_text(json.dumps(metrics, indent=4, sort_keys=True))
        if combined:
            path = self.run_dir / "all_results.json"
            merged = json.loads(path.read_text()) if path.is_file() else {}
            merged.update(metrics)
            path.write_text(json.dumps(merged, indent=4, sort_keys=True))

    def save_state(self) -> None:
        """Writes state (log_history, steps, best metric) to out_dir/trainer_state.json (main process only)."""
        if self.is_world_process_zero():
            self.state.save_to_json(str(self.run_dir / "trainer_state.json"))

    def _train_result(self, summary: dict[str, Any]) -> TrainResult:
        """Returns `summary` as a TrainResult, its metrics from the closing log row."""
        closing: dict[str, Any] = next(
            (r for r in reversed(self.state.log_history) if "train_runtime" in r), {}
        )
        return TrainResult(
            summary, int(self.state.global_step), {k: closing[k] for k in _CLOSING if k in closing}
        )
