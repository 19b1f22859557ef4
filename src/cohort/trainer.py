"""The GRPO training loop: generate → score → advantage → filter → update → log → checkpoint.

A step is a function over the run's parts (`cohort.train.step.train_step`: read it top to bottom).
The constructor translates its arguments (TRL's forms: `cohort.compat.drop_in.trainer_inputs`), validates
the config and builds the run of parts (`cohort.train.run.build_run`), where everything that can be checked
without a model (config, reward functions, dataset columns) is checked before the model is loaded. The
trainer's attributes are the run's parts; the loop (`cohort.train.loop`) takes the run and the step.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, Generic, TypeVar, overload

import torch
from transformers import TrainerState

from cohort.compat.callbacks import Callbacks
from cohort.compat.drop_in import errors_in_trl_terms, trainer_inputs
from cohort.compat.trainer_api import TrainerAPI, TrainResult
from cohort.config import TrainConfig
from cohort.episodes.spec import EpisodeSpec
from cohort.errors import ConfigError
from cohort.rewards import RewardLogs
from cohort.runtime import distributed as dist
from cohort.runtime.checkpoint_files import set_aside_newer
from cohort.runtime.rundir import RunLock, StopSignals
from cohort.train import loop
from cohort.train.ahead import AheadQueue
from cohort.train.checkpoints import RunCheckpoints, find_checkpoints, save_final_model, trl_resume_target
from cohort.train.curriculum import Curriculum
from cohort.train.draw import Drawer
from cohort.train.generation import GenerationSource
from cohort.train.health import HealthMonitor
from cohort.train.held_out import HeldOut
from cohort.train.prompt_order import PromptSampler
from cohort.train.run import Run, StepResult, autocast_context, build_run, run_precision
from cohort.train.scorer import Scorer
from cohort.train.state import StateRegistry
from cohort.train.step import train_step
from cohort.train.update import PolicyUpdater

__all__ = ["GRPOTrainer", "StepResult"]


T = TypeVar("T")


class _Part(Generic[T]):
    """A trainer attribute that is a part of its run: read and written through `trainer.run`."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, trainer: None, owner: type) -> _Part[T]: ...

    @overload
    def __get__(self, trainer: GRPOTrainer, owner: type | None = None) -> T: ...

    def __get__(self, trainer: GRPOTrainer | None, owner: type | None = None) -> T | _Part[T]:
        if trainer is None:  # read on the class: the descriptor itself, as a property is
            return self
        return getattr(trainer.run, self.name)

    def __set__(self, trainer: GRPOTrainer, value: T) -> None:
        setattr(trainer.run, self.name, value)


