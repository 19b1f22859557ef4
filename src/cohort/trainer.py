"""The GRPO training loop: generate → score → advantage → filter → update → log → checkpoint.

Each step is a few lines calling the module that owns it; read :meth:`GRPOTrainer.step` top to bottom.
Everything that can be checked without a model (config, reward functions, dataset columns) is checked
in the constructor before the model is loaded.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerState

from cohort.algo import zero_std_group_mask
from cohort.compat.callbacks import Callbacks
from cohort.compat.drop_in import dataset_rows, trl_arguments, trl_view
from cohort.config import TrainConfig
from cohort.config.validation import check_episode_sampling
from cohort.episodes.multiturn import episode_metrics
from cohort.episodes.spec import build_episode_spec
from cohort.errors import (
    ConfigError,
    NonFiniteError,
    RunExistsError,
    TrainingError,
)
from cohort.models import DTYPES, check_model_source
from cohort.rewards import (
    score,
)
from cohort.rewards.process_rewards import process_metrics
from cohort.runtime import distributed as dist
from cohort.runtime import seeds
from cohort.runtime.checkpoint_files import (
    rng_state,
    set_aside_newer,
    set_rng_state,
)
from cohort.runtime.plugins import check_user_objective
from cohort.runtime.rundir import RunLock, StopSignals
from cohort.runtime.sharding import (
    gathered,
    resolve_strategy,
)
from cohort.train.advantage_step import Advantaged, advantage_batch, own_rows
from cohort.train.build import (
    build_ahead,
    build_curriculum,
    build_engine,
    build_episodes,
    build_iterative,
    build_optimizer,
    build_policy,
    build_remote,
    build_rewards,
    build_rows,
    check_context,
    drop_long_prompts,
    encode_rows,
    load_prompt_rows,
    resolve_device,
    sampling_params,
    set_threads,
)
from cohort.train.checkpoints import (
    RunCheckpoints,
    find_checkpoints,
    save_final_model,
    trl_resume_target,
)
from cohort.train.draw import Drawer, Drawn
from cohort.train.generation import GenerationSource, LocalGeneration
from cohort.train.health import HealthMonitor, collapsed_share, compute_precision
from cohort.train.held_out import HeldOut
from cohort.train.loop import run
from cohort.train.metrics import sample_rows, step_metrics
from cohort.train.prompt_order import PromptSampler
from cohort.train.rows import StepRows, gather_rows
from cohort.train.scorer import Scorer
from cohort.train.state import StateRegistry
from cohort.train.update import PolicyBatch, PolicyUpdater, UpdateStats


@dataclass
class StepResult:
    """What one training step produced."""

    metrics: dict[str, Any]
    samples: list[dict[str, Any]] = field(default_factory=list)


class GRPOTrainer:
    """Trains a causal LM with the GRPO family on prompts scored by reward functions."""

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
    ):
        """cohort's form: `GRPOTrainer(config, reward_funcs=..., train_rows=..., model=..., tokenizer=...)`.

        TRL's form: `GRPOTrainer(model=name_or_path | PreTrainedModel, reward_funcs=callable | str | model |
        list, args=GRPOConfig(...), train_dataset=..., eval_dataset=..., processing_class=tokenizer,
        reward_processing_classes=..., peft_config=peft.LoraConfig)`; `cohort.compat.drop_in` maps it onto the config.

        Both forms take TRL's agent keywords: `tools=[fn, async_fn, ...]` and `environment_factory=Cls` (or a dict
        of factories routed by the dataset's `environment` column); the config's `episodes.*` says the same.
        """
        if not isinstance(config, TrainConfig) and config is not None:
            if model is not None:
                raise ConfigError("pass the model once: as the first argument or as model=, not both")
            model, config = config, None  # TRL's positional order starts with the model
        if reward_funcs is not None and (callable(reward_funcs) or isinstance(reward_funcs, str)):
            reward_funcs = [reward_funcs]  # one function or name, as TRL accepts
        if optimizers not in (None, (None, None)):
            raise ConfigError(
                "optimizers= is not implemented by cohort: it builds AdamW and the schedule from the config "
                "(optim.* / GRPOConfig's learning_rate, lr_scheduler_type, warmup_steps, weight_decay, adam_*)"
            )
        self.trl_form = config is None
        if config is None:
            config, train_rows, eval_rows, model, tokenizer = trl_arguments(
                model,
                args,
                train_dataset,
                eval_dataset,
                processing_class,
                peft_config,
                train_rows,
                eval_rows,
                tokenizer,
                owns_data=environment_factory is not None and callable(environment_factory),
                routed=isinstance(environment_factory, Mapping),
            )
        elif args is not None or train_dataset is not None or peft_config is not None:
            raise ConfigError(
                "args=, train_dataset= and peft_config= belong to TRL's form GRPOTrainer(model=..., args=GRPOConfig(...)); "
                "with a cohort TrainConfig pass train_rows= and set model.lora.* in the config"
            )
        assert isinstance(config, TrainConfig)
        train_rows = dataset_rows(train_rows, limit=None)  # a datasets.Dataset works in cohort's form too
        eval_rows = dataset_rows(eval_rows, what="eval_rows")
        if isinstance(model, (str, os.PathLike)):
            config.model.name_or_path, model = str(model), None
        self.reward_processing_classes = reward_processing_classes
        env_owns_data = environment_factory is not None or bool(config.episodes.environment)
        self.cfg = cfg = config.validate(
            need_model=model is None,
            need_data=train_rows is None and not env_owns_data,
            reward_funcs=reward_funcs,
            environment_rewards=environment_factory is not None,
        )
        dist.init_from_env(cfg.distributed.backend)
        # TRL's state counts optimizer steps: each of cohort's steps (a generation batch) makes this many.
        self.updates_per_step = cfg.algo.num_iterations * cfg.algo.num_minibatches
        self.state = TrainerState(
            max_steps=cfg.steps * self.updates_per_step,
            logging_steps=cfg.logging_steps * self.updates_per_step,
            eval_steps=cfg.eval_every * self.updates_per_step,
            save_steps=cfg.save_every * self.updates_per_step,
            train_batch_size=cfg.rollout.batch_size // cfg.algo.num_minibatches,
            is_local_process_zero=dist.local_rank() == 0,
            is_world_process_zero=dist.is_main(),
        )
        self.callbacks = Callbacks(callbacks, args=args if self.trl_form else trl_view(cfg), state=self.state)
        self.strategy = resolve_strategy(cfg.distributed.strategy, dist.world_size())
        # 0. What can refuse the run without user code, before any is imported (a refused run runs none of
        # it): the model's folder, the data files, the run directory.
        if model is None:
            check_model_source(cfg.model.name_or_path)
        if train_rows is None and (cfg.data.task or cfg.data.path):
            train_rows, loaded_eval = load_prompt_rows(cfg)
            eval_rows = loaded_eval if eval_rows is None else eval_rows
        self.run_dir = Path(cfg.out_dir)
        # TRL's form asks to resume later, in train(resume_from_checkpoint=...): the refusal waits for it.
        self._existing_run: RunExistsError | None = None
        try:  # the checkpoints to resume from (newest first), checked against cfg
            self._candidates = find_checkpoints(cfg, self.run_dir, trl_form=self.trl_form)
        except RunExistsError as e:
            if not self.trl_form:
                raise
            self._candidates, self._existing_run = [], e
        # 1. Everything checkable without a model: a loss or estimator given as user code, tools and
        # environments, rewards, data, iterative GRPO's reward model.
        check_user_objective(cfg)
        self.episode_spec = build_episode_spec(
            cfg.episodes, tools=tools, environment_factory=environment_factory
        )
        # tools= / environment_factory= make episodes the config does not name: checked here, as the config's are
        if self.episode_spec is not None:
            check_episode_sampling(cfg)
        rewards = build_rewards(
            cfg,
            reward_funcs,
            reward_processing_classes,
            owned=self.episode_spec.reward_functions() if self.episode_spec else [],
            trl_form=self.trl_form,
        )
        self.reward_funcs, self.reward_names, self.reward_weights = (
            rewards.funcs,
            rewards.names,
            rewards.weights,
        )
        self.train_rows, self.eval_rows = build_rows(cfg, rewards, train_rows, eval_rows, self.episode_spec)
        self.iterative, self.labeler = build_iterative(cfg, rewards, self.train_rows)
        # 2. Model, tokenizer, reference.
        seeds.seed_globals(seeds.process(cfg.seed, dist.rank()))
        set_threads(cfg)
        self.device = resolve_device(cfg.model.device)
        self.model, self.tokenizer, self.reference, self.loaded = build_policy(
            cfg, model, tokenizer, self.device, self.strategy
        )
        # 3. Prompts as token ids, once.
        self.train_prompt_ids = encode_rows(cfg, self.tokenizer, self.train_rows, self.episode_spec)
        self.eval_prompt_ids = encode_rows(cfg, self.tokenizer, self.eval_rows, self.episode_spec)
        self.train_rows, self.train_prompt_ids, self.dropped_prompts = drop_long_prompts(
            self.train_rows, self.train_prompt_ids, cfg.data.max_prompt_length
        )
        check_context(
            self.model, cfg.rollout.max_completion_length, self.train_prompt_ids, self.eval_prompt_ids
        )
        if len(self.train_rows) < cfg.prompts_per_step:
            warnings.warn(
                f"the training data has {len(self.train_rows)} prompts, fewer than the {cfg.prompts_per_step} a step "
                f"samples (rollout.batch_size / rollout.group_size): each step repeats prompts as separate groups; "
                "add rows or lower rollout.batch_size",
                stacklevel=2,
            )
        # 4. Engine, optimizer, updater, the step's parts.
        self.engine, self.sampler_copy = build_engine(cfg, self.model, self.tokenizer)
        # Sampling draws on the model's device (the engine requires it); minibatch shuffling on the CPU.
        self.generator = seeds.generator(seeds.sampling(cfg.seed, dist.rank()), self.device)
        # The same on every process: minibatches are drawn from the global batch (cohort.train.update).
        self.shuffle_generator = seeds.generator(seeds.minibatch_shuffle(cfg.seed))
        self.optimizer, self.scheduler = build_optimizer(cfg, self.model)
        self.updater = PolicyUpdater(
            self.model,
            self.optimizer,
            self.scheduler,
            cfg.algo,
            temperature=cfg.rollout.logprob_temperature(),
            max_completion_length=cfg.rollout.max_completion_length,
            micro_batch_tokens=cfg.micro_batch_tokens,
            max_grad_norm=cfg.optim.max_grad_norm,
            reference=self.reference,
            autocast=self.autocast,
            fast=cfg.fast,
            # with rollout workers no process gathers the whole model, for pi_old and the reference neither
            gather_frozen=cfg.rollout.workers is None,
        )
        self.sampler = PromptSampler(len(self.train_rows), seeds.prompt_order(cfg.seed, dist.rank()))
        self.curriculum = build_curriculum(cfg, len(self.train_rows))
        params = sampling_params(cfg)
        self.scorer = Scorer(
            self.reward_funcs,
            self.reward_names,
            self.reward_weights,
            self.tokenizer,
            prompt_column=cfg.data.prompt_column,
            step_separator=cfg.process.step_separator,
            loss_type=cfg.algo.loss_type,
            sequence_advantages=rewards.sequence_advantages,
        )
        # Rollout workers (rollout.workers): greeted, checked and sent the weights here, before training starts.
        self.remote = build_remote(cfg, self.model, self.tokenizer, self.engine)
        try:  # with workers, the episodes' turns are sampled by them (the agent loop stays here)
            self.episodes = build_episodes(
                cfg,
                self.episode_spec,
                self.model,
                self.tokenizer,
                self.engine,
                self.sampler_copy,
                self.autocast,
                remote=self.remote,
            )
        except BaseException:
            if self.remote is not None:  # the workers this trainer started end with it
                self.remote.close()
            raise
        self.ahead = build_ahead(cfg, self.remote)  # rollout.max_staleness > 0: batches requested ahead
        self.source: GenerationSource = (
            self.episodes
            or self.remote
            or LocalGeneration(
                self.engine, self.model, sampler_copy=self.sampler_copy, autocast=self.autocast
            )
        )
        self.drawer = Drawer(
            self.source,
            self.scorer,
            self.sampler,
            rows=self.train_rows,
            prompt_ids=self.train_prompt_ids,
            group_size=cfg.rollout.group_size,
            params=params,
            generator=self.generator,
            curriculum=self.curriculum,
            decoupled=cfg.algo.reward_mode == "decoupled",
            max_rounds=cfg.algo.max_sampling_rounds,
            live_state=self._live_state,
            warn_once=self._warn_once,
            ahead=self.ahead,
        )
        self.held_out = HeldOut(
            self.eval_rows,
            self.eval_prompt_ids,
            model=self.model,
            engine=self.engine,
            scorer=self.scorer,
            updater=self.updater,
            cfg=cfg,
            params=dataclasses.replace(params, logprobs_topk=0),  # no update reads a held-out top-K
            device=self.device,
            autocast=self.autocast,
            trainer_state=self.state,
            episodes=build_episodes(
                cfg,
                self.episode_spec,
                self.model,
                self.tokenizer,
                self.engine,
                None,
                self.autocast,
                fresh=True,
                remote=self.remote,
            ),
            remote=self.remote,
        )
        self.step_idx = 0
        self.num_tokens = 0
        self._warned: set[str] = set()
        self.health = HealthMonitor(
            cfg.health,
            beta=cfg.algo.beta,
            num_iterations=cfg.algo.num_iterations,
            precision=self.compute_precision(),
            sampler_corrected=cfg.algo.sampler_correction != "none",
        )
        self.stop_signals: StopSignals | None = None
        self.saved_step: int | None = None
        self.parts = self._register_parts()
        self.checkpoints = RunCheckpoints(
            self.run_dir,
            cfg,
            model=self.model,
            tokenizer=self.tokenizer,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            generator=self.generator,
            reference=self.reference,
            parts=self.parts,
            sharded=self.strategy != "none",
            device=self.device,
            restart_streams=self._restart_streams,
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
        weights = next((p.dtype for p in self.model.parameters() if p.is_floating_point()), None)
        autocast = torch.bfloat16 if self.device.type == "cuda" and self.cfg.model.bf16_autocast else None
        sampler = DTYPES.get(str(self.cfg.rollout.sampler_dtype).lower())
        return compute_precision(weights, autocast, sampler if isinstance(sampler, torch.dtype) else None)

    def autocast(self) -> contextlib.AbstractContextManager:
        """Returns the autocast context every forward pass runs under (bf16 on CUDA unless switched off)."""
        if self.device.type == "cuda" and self.cfg.model.bf16_autocast:
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    @property
    def ref_model(self) -> torch.nn.Module | None:
        """Returns the frozen reference copy (None at beta = 0, and with LoRA, whose reference is the base)."""
        return self.reference.copy if self.reference is not None else None

    def _resume(self) -> None:
        """Loads the state of the newest checkpoint found that loads (none: the run starts at step 0)."""
        if not self._candidates:
            return
        self.step_idx = self.saved_step = self.checkpoints.load(self._candidates)
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

    def _restart_streams(self, seed: int) -> None:
        self.generator.manual_seed(seed)
        self.sampler.restart(seed)

    def _register_parts(self) -> StateRegistry:
        """Returns the registry of this run's stateful parts (checkpointed, resumed, rewound by name)."""
        parts = StateRegistry()
        # Each process's own streams: its sampling generator (with the global RNGs), prompt order, curriculum.
        parts.register(
            "rng",
            read=lambda: rng_state(self.generator),
            restore=lambda s: set_rng_state(s, self.generator),
            per_process=True,
            rewinds=True,
        )
        parts.register(
            "sampler",
            read=lambda: self.sampler.state_dict(),
            restore=lambda s: self.sampler.load_state_dict(s),
            per_process=True,
            rewinds=True,
        )
        if self.curriculum is not None:
            parts.register("curriculum", self.curriculum, per_process=True, rewinds=True)
        parts.register(
            "shuffle_rng",
            read=self.shuffle_generator.get_state,
            restore=self.shuffle_generator.set_state,
            rewinds=True,
        )
        parts.register(
            "num_tokens",
            read=lambda: self.num_tokens,
            restore=lambda n: setattr(self, "num_tokens", n),
            rewinds=True,
        )
        parts.register("health", self.health)
        # log_history, the best metric, stateful callbacks and the open log window
        parts.register("trainer_state", self.callbacks)
        if self.updater.entropy_on:  # the adaptive coefficient and the entropy it last measured
            parts.register(
                "entropy", read=self.updater.entropy_state, restore=self.updater.load_entropy_state
            )
        if self.iterative is not None:  # the retrained reward model, its optimizer and the replay buffer
            parts.register("iterative", self.iterative, file="iterative.pt")
        if self.episodes is not None:  # episode counters and the pooled environments' own state
            parts.register("episodes", self.episodes, per_process=True, rewinds=True)
        if self.ahead is not None:  # the batches requested ahead: saved whole, rewound by reference
            parts.register(
                "ahead",
                self.ahead,
                per_process=True,
                rewinds=True,
                mark=self.ahead.snapshot,
                back=self.ahead.rewind,
            )
        return parts

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(f"step {self.step_idx + 1}: {message}", stacklevel=3)

    # ------------------------------------------------------------------ one step
    def step(self) -> StepResult:
        """Return the metrics of one training step (generation batch → μ updates)."""
        t0 = time.perf_counter()
        step = self.step_idx + 1
        drawn, collapse, first_groups = self._draw_groups(step)  # 1-3. prompts, G rollouts, rewards [N, R]
        # Every process's rows and counts in one collective: the advantages, placement and metrics read them.
        signal = self.drawer.signal(drawn)
        zero_std = zero_std_group_mask(signal, drawn.rollout.group_size) if dist.is_distributed() else None
        rows = gather_rows(drawn, zero_std, collapse, first_groups, self.cfg.rollout.batch_size)
        adv = self._advantage(drawn, signal, rows)  # 4. advantages [N] and the loss filters
        t_score = time.perf_counter()
        t_gen = t_score - drawn.seconds_score  # scoring may interleave with generation rounds
        self.health.check_batch(step, drawn.per_func, adv.advantages, adv.in_loss)
        batch = self._policy_batch(drawn, adv, rows)
        # 5. Policy update: from here on the step completes even when interrupted: a signal waits until the loop
        # has logged and saved the step (StopSignals.hold), since a step cut short after its update could be
        # neither rewound nor logged.
        self._hold_signals()
        stats = self._update(batch, step)
        t_update = time.perf_counter()
        if self.remote is not None:  # the workers sample the next batch with the weights of this update
            self.remote.weights_changed()
            self.remote.push_weights()
        self.health.check_gradient(step, stats.grad_norm, adv.advantages, adv.in_loss, self.cfg.optim.lr)
        self.step_idx = step
        # 6. Reference sync (recipes that let the anchor follow the policy), iterative GRPO's reward model.
        synced = self.reference is not None and self.reference.maybe_sync(step, stats.kl)
        it = self.cfg.iterative
        it_metrics = self._iterate() if self.iterative is not None and step % it.every == 0 else {}
        metrics = self._step_metrics(drawn, adv, stats, rows, synced, it_metrics)
        if self.remote is not None:
            metrics.update(self.remote.metrics())
        metrics.update(
            {
                "step_time": t_update - t0,
                "time/generate": t_gen - t0,
                "time/score": t_score - t_gen,
                "time/update": t_update - t_score,
            }
        )
        samples = sample_rows(
            drawn, adv, self.reward_names, self.cfg.data.prompt_column, self.cfg.num_samples_logged
        )
        return StepResult(metrics, samples)

    def _draw_groups(self, step: int) -> tuple[Drawn, float | None, int]:
        """Returns the step's groups (refilled under dynamic sampling), the share of the first round's groups
        collapsed onto one sub-par answer (None when that check is off) and the first round's groups, this
        process's (gather_rows sums them over every process)."""
        want = self.cfg.prompts_per_step
        # Sharded: the weights stay gathered over every round, since processes need different numbers of rounds.
        # Rollout workers sample instead: nothing is gathered, and a process that loses them stops them all.
        with gathered(self.model) if self.remote is None else dist.failing_together():
            drawn = self.drawer.draw(want, step, first=True)
            collapse = self._collapse(drawn)  # judged on the first round: refilled groups are never all-equal
            groups = len(drawn.rollout.prompt_ids)
            if self.cfg.algo.dynamic_sampling:
                drawn = self.drawer.refill(drawn, want, step)
        self.reward_logs = drawn.logs
        return drawn, collapse, groups

    def _advantage(self, drawn: Drawn, signal: torch.Tensor, rows: StepRows) -> Advantaged:
        """Returns the drawn batch's advantages and loss filters, over every process's rewards."""
        return advantage_batch(
            drawn.per_func,
            drawn.reward,
            signal,
            drawn.rollout,
            self.cfg.algo,
            self.reward_weights,
            steps=drawn.steps,
            process_column=self.scorer.process_column,
            gather=rows.gather if dist.is_distributed() else dist.all_gather_rows,
            lengths=rows.lengths,
        )

    def _policy_batch(self, drawn: Drawn, adv: Advantaged, rows: StepRows) -> PolicyBatch:
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
            rewards=drawn.reward if self.cfg.algo.advantage == "optimal_token_baseline" else None,
        )

    def _update(self, batch: PolicyBatch, step: int) -> UpdateStats:
        """Returns the statistics of the μ × minibatch updates on `batch`; a typed error names the step."""
        try:
            return self.updater.update(batch, self.shuffle_generator)
        except NonFiniteError as e:  # the one check that stops the step: recorded like the others
            self.health.warn("non_finite", step, math.nan, 0.0, str(e))
            raise NonFiniteError(f"step {step}: {e}") from None
        except TrainingError as e:
            raise TrainingError(f"step {step}: {e}") from None

    def _step_metrics(
        self,
        drawn: Drawn,
        adv: Advantaged,
        stats: UpdateStats,
        rows: StepRows,
        synced: bool,
        it_metrics: dict[str, float],
    ) -> dict[str, Any]:
        """Returns the step's metrics row over every process (the health checks observe it)."""
        rollout = drawn.rollout
        self.num_tokens += rows.tokens
        metrics = step_metrics(
            self.step_idx,
            rollout,
            drawn.per_func,
            drawn.reward,
            adv.zero_std,
            stats,
            self.reward_names,
            self.num_tokens,
            own_rows,
            rows.columns,
        )
        metrics.update(rows.drawn_metrics)  # over every process: the most rounds any took, summed counts
        if drawn.steps is not None:
            metrics.update(process_metrics(drawn.steps))
        if rollout.episodes is not None:
            metrics.update(episode_metrics(rollout.episodes, dist.all_sum_float))
        metrics.update(it_metrics)
        if self.reference is not None and self.reference.follows_policy:
            metrics.update({"ref/synced": float(synced), "ref/syncs": float(self.reference.syncs)})
        if self.curriculum is not None:
            metrics.update(self.curriculum.metrics(self.step_idx))
        self.health.observe(self.step_idx, metrics, rows.collapse)
        metrics.update(self.reward_logs.metric_means())  # rewards/<func>/<name> from log_metric
        return metrics

    def _iterate(self) -> dict[str, float]:
        """Returns the metrics of one iterative-GRPO iteration: reference reset, fresh labelled samples, the
        reward model retrained on them with replay (its pairwise accuracy on them before and after)."""
        cfg, it, G = self.cfg, self.cfg.iterative, self.cfg.rollout.group_size
        assert self.iterative is not None and self.labeler is not None
        if self.reference is not None:
            self.reference.sync(alpha=1.0)
        pick = seeds.generator(seeds.iterative_prompts(cfg.seed, self.step_idx))
        idx = torch.randperm(len(self.train_rows), generator=pick)[: it.prompts].tolist()
        rows = [self.train_rows[i] for i in idx]
        stream = seeds.generator(seeds.iterative_samples(cfg.seed, self.step_idx), self.device)
        rollout = self.drawer.generate(idx, self.step_idx, stream)
        completions = self.scorer.decode(rollout, rows)
        prompts, columns = self.scorer.inputs(rows, G)
        verdict = score(
            [self.labeler],
            prompts=prompts,
            completions=completions,
            completion_ids=rollout.completion_ids,
            columns=columns,
        )[:, 0]
        labels = [bool(v >= it.label_threshold) for v in verdict.tolist()]  # NaN (no verdict) counts as wrong
        fresh = self.iterative.pairs(prompts, completions, labels, G)
        out = self.iterative.retrain(fresh, seed=seeds.iterative_retrain(cfg.seed, self.step_idx))
        out["iterative/fresh_correct_frac"] = sum(labels) / max(len(labels), 1)
        return out

    def _collapse(self, drawn: Drawn) -> float | None:
        """Returns the share of drawn groups collapsed onto one sub-par answer (None when that check is off)."""
        if not self.health.active("collapse"):
            return None
        return collapsed_share(drawn.rollout.completion_ids, drawn.reward.tolist(), drawn.rollout.group_size)

    def _hold_signals(self) -> None:
        if self.stop_signals is not None:
            self.stop_signals.hold()

    # ------------------------------------------------------------------ evaluation and saving
    def evaluate(self, *, k: int = 1, sampled: bool = True) -> dict[str, float]:
        """Returns held-out greedy accuracy (and pass@k / maj@k when k > 1) under the first reward function, and
        with `sampled` TRL's eval_* metrics of group_size sampled completions per held-out prompt."""
        return self.held_out.evaluate(self.step_idx, k=k, sampled=sampled)

    def save(self) -> Path:
        """Return the folder of a checkpoint of the current state."""
        folder = self.checkpoints.save(self.step_idx)
        self.saved_step = self.step_idx
        return folder

    def save_final(self, folder: str | Path | None = None) -> Path:
        """Return the folder holding the final model and tokenizer (save_pretrained format)."""
        out = Path(folder) if folder else self.run_dir / "final"
        return save_final_model(self.model, self.tokenizer, out, sharded=self.strategy != "none")

    # ------------------------------------------------------------------ the loop
    def train(
        self, resume_from_checkpoint: bool | str | os.PathLike | None = None, trial: Any = None, **kwargs: Any
    ) -> dict[str, Any]:
        """Return the run's summary (also written to out_dir/summary.json) after running the configured steps.

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
        elif self._existing_run is not None:
            raise self._existing_run
        main = dist.is_main()
        lock = RunLock(self.run_dir).acquire() if main else None
        try:
            return run(self, main)
        finally:
            if lock is not None:
                lock.release()

    def _resume_from(self, where: bool | str | os.PathLike) -> None:
        """Loads the checkpoint TRL's train(resume_from_checkpoint=...) names (True: out_dir's newest)."""
        if self._candidates:  # the config's resume already loaded one
            return
        self.cfg.resume = trl_resume_target(where, self.run_dir)
        self._existing_run = None
        self._candidates = find_checkpoints(self.cfg, self.run_dir, trl_form=self.trl_form)
        self._resume()

    def _live_state(self) -> TrainerState:
        """Returns TRL's trainer state brought to this step (reward functions read it, as in TRL)."""
        self.sync_state()
        return self.state

    def sync_state(self) -> None:
        """Brings TRL's state to this step: optimizer steps, epoch, tokens seen."""
        self.state.global_step = self.step_idx * self.updates_per_step
        self.state.epoch = self.sampler.epoch + self.sampler.pos / max(1, self.sampler.n)
        self.state.num_input_tokens_seen = self.num_tokens
