"""A run of parts: everything a training run holds (model, generation source, scorer, updater, reference,
optimizer and schedule, health, callbacks, the state registry, checkpoints, counters), built once from the
config by :func:`build_run` in the order the checks need, and read by the step and the loop.

The trainer only translates its arguments, builds the run and resumes it; the step and the loop take the run,
not the trainer."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerState

from cohort.compat.callbacks import Callbacks
from cohort.compat.drop_in import TrainerInputs, trl_view
from cohort.config import TrainConfig
from cohort.config.validation import check_episode_sampling
from cohort.episodes.multiturn import EpisodeGeneration
from cohort.episodes.spec import EpisodeSpec, build_episode_spec
from cohort.errors import RunExistsError
from cohort.models import DTYPES, check_model_source
from cohort.reference import Reference
from cohort.rewards import RewardLogs
from cohort.rollout.base import RolloutEngine
from cohort.rollout.sampler_copy import SamplerCopy
from cohort.runtime import distributed as dist
from cohort.runtime import seeds
from cohort.runtime.checkpoint_files import rng_state, set_rng_state
from cohort.runtime.plugins import check_user_objective
from cohort.runtime.rundir import StopSignals
from cohort.runtime.sharding import resolve_strategy
from cohort.serve.client import RemoteGeneration
from cohort.train.ahead import AheadQueue
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
from cohort.train.checkpoints import RunCheckpoints, data_fingerprint, find_checkpoints
from cohort.train.curriculum import Curriculum
from cohort.train.draw import Drawer
from cohort.train.generation import GenerationSource, LocalGeneration
from cohort.train.health import HealthMonitor, compute_precision
from cohort.train.held_out import HeldOut
from cohort.train.iterative import IterativeRM
from cohort.train.prompt_order import PromptSampler
from cohort.train.scorer import Scorer
from cohort.train.state import StateRegistry
from cohort.train.update import PolicyUpdater


@dataclass
class StepResult:
    """What one training step produced."""

    metrics: dict[str, Any]
    samples: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Counters:
    """The run's counters: steps taken, the step last saved, tokens trained on (the one a checkpoint's
    `num_tokens` part holds; the step is the checkpoint's own)."""

    step_idx: int = 0
    saved_step: int | None = None
    num_tokens: int = 0

    def state_dict(self) -> int:
        """Returns the tokens trained on."""
        return self.num_tokens

    def load_state_dict(self, num_tokens: int) -> None:
        """Restores the tokens trained on."""
        self.num_tokens = num_tokens