class GRPOTrainer(TrainerAPI):
    """Trains a causal LM with the GRPO family on prompts scored by reward functions."""

    run: Run
    # The run's parts under the names users, callbacks and tests know them by.
    cfg: _Part[TrainConfig] = _Part()
    updates_per_step: _Part[int] = _Part()
    state: _Part[TrainerState] = _Part()
    callbacks: _Part[Callbacks] = _Part()
    strategy: _Part[str] = _Part()
    run_dir: _Part[Path] = _Part()
    episode_spec: _Part[EpisodeSpec | None] = _Part()
    reward_funcs: _Part[list[Any]] = _Part()
    reward_names: _Part[list[str]] = _Part()
    reward_weights: _Part[torch.Tensor] = _Part()
    train_rows: _Part[list[dict]] = _Part()
    eval_rows: _Part[list[dict]] = _Part()
    iterative: _Part[Any] = _Part()
    labeler: _Part[Any] = _Part()
    device: _Part[torch.device] = _Part()
    model: _Part[torch.nn.Module] = _Part()
    tokenizer: _Part[Any] = _Part()
    reference: _Part[Any] = _Part()
    loaded: _Part[Any] = _Part()
    train_prompt_ids: _Part[list[list[int]]] = _Part()
    eval_prompt_ids: _Part[list[list[int]]] = _Part()
    dropped_prompts: _Part[int] = _Part()
    engine: _Part[Any] = _Part()
    sampler_copy: _Part[Any] = _Part()
    generator: _Part[torch.Generator] = _Part()
    shuffle_generator: _Part[torch.Generator] = _Part()
    optimizer: _Part[torch.optim.Optimizer] = _Part()
    scheduler: _Part[Any] = _Part()
    updater: _Part[PolicyUpdater] = _Part()
    sampler: _Part[PromptSampler] = _Part()
    curriculum: _Part[Curriculum | None] = _Part()
    scorer: _Part[Scorer] = _Part()
    remote: _Part[Any] = _Part()
    episodes: _Part[Any] = _Part()
    ahead: _Part[AheadQueue | None] = _Part()
    source: _Part[GenerationSource] = _Part()
    drawer: _Part[Drawer] = _Part()
    held_out: _Part[HeldOut] = _Part()
    health: _Part[HealthMonitor] = _Part()
    parts: _Part[StateRegistry] = _Part()
    checkpoints: _Part[RunCheckpoints] = _Part()
    stop_signals: _Part[StopSignals | None] = _Part()
    reward_logs: _Part[RewardLogs | None] = _Part()
    step_idx: _Part[int] = _Part()
    saved_step: _Part[int | None] = _Part()
    num_tokens: _Part[int] = _Part()

    def __init__(
        self,
        config: TrainConfig | str | os.PathLike | torch.nn.Module | None = None,
        reward_funcs: Any = None,
        args: Any = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        reward_processing_classes: Any = None,
        callbacks: Any = None,
        optimizers: Any = None,
        peft_config: Any = None,
        *,
        train_rows: list[dict] | None = None,
        eval_rows: list[dict] | None = None,
        model: torch.nn.Module | str | os.PathLike | None = None,
        tokenizer: Any = None,
        tools: Any = None,
        environment_factory: Any = None,
        rollout_func: Any = None,
    ):
        """cohort's form: `GRPOTrainer(config, reward_funcs=..., train_rows=..., model=..., tokenizer=...)`.

        TRL's form: `GRPOTrainer(model=name_or_path | PreTrainedModel, reward_funcs=callable | str | model |
        list, args=GRPOConfig(...), train_dataset=..., eval_dataset=..., processing_class=tokenizer,
        reward_processing_classes=..., peft_config=peft.LoraConfig)`; `cohort.compat.drop_in` maps it onto the config.

        Both forms take TRL's agent keywords: `tools=[fn, async_fn, ...]` and `environment_factory=Cls` (or a dict
        of factories routed by the dataset's `environment` column); the config's `episodes.*` says the same.
        """
        given = trainer_inputs(
            config,
            reward_funcs,
            args,
            train_dataset,
            eval_dataset,
            processing_class,
            optimizers,
            peft_config,
            train_rows=train_rows,
            eval_rows=eval_rows,
            model=model,
            tokenizer=tokenizer,
            environment_factory=environment_factory,
            rollout_func=rollout_func,
        )
        self.train_dataset, self.eval_dataset = given.datasets
        self.trl_form = given.trl_form
        self.reward_processing_classes = reward_processing_classes
        env_owns_data = environment_factory is not None or bool(given.config.episodes.environment)
        with errors_in_trl_terms(self.trl_form):
            cfg = given.config.validate(
                need_model=given.model is None,
                need_data=given.train_rows is None and not env_owns_data,
                reward_funcs=given.reward_funcs,
                environment_rewards=environment_factory is not None,
            )
            self.run = build_run(
                cfg,
                given,
                args=args,
                callbacks=callbacks,
                reward_processing_classes=reward_processing_classes,
                tools=tools,
                environment_factory=environment_factory,
                autocast=self.autocast,
            )
        self._resume()
        self.callbacks.objects = {
            "model": self.model,
            "processing_class": self.tokenizer,
            "optimizer": self.optimizer,
            "lr_scheduler": self.scheduler,
        }
        self.callbacks.fire("on_init_end")

    # ------------------------------------------------------------------ setup helpers
    def save_model(self, output_dir: str | os.PathLike | None = None) -> Path:
        """Returns the folder the model and tokenizer were saved to (TRL's name for save_final; default out_dir)."""
        return self.save_final(Path(output_dir) if output_dir is not None else self.run_dir)

    def compute_precision(self) -> torch.dtype:
        """Returns the least precise dtype the sampler's and the trainer's forward passes compute in (weights,
        autocast, the sampling copy or the workers' dtype), which sets logprob_gap's default threshold."""
        return run_precision(self.cfg, self.model, self.device)

    def autocast(self) -> contextlib.AbstractContextManager:
        """Returns the autocast context every forward pass runs under (bf16 on CUDA unless switched off)."""
        return autocast_context(self.cfg, self.device)

    @property
    def ref_model(self) -> torch.nn.Module | None:
        """Returns the frozen reference copy (None at beta = 0, and with LoRA, whose reference is the base)."""
        return self.reference.copy if self.reference is not None else None

    def _resume(self) -> None:
        """Loads the state of the newest checkpoint found that loads (none: the run starts at step 0)."""
        if not self.run.candidates:
            return
        self.step_idx = self.saved_step = self.checkpoints.load(self.run.candidates)
        if self.remote is not None:  # the workers hold the weights of step 0
            self.remote.push_weights(full=True)
        self.sync_state()
        if dist.is_main():
            for moved in set_aside_newer(self.run_dir, self.step_idx):
                print(
                    f"resume from step {self.step_idx}: the newer checkpoint {moved.name[len('abandoned-') :]} "
                    f"is set aside as {moved} (kept, never resumed from or pruned)",
                    flush=True,
                )
        if self.step_idx >= self.cfg.steps:
            print(
                f"resume: the run already reached steps={self.cfg.steps}; nothing to train (raise steps to "
                "continue it)",
                flush=True,
            )

    # ------------------------------------------------------------------ one step
    def step(self) -> StepResult:
        """Return the metrics of one training step (generation batch → μ updates): `cohort.train.step`."""
        return train_step(self.run)

    # ------------------------------------------------------------------ evaluation and saving
    def evaluate(
        self,
        eval_dataset: Any = None,
        ignore_keys: Any = None,
        metric_key_prefix: str = "eval",
        *,
        k: int = 1,
        sampled: bool = True,
    ) -> dict[str, float]:
        """Returns held-out greedy accuracy (and pass@k / maj@k when k > 1) under the first reward function, and
        with `sampled` TRL's eval_* metrics of group_size sampled completions per held-out prompt (named
        `<metric_key_prefix>_*`, as Trainer.evaluate; ignore_keys is the Trainer's and has nothing to ignore here)."""
        if eval_dataset is not None:
            raise ConfigError(
                "trainer.evaluate(eval_dataset=...) is not implemented by cohort: it evaluates the held-out rows "
                "given when the trainer was built (GRPOTrainer(eval_dataset=...) or eval_rows=)"
            )
        metrics = self.run.evaluate(k=k, sampled=sampled)
        if metric_key_prefix == "eval":
            return metrics
        return {
            f"{metric_key_prefix}_{key[len('eval_') :]}" if key.startswith("eval_") else key: value
            for key, value in metrics.items()
        }

    def save(self) -> Path:
        """Return the folder of a checkpoint of the current state."""
        return self.run.save()

    def save_final(self, folder: str | Path | None = None) -> Path:
        """Return the folder holding the final model and tokenizer (save_pretrained format)."""
        out = Path(folder) if folder else self.run_dir / "final"
        return save_final_model(self.model, self.tokenizer, out, sharded=self.strategy != "none")

    # ------------------------------------------------------------------ the loop
    def train(
        self, resume_from_checkpoint: bool | str | os.PathLike | None = None, trial: Any = None, **kwargs: Any
    ) -> TrainResult:
        """Return the run's summary (also written to out_dir/summary.json) after running the configured steps;
        it reads as transformers' TrainOutput too (global_step, training_loss, metrics).

        `resume_from_checkpoint` is TRL's: True continues from the newest checkpoint of out_dir, a path from
        that checkpoint (cohort's out_dir/checkpoints/step-N, or TRL's name output_dir/checkpoint-N).

        The summary: start_step, steps, total_steps, seconds_train, seconds_per_step, interrupted, checkpoint,
        accuracy_before / accuracy_after when evaluated, and final_metrics (the last step's headline metrics).
        Resumes when the config asks.

        The run directory is locked for the run's duration. Ctrl-C or SIGTERM saves a checkpoint of a step
        boundary (the step being prepared is rewound, the one being committed completes) and raises
        KeyboardInterrupt; a non-finite loss or gradient raises TrainingError before the weights change,
        and saves nothing.
        """
        if trial is not None or kwargs:
            names = (["trial"] if trial is not None else []) + list(kwargs)
            raise ConfigError(
                f"trainer.train({', '.join(f'{n}=...' for n in names)}): cohort takes resume_from_checkpoint only "
                "(hyperparameter search is not implemented)"
            )
        if resume_from_checkpoint not in (None, False):
            self._resume_from(resume_from_checkpoint)
        elif self.run.existing_run is not None:
            raise self.run.existing_run
        main = dist.is_main()
        lock = RunLock(self.run_dir).acquire() if main else None
        try:
            return self._train_result(loop.run(self.run, self.step, main))
        finally:
            if lock is not None:
                lock.release()

    def _resume_from(self, where: bool | str | os.PathLike) -> None:
        """Loads the checkpoint TRL's train(resume_from_checkpoint=...) names (True: out_dir's newest)."""
        if self.run.candidates:  # the config's resume already loaded one
            return
        self.cfg.resume = trl_resume_target(
            where, self.run_dir, self.cfg.algo.num_iterations * self.cfg.algo.num_minibatches
        )
        self.run.existing_run = None
        self.run.candidates = find_checkpoints(self.cfg, self.run_dir, trl_form=self.trl_form)
        self._resume()

    def sync_state(self) -> None:
        """Brings TRL's state to this step: optimizer steps, epoch, tokens seen."""
        self.run.clock.sync()