class SamplingStreams:
    """A process's sampling generator with the global RNGs (python, numpy, torch): the registry's `rng` part."""

    def __init__(self, generator: torch.Generator):
        self.generator = generator

    def state_dict(self) -> dict[str, Any]:
        """Returns every generator state the run's sampling depends on."""
        return rng_state(self.generator)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores the states of `state_dict`."""
        set_rng_state(state, self.generator)


class GeneratorState:
    """One torch generator as a stateful part (the minibatch shuffle's `shuffle_rng`)."""

    def __init__(self, generator: torch.Generator):
        self.generator = generator

    def state_dict(self) -> torch.Tensor:
        """Returns the generator's state."""
        return self.generator.get_state()

    def load_state_dict(self, state: torch.Tensor) -> None:
        """Restores the generator's state."""
        self.generator.set_state(state)


class EntropyState:
    """The updater's adaptive entropy coefficient and the entropy it last measured, as a stateful part."""

    def __init__(self, updater: PolicyUpdater):
        self.updater = updater

    def state_dict(self) -> Any:
        """Returns the updater's entropy state."""
        return self.updater.entropy_state()

    def load_state_dict(self, state: Any) -> None:
        """Restores the updater's entropy state."""
        self.updater.load_entropy_state(state)


class Clock:
    """TRL's trainer state kept at the run's step: optimizer steps, epoch, tokens seen."""

    def __init__(
        self, state: TrainerState, counters: Counters, sampler: PromptSampler, updates_per_step: int
    ):
        self.state, self.counters, self.sampler = state, counters, sampler
        self.updates_per_step = updates_per_step

    def sync(self) -> None:
        """Brings TRL's state to this step."""
        self.state.global_step = self.counters.step_idx * self.updates_per_step
        self.state.epoch = self.sampler.epoch + self.sampler.pos / max(1, self.sampler.n)
        self.state.num_input_tokens_seen = self.counters.num_tokens

    def live(self) -> TrainerState:
        """Returns TRL's trainer state brought to this step (reward functions read it, as in TRL)."""
        self.sync()
        return self.state


class Warnings:
    """Warnings given once per run, each naming the step it first happened at."""

    def __init__(self, counters: Counters):
        self.counters = counters
        self.warned: set[str] = set()

    def once(self, key: str, message: str) -> None:
        """Warns `message` the first time `key` is seen."""
        if key not in self.warned:
            self.warned.add(key)
            warnings.warn(f"step {self.counters.step_idx + 1}: {message}", stacklevel=3)


@dataclass
class Run:
    """The parts of one training run, each with its own state; the step and the loop read them."""

    cfg: TrainConfig
    trl_form: bool
    updates_per_step: int  # TRL's state counts optimizer steps: each of cohort's steps makes this many
    state: TrainerState
    callbacks: Callbacks
    strategy: str
    run_dir: Path
    candidates: list[tuple[Path, dict[str, Any]]]  # the checkpoints to resume from, newest first
    existing_run: RunExistsError | None  # TRL's form refuses an existing run in train(), not before
    episode_spec: EpisodeSpec | None
    reward_funcs: list[Any]
    reward_names: list[str]
    reward_weights: torch.Tensor
    train_rows: list[dict]
    eval_rows: list[dict]
    iterative: IterativeRM | None  # iterative GRPO's reward model and replay (None: off)
    labeler: Callable[..., list[float]] | None  # iterative GRPO's labelling reward function
    device: torch.device
    model: torch.nn.Module
    tokenizer: Any
    reference: Reference | None
    loaded: str  # how the policy's weights were loaded: "rank0" or "every"
    train_prompt_ids: list[list[int]]
    eval_prompt_ids: list[list[int]]
    dropped_prompts: int
    engine: RolloutEngine
    sampler_copy: SamplerCopy | None
    generator: torch.Generator
    shuffle_generator: torch.Generator
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    updater: PolicyUpdater
    sampler: PromptSampler
    curriculum: Curriculum | None
    scorer: Scorer
    remote: RemoteGeneration | None
    episodes: EpisodeGeneration | None
    ahead: AheadQueue | None
    source: GenerationSource
    drawer: Drawer
    held_out: HeldOut
    counters: Counters
    clock: Clock
    warnings: Warnings
    health: HealthMonitor
    parts: StateRegistry
    checkpoints: RunCheckpoints
    stop_signals: StopSignals | None = None  # the loop's, while it runs: the update holds a signal
    reward_logs: RewardLogs | None = None  # the last draw's log_metric values

    @property
    def step_idx(self) -> int:
        """Returns the steps taken."""
        return self.counters.step_idx

    @step_idx.setter
    def step_idx(self, value: int) -> None:
        self.counters.step_idx = value

    @property
    def saved_step(self) -> int | None:
        """Returns the step last saved (None: none this attempt)."""
        return self.counters.saved_step

    @saved_step.setter
    def saved_step(self, value: int | None) -> None:
        self.counters.saved_step = value

    @property
    def num_tokens(self) -> int:
        """Returns the tokens trained on."""
        return self.counters.num_tokens

    @num_tokens.setter
    def num_tokens(self, value: int) -> None:
        self.counters.num_tokens = value

    def save(self) -> Path:
        """Returns the folder of a checkpoint of the current state."""
        folder = self.checkpoints.save(self.step_idx)
        self.saved_step = self.step_idx
        return folder

    def evaluate(self, *, k: int = 1, sampled: bool = True) -> dict[str, float]:
        """Returns the held-out evaluation at this step (see GRPOTrainer.evaluate)."""
        return self.held_out.evaluate(self.step_idx, k=k, sampled=sampled)


def autocast_context(cfg: TrainConfig, device: torch.device) -> contextlib.AbstractContextManager:
    """Returns the autocast context every forward pass runs under (bf16 on CUDA unless switched off)."""
    if device.type == "cuda" and cfg.model.bf16_autocast:
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def run_precision(cfg: TrainConfig, model: torch.nn.Module, device: torch.device) -> torch.dtype:
    """Returns the least precise dtype the sampler's and the trainer's forward passes compute in (weights,
    autocast, the sampling copy or the workers' dtype), which sets logprob_gap's default threshold."""
    weights = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    autocast = torch.bfloat16 if device.type == "cuda" and cfg.model.bf16_autocast else None
    sampler = DTYPES.get(str(cfg.rollout.sampler_dtype).lower())
    return compute_precision(weights, autocast, sampler if isinstance(sampler, torch.dtype) else None)


def _restart_streams(generator: torch.Generator, sampler: PromptSampler, seed: int) -> None:
    generator.manual_seed(seed)
    sampler.restart(seed)


def build_run(
    cfg: TrainConfig,
    given: TrainerInputs,
    *,
    args: Any,
    callbacks: Any,
    reward_processing_classes: Any,
    tools: Any,
    environment_factory: Any,
    autocast: Callable[[], contextlib.AbstractContextManager],
) -> Run:
    """Returns the run's parts built from a validated config and the trainer's translated arguments, refusing
    what can be refused before any user code runs, and the model after every check that needs none."""
    model, tokenizer, train_rows, eval_rows = given.model, given.tokenizer, given.train_rows, given.eval_rows
    trl_form = given.trl_form
    workers = cfg.rollout.workers
    count = workers if isinstance(workers, int) else len(workers or ())
    dist.init_from_env(cfg.distributed.backend, dist.collective_timeout(cfg.rollout.worker_timeout, count))
    updates_per_step = cfg.algo.num_iterations * cfg.algo.num_minibatches
    state = TrainerState(
        max_steps=cfg.steps * updates_per_step,
        logging_steps=cfg.logging_steps * updates_per_step,
        eval_steps=cfg.eval_every * updates_per_step,
        save_steps=cfg.save_every * updates_per_step,
        train_batch_size=cfg.rollout.batch_size // cfg.algo.num_minibatches,
        is_local_process_zero=dist.local_rank() == 0,
        is_world_process_zero=dist.is_main(),
    )
    hooks = Callbacks(callbacks, args=args if trl_form else trl_view(cfg), state=state)
    strategy = resolve_strategy(cfg.distributed.strategy, dist.world_size())
    # 0. What can refuse the run without user code, before any is imported (a refused run runs none of
    # it): the model's folder, the data files, the run directory.
    if model is None:
        check_model_source(cfg.model.name_or_path)
    if train_rows is None and (cfg.data.task or cfg.data.path):
        train_rows, loaded_eval = load_prompt_rows(cfg)
        eval_rows = loaded_eval if eval_rows is None else eval_rows
    run_dir = Path(cfg.out_dir)
    # TRL's form asks to resume later, in train(resume_from_checkpoint=...): the refusal waits for it.
    existing_run: RunExistsError | None = None
    try:  # the checkpoints to resume from (newest first), checked against cfg
        candidates = find_checkpoints(cfg, run_dir, trl_form=trl_form)
    except RunExistsError as e:
        if not trl_form:
            raise
        candidates, existing_run = [], e
    # 1. Everything checkable without a model: a loss or estimator given as user code, tools and
    # environments, rewards, data, iterative GRPO's reward model.
    check_user_objective(cfg)
    episode_spec = build_episode_spec(cfg.episodes, tools=tools, environment_factory=environment_factory)
    # tools= / environment_factory= make episodes the config does not name: checked here, as the config's are
    if episode_spec is not None:
        check_episode_sampling(cfg)
    rewards = build_rewards(
        cfg,
        given.reward_funcs,
        reward_processing_classes,
        owned=episode_spec.reward_functions() if episode_spec else [],
        trl_form=trl_form,
    )
    train_rows, eval_rows = build_rows(cfg, rewards, train_rows, eval_rows, episode_spec)
    hooks.window.plain_metrics = {
        name
        for name, func in zip(rewards.names, rewards.funcs)
        if not str(getattr(func, "__module__", "") or "").startswith("cohort.")
    }
    iterative, labeler = build_iterative(cfg, rewards, train_rows)
    # 2. Model, tokenizer, reference.
    seeds.seed_globals(seeds.process(cfg.seed, dist.rank()))
    set_threads(cfg)
    device = resolve_device(cfg.model.device)
    model, tokenizer, reference, loaded = build_policy(cfg, model, tokenizer, device, strategy)
    # 3. Prompts as token ids, once.
    train_prompt_ids = encode_rows(cfg, tokenizer, train_rows, episode_spec)
    eval_prompt_ids = encode_rows(cfg, tokenizer, eval_rows, episode_spec)
    train_rows, train_prompt_ids, dropped_prompts = drop_long_prompts(
        train_rows, train_prompt_ids, cfg.data.max_prompt_length
    )
    check_context(model, cfg.rollout.max_completion_length, train_prompt_ids, eval_prompt_ids)
    if len(train_rows) < cfg.prompts_per_step:
        warnings.warn(
            f"the training data has {len(train_rows)} prompts, fewer than the {cfg.prompts_per_step} a step "
            f"samples (rollout.batch_size / rollout.group_size): each step repeats prompts as separate groups; "
            "add rows or lower rollout.batch_size",
            stacklevel=3,
        )
    # 4. Engine, optimizer, updater, the step's parts.
    engine, sampler_copy = build_engine(cfg, model, tokenizer)
    # Sampling draws on the model's device (the engine requires it); minibatch shuffling on the CPU.
    generator = seeds.generator(seeds.sampling(cfg.seed, dist.rank()), device)
    # The same on every process: minibatches are drawn from the global batch (cohort.train.update).
    shuffle_generator = seeds.generator(seeds.minibatch_shuffle(cfg.seed))
    optimizer, scheduler = build_optimizer(cfg, model)
    updater = PolicyUpdater(
        model,
        optimizer,
        scheduler,
        cfg.algo,
        temperature=cfg.rollout.logprob_temperature(),
        max_completion_length=cfg.rollout.max_completion_length,
        micro_batch_tokens=cfg.micro_batch_tokens,
        max_grad_norm=cfg.optim.max_grad_norm,
        reference=reference,
        autocast=autocast,
        fast=cfg.fast,
        # with rollout workers no process gathers the whole model, for pi_old and the reference neither
        gather_frozen=cfg.rollout.workers is None,
    )
    sampler = PromptSampler(len(train_rows), seeds.prompt_order(cfg.seed, dist.rank()))
    curriculum = build_curriculum(cfg, len(train_rows))
    params = sampling_params(cfg)
    scorer = Scorer(
        rewards.funcs,
        rewards.names,
        rewards.weights,
        tokenizer,
        prompt_column=cfg.data.prompt_column,
        step_separator=cfg.process.step_separator,
        loss_type=cfg.algo.loss_type,
        sequence_advantages=rewards.sequence_advantages,
    )
    # Rollout workers (rollout.workers): greeted, checked and sent the weights here, before training starts.
    remote = build_remote(cfg, model, tokenizer, engine)
    try:  # with workers, the episodes' turns are sampled by them (the agent loop stays here)
        episodes = build_episodes(
            cfg, episode_spec, model, tokenizer, engine, sampler_copy, autocast, remote=remote
        )
    except BaseException:
        if remote is not None:  # the workers this trainer started end with it
            remote.close()
        raise
    ahead = build_ahead(cfg, remote)  # rollout.max_staleness > 0: batches requested ahead
    source: GenerationSource = (
        episodes or remote or LocalGeneration(engine, model, sampler_copy=sampler_copy, autocast=autocast)
    )
    counters = Counters()
    clock = Clock(state, counters, sampler, updates_per_step)
    once = Warnings(counters)
    drawer = Drawer(
        source,
        scorer,
        sampler,
        rows=train_rows,
        prompt_ids=train_prompt_ids,
        group_size=cfg.rollout.group_size,
        params=params,
        generator=generator,
        curriculum=curriculum,
        decoupled=cfg.algo.reward_mode == "decoupled",
        # refill runs only under dynamic sampling; otherwise the rounds are the old default's, never used
        max_rounds=cfg.algo.dynamic_sampling.max_rounds if cfg.algo.dynamic_sampling is not None else 4,
        live_state=clock.live,
        warn_once=once.once,
        ahead=ahead,
    )
    held_out = HeldOut(
        eval_rows,
        eval_prompt_ids,
        model=model,
        engine=engine,
        scorer=scorer,
        updater=updater,
        cfg=cfg,
        params=dataclasses.replace(params, logprobs_topk=0),  # no update reads a held-out top-K
        device=device,
        autocast=autocast,
        trainer_state=state,
        episodes=build_episodes(
            cfg, episode_spec, model, tokenizer, engine, None, autocast, fresh=True, remote=remote
        ),
        remote=remote,
    )
    health = HealthMonitor(
        cfg.health,
        beta=cfg.algo.beta,
        num_iterations=cfg.algo.num_iterations,
        precision=run_precision(cfg, model, device),
        sampler_corrected=cfg.algo.applied_sampler_is() is not None,
    )
    parts = StateRegistry()
    # Each process's own streams: its sampling generator (with the global RNGs), prompt order, curriculum.
    parts.register("rng", SamplingStreams(generator), per_process=True, rewinds=True)
    parts.register("sampler", sampler, per_process=True, rewinds=True)
    if curriculum is not None:
        parts.register("curriculum", curriculum, per_process=True, rewinds=True)
    parts.register("shuffle_rng", GeneratorState(shuffle_generator), rewinds=True)
    parts.register("num_tokens", counters, rewinds=True)
    parts.register("health", health)
    # log_history, the best metric, stateful callbacks and the open log window
    parts.register("trainer_state", hooks)
    if updater.entropy_on:  # the adaptive coefficient and the entropy it last measured
        parts.register("entropy", EntropyState(updater))
    if iterative is not None:  # the retrained reward model, its optimizer and the replay buffer
        parts.register("iterative", iterative, file="iterative.pt")
    if episodes is not None:  # episode counters and the pooled environments' own state
        parts.register("episodes", episodes, per_process=True, rewinds=True)
    if ahead is not None:  # the batches requested ahead: saved whole, rewound by reference
        parts.register("ahead", ahead, per_process=True, rewinds=True, mark=ahead.snapshot, back=ahead.rewind)
    checkpoints = RunCheckpoints(
        run_dir,
        cfg,
        model=model,
        tokenizer=tokenizer,
        optimizer=optimizer,
        scheduler=scheduler,
        generator=generator,
        reference=reference,
        parts=parts,
        sharded=strategy != "none",
        device=device,
        restart_streams=functools.partial(_restart_streams, generator, sampler),
        data=data_fingerprint(train_rows),
    )
    return Run(
        cfg=cfg,
        trl_form=trl_form,
        updates_per_step=updates_per_step,
        state=state,
        callbacks=hooks,
        strategy=strategy,
        run_dir=run_dir,
        candidates=candidates,
        existing_run=existing_run,
        episode_spec=episode_spec,
        reward_funcs=rewards.funcs,
        reward_names=rewards.names,
        reward_weights=rewards.weights,
        train_rows=train_rows,
        eval_rows=eval_rows,
        iterative=iterative,
        labeler=labeler,
        device=device,
        model=model,
        tokenizer=tokenizer,
        reference=reference,
        loaded=loaded,
        train_prompt_ids=train_prompt_ids,
        eval_prompt_ids=eval_prompt_ids,
        dropped_prompts=dropped_prompts,
        engine=engine,
        sampler_copy=sampler_copy,
        generator=generator,
        shuffle_generator=shuffle_generator,
        optimizer=optimizer,
        scheduler=scheduler,
        updater=updater,
        sampler=sampler,
        curriculum=curriculum,
        scorer=scorer,
        remote=remote,
        episodes=episodes,
        ahead=ahead,
        source=source,
        drawer=drawer,
        held_out=held_out,
        counters=counters,
        clock=clock,
        warnings=once,
        health=health,
        parts=parts,
        checkpoints=checkpoints,
    )
