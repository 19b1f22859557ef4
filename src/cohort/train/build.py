"""Building a run's parts from its config, in the order the trainer needs them: what can be checked without a
model (rewards, prompt rows, iterative GRPO's reward model), then the device, the policy and its reference,
the prompts' token ids, the rollout engine, the optimizer and schedule, the curriculum."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from cohort.algo import POLICY_LOSSES
from cohort.choices import WORKER_ENGINES, resolve_load
from cohort.config import TrainConfig
from cohort.data import encode_prompts, load_rows, make_task, validate_rows
from cohort.episodes.multiturn import EMPTY_PROMPT, EpisodeGeneration, prompt_messages
from cohort.episodes.spec import EpisodeSpec, check_routing
from cohort.episodes.templates import render_prompt
from cohort.errors import ConfigError, TrainingError
from cohort.fastpath.memory import heap_bound_unavailable
from cohort.fastpath.switches import choose
from cohort.logprobs import warm_probes
from cohort.models import (
    DTYPES,
    checkpoint_activations,
    load_model,
    load_tokenizer,
    resolve_device,
    stop_token_ids,
    text_config,
    wrap_lora,
)
from cohort.reference import Reference
from cohort.report import quiet_hf_progress
from cohort.rewards import (
    check_reward_columns,
    check_reward_rows,
    resolve_reward_funcs,
    reward_name,
    reward_weights,
)
from cohort.rewards.process_rewards import ProcessRewardModel
from cohort.rewards.reward_models import RewardModel
from cohort.rollout import SamplingParams, make_engine
from cohort.rollout.base import RolloutEngine
from cohort.rollout.sampler_copy import SamplerCopy
from cohort.runtime import distributed as dist
from cohort.runtime.optim import make_adamw, make_scheduler
from cohort.runtime.sharding import Rank0Weights, fill_from_rank0, reshard, shard
from cohort.serve.client import RemoteGeneration, connect_workers
from cohort.train.ahead import AheadQueue
from cohort.train.checkpoints import check_finite_weights
from cohort.train.curriculum import Curriculum
from cohort.train.iterative import IterativeRM, load_initial_pairs
from cohort.train.update import checkpointing_layers


@dataclass
class Rewards:
    """The run's reward functions (resolved and checked before any model loads), their names and weights."""

    funcs: list[Any]
    names: list[str]
    weights: torch.Tensor
    """[R] float32."""
    sequence_advantages: bool
    """The loss type takes one advantage per completion (so no process reward may give per-token ones)."""


def build_rewards(
    cfg: TrainConfig,
    reward_funcs: Any,
    processing_classes: Any = None,
    *,
    owned: list[Any] | None = None,
    trl_form: bool = False,
) -> Rewards:
    """Returns the run's rewards: the given functions or the config's, then the rewards environments own
    (`owned`, weight 1 each, as TRL's get_reward columns), on the policy's device, checked against evaluation
    (the first reward scores held-out completions) and the loss type."""
    owned = list(owned or [])
    given = reward_funcs if reward_funcs else ([] if trl_form and owned else cfg.rewards)
    funcs = (
        resolve_reward_funcs(
            given,
            max_completion_length=cfg.rollout.max_completion_length,
            reward_processing_classes=processing_classes,
            step_separator=cfg.process.step_separator,
        )
        if given
        else []
    )
    if not funcs and not owned:
        raise ConfigError(
            "no reward source: pass reward_funcs (or rewards: in the config), or an environment that scores its "
            "episodes (a get_reward method, or a TextEnvironment's step rewards)"
        )
    weights = reward_weights(cfg.reward_weights, funcs) if funcs else torch.zeros(0)
    funcs += owned
    weights = torch.cat([weights, torch.ones(len(owned))]).float()
    device = resolve_device(cfg.model.device)
    for func in funcs:  # reward models score on the policy's device
        if callable(getattr(func, "to", None)):
            func.to(device)  # type: ignore[attr-defined]
    names = [reward_name(f) for f in funcs]
    if isinstance(funcs[0], ProcessRewardModel) and (cfg.eval_every or cfg.eval_at_ends):
        raise ConfigError(
            f"the first reward, {names[0]!r}, is a process reward model, but evaluation scores "
            "held-out completions with the first reward and needs one number per completion: put an outcome "
            "reward (e.g. accuracy) first, or set eval_every=0 and eval_at_ends=false"
        )
    loss_spec = POLICY_LOSSES.get(cfg.algo.loss_type)
    sequence_advantages = loss_spec is not None and loss_spec.sequence_advantages
    step_models = [n for n, f in zip(names, funcs) if isinstance(f, ProcessRewardModel)]
    if sequence_advantages and step_models:
        raise ConfigError(
            f"algo.loss_type={cfg.algo.loss_type!r} needs one advantage per completion, but the reward "
            f"{step_models[0]!r} is a process reward model (its step rewards give per-token advantages); use "
            "another loss type (e.g. grpo) or an outcome reward"
        )
    return Rewards(funcs, names, weights, sequence_advantages)


def build_rows(
    cfg: TrainConfig,
    rewards: Rewards,
    train_rows: list[dict] | None,
    eval_rows: list[dict] | None,
    episodes: EpisodeSpec | None = None,
) -> tuple[list[dict], list[dict]]:
    """Returns (training rows, held-out rows): the given ones or the config's, checked for the prompt column
    and the columns the rewards read; with one environment and no data, one empty prompt per group (the
    environment's reset writes each rollout's task, as TRL does)."""
    column = cfg.data.prompt_column
    if train_rows is None and episodes is not None and not (cfg.data.task or cfg.data.path):
        if episodes.routed or not episodes.environments:
            raise ConfigError(
                "no training data: several environments route rows by their `environment` column, so they need a "
                "dataset (train_dataset= / data.path); with one environment factory its reset() may own the data"
            )
        train_rows = [{column: [{"role": "user", "content": ""}]} for _ in range(cfg.prompts_per_step)]
    if train_rows is None:
        train_rows, loaded_eval = load_prompt_rows(cfg)
        eval_rows = loaded_eval if eval_rows is None else eval_rows
    if episodes is not None and episodes.environments:  # the environment's reset may write the prompt
        train_rows = [r if column in r else {**r, column: EMPTY_PROMPT} for r in train_rows]
        eval_rows = [r if column in r else {**r, column: EMPTY_PROMPT} for r in eval_rows or []]
    if episodes is not None and episodes.routed:
        check_routing(episodes, train_rows, "the training data")
        if eval_rows:
            check_routing(episodes, eval_rows, "the held-out data")
    validate_rows(train_rows, column, where="the training data")
    check_reward_columns(rewards.funcs, [c for c in train_rows[0] if c != column])
    check_reward_rows(rewards.funcs, train_rows, where="the training data")  # e.g. the code reward's tests
    if eval_rows:
        validate_rows(eval_rows, column, where="the held-out data")
        held_out = [c for c in eval_rows[0] if c != column]
        check_reward_columns(rewards.funcs[:1], held_out, where="the held-out data")  # evaluate()'s
        check_reward_rows(rewards.funcs[:1], eval_rows, where="the held-out data")
    if cfg.eval_every and not eval_rows:
        raise ConfigError(
            f"eval_every={cfg.eval_every} asks for held-out evaluations, but there are no held-out rows "
            f"(data.n_eval={cfg.data.n_eval} for a built-in task, data.eval_path={cfg.data.eval_path!r} for a "
            "dataset, or eval_rows=); give held-out rows or set eval_every=0"
        )
    return train_rows, eval_rows or []


def build_iterative(
    cfg: TrainConfig, rewards: Rewards, train_rows: list[dict]
) -> tuple[IterativeRM | None, Any]:
    """Returns iterative GRPO's state (the reward model to retrain, its replay buffer) and labeler, checked
    before the policy loads; (None, None) when iterative GRPO is off."""
    it = cfg.iterative
    if not it.every:
        return None, None
    pairs = list(zip(rewards.names, rewards.funcs))
    models = [(n, f) for n, f in pairs if isinstance(f, RewardModel)]
    if it.reward is not None:
        models = [(n, f) for n, f in models if n == it.reward]
    if len(models) != 1:
        names = [n for n, f in pairs if isinstance(f, RewardModel)]
        if it.reward is not None and names:
            raise ConfigError(
                f"iterative.reward={it.reward!r} names no reward model of this run; its reward models are {names}: "
                "set iterative.reward to one of them"
            )
        raise ConfigError(
            f"iterative GRPO retrains one reward model, but the rewards hold {len(names)} ({names}); "
            + ("set iterative.reward to one of them" if names else "add a reward model folder to rewards")
        )
    labeler = resolve_reward_funcs([it.labeler], max_completion_length=cfg.rollout.max_completion_length)[0]
    check_reward_columns([labeler], [c for c in train_rows[0] if c != cfg.data.prompt_column])
    try:
        initial = load_initial_pairs(it.initial_data)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return IterativeRM(models[0][1], it, initial), labeler


def set_threads(cfg: TrainConfig) -> None:
    """Returns None; applies `threads` (warning when above the core count) and the heap-bound switch."""
    if cfg.threads:
        if cfg.threads > (os.cpu_count() or cfg.threads):
            warnings.warn(
                f"threads={cfg.threads} is more than this machine's {os.cpu_count()} cores: the threads compete "
                "and every step is slower; set threads to at most the number of cores",
                stacklevel=3,
            )
        torch.set_num_threads(cfg.threads)
    f = cfg.fast
    choose(
        f.heap_bound,
        "heap_bound",
        None,
        unavailable=lambda: heap_bound_unavailable(f.heap_mmap_threshold_mib),
    )


def build_policy(
    cfg: TrainConfig, model: torch.nn.Module | None, tokenizer: Any, device: torch.device, strategy: str
) -> tuple[torch.nn.Module, Any, Reference | None, str]:
    """Returns (the policy, its tokenizer, the KL anchor or None, how its weights were loaded: "rank0" or
    "every"), the policy and a reference copy sharded under FSDP (distributed.load: see loading_path)."""
    loaded = loading_path(cfg, strategy, given=model is not None)
    empty = loaded == "rank0"
    # Process 0 reads first, so a new LoRA adapter draws its initial values as when every process reads.
    weights = rank0_weights(cfg) if empty else None
    policy, tokenizer = load_policy(cfg, model, tokenizer, device, empty=empty)
    if not empty:
        check_finite_weights(policy, "the model to train")
        dist.broadcast_model(policy)
    return policy, tokenizer, build_reference(cfg, policy, strategy, weights), loaded


def build_reference(
    cfg: TrainConfig, model: torch.nn.Module, strategy: str, weights: Rank0Weights | None = None
) -> Reference | None:
    """Returns the KL anchor (None at beta = 0), with the policy (and a reference copy) sharded under FSDP; a
    policy built on the meta device (distributed.load=rank0) gets its shards, and the copy's, from `weights`.

    With LoRA (a new adapter or one loaded to continue) the reference is the base with the adapter off."""
    a = cfg.algo
    sync = a.ref_sync
    reference = (
        Reference(
            model,
            every=sync.every if sync else 0,
            kl_threshold=sync.kl if sync else None,
            alpha=sync.alpha if sync else 1.0,
        )
        if a.beta > 0
        else None
    )
    if strategy != "none":  # FSDP per decoder layer and at the root; the reference the same way
        precision, empty = cfg.distributed.mixed_precision, weights is not None
        models = [model] + ([reference.copy] if reference is not None and reference.copy is not None else [])
        for m in models:
            shard(m, strategy, mixed_precision=precision, empty=empty)
        if weights is not None:
            fill_from_rank0(models, weights)
        # Every process runs the fast paths' once-per-model checks together (as an update would see the model):
        # the same forward calls on each, so every layer's all-gather pairs up and no process gathers the model.
        with checkpointing_layers(model):
            warm_probes(model, cfg.fast)
        reshard(model)
    return reference


def build_engine(
    cfg: TrainConfig, model: torch.nn.Module, tokenizer: Any
) -> tuple[RolloutEngine, SamplerCopy | None]:
    """Returns (the trainer's rollout engine, the low-precision copy it samples from when rollout.sampler_dtype
    asks); with rollout.engine=vllm, which only rollout workers run, the builtin engine (never sampled with: the
    workers sample the training batches and the held-out evaluation)."""
    eos_ids, pad = stop_token_ids(model, tokenizer)
    name = "builtin" if cfg.rollout.engine in WORKER_ENGINES else cfg.rollout.engine
    options = {"fast": cfg.fast} if name == "builtin" else {}
    engine = make_engine(name, eos_token_ids=eos_ids, pad_token_id=pad, **options)
    sampler_dtype = DTYPES.get(str(cfg.rollout.sampler_dtype).lower())
    copy = SamplerCopy(model, sampler_dtype) if isinstance(sampler_dtype, torch.dtype) else None
    return engine, copy


def build_remote(
    cfg: TrainConfig, model: torch.nn.Module, tokenizer: Any, engine: RolloutEngine
) -> RemoteGeneration | None:
    """Returns the generation source of rollout.workers, connected, checked and holding the policy's weights
    (None when rollout.workers is unset: the trainer samples in-process)."""
    r = cfg.rollout
    if r.workers is None:
        return None
    lora = cfg.model.lora
    device = resolve_device(cfg.model.device)
    return connect_workers(
        r.workers,
        model,
        tokenizer,
        engine,
        engine_name=r.engine,
        model_path=cfg.model.name_or_path,
        dtype=str(r.sampler_dtype or cfg.model.dtype),
        # The trainer's resolved device ("auto" means the GPU it trains on), never the word "auto" itself.
        device=str(device),
        attn_implementation=cfg.model.attn_implementation or "sdpa",
        lora={k: getattr(lora, k) for k in ("enabled", "r", "alpha", "dropout", "target_modules")}
        if lora.enabled
        else None,
        timeout=r.worker_timeout,
        connect_timeout=r.connect_timeout,
        bucket_bytes=max(1, int(r.push_bucket_mib * 2**20)),
        pushes_in_flight=r.max_staleness,
        transport=r.weight_transport,
        autocast="bfloat16" if device.type == "cuda" and cfg.model.bf16_autocast else None,
    )


def build_ahead(cfg: TrainConfig, remote: RemoteGeneration | None) -> AheadQueue | None:
    """Returns the queue of batches requested ahead of their step (None at rollout.max_staleness 0: each step
    samples its own batch with the current weights)."""
    if remote is None or cfg.rollout.max_staleness == 0:
        return None
    return AheadQueue(remote, cfg.rollout.max_staleness, cfg.steps)


def build_episodes(
    cfg: TrainConfig,
    spec: EpisodeSpec | None,
    model: torch.nn.Module,
    tokenizer: Any,
    engine: RolloutEngine,
    sampler_copy: SamplerCopy | None,
    autocast: Any,
    *,
    fresh: bool = False,
    remote: RemoteGeneration | None = None,
) -> EpisodeGeneration | None:
    """Returns the multi-turn generation source of a run with tools or environments (None without), stopping
    turns where the engine stops completions; `fresh`: with environment instances of its own (held-out);
    `remote`: the rollout workers, which then sample every policy turn (the agent loop stays here)."""
    if spec is None:
        return None
    if remote is not None:
        # connect_workers compared them already; a turn must end where the worker stops
        for c in remote.clients:
            theirs = (c.identity.get("stop") or {}).get("eos")
            if theirs is not None and sorted(theirs) != sorted(engine.eos_token_ids):
                raise ConfigError(
                    f"the rollout worker at {c.address} stops at tokens {theirs} and the episodes' turns end at "
                    f"{engine.eos_token_ids}: start the worker with the trainer's model and tokenizer"
                )
    return EpisodeGeneration(
        spec,
        model,
        tokenizer,
        end_of_turn_ids=engine.eos_token_ids,
        pad_token_id=engine.pad_token_id,
        prompt_column=cfg.data.prompt_column,
        chat_template_kwargs=cfg.data.chat_template_kwargs or None,
        sampler_copy=sampler_copy,
        autocast=autocast,
        fresh=fresh,
        preallocate=cfg.fast.preallocated_kv != "off",
        remote=remote,
        fast=cfg.fast,
    )


def build_optimizer(
    cfg: TrainConfig, model: torch.nn.Module
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """Returns (AdamW over the trainable parameters, the learning-rate schedule over every optimizer step)."""
    o = cfg.optim
    optimizer = make_adamw(
        (p for p in model.parameters() if p.requires_grad),
        lr=o.lr,
        betas=(o.adam_beta1, o.adam_beta2),
        eps=o.adam_eps,
        weight_decay=o.weight_decay,
    )
    updates = cfg.steps * cfg.algo.num_iterations * cfg.algo.num_minibatches
    return optimizer, make_scheduler(optimizer, o.schedule, o.warmup_steps, updates)


def build_curriculum(cfg: TrainConfig, n_rows: int) -> Curriculum | None:
    """Returns the curriculum over `n_rows` prompts (None when curriculum.enabled is false)."""
    c = cfg.curriculum
    if not c.enabled:
        return None
    return Curriculum(
        n_rows, pass_threshold=c.pass_threshold, min_samplings=c.min_samplings, retry_after=c.retry_after
    )


def sampling_params(cfg: TrainConfig) -> SamplingParams:
    """Returns the rollout's sampling parameters (greedy when rollout.temperature is 0; the sampler's top-K
    log-probs asked for when algo.dppo_topk > 0)."""
    r = cfg.rollout
    return SamplingParams(
        max_completion_length=r.max_completion_length,
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        greedy=r.temperature == 0,
        logprobs_topk=cfg.algo.dppo_topk,
    )


HELD_OUT_NEED = "the held-out evaluation needs at least one prompt; unset data.eval_path to evaluate on none"
"""What the error for held-out data with no rows says it was for."""


def load_prompt_rows(cfg: TrainConfig) -> tuple[list[dict], list[dict]]:
    """Return (train rows, held-out rows) for the config's built-in task or dataset."""
    d = cfg.data
    if d.path:
        train = load_rows(d.path, split=d.split, prompt_column=d.prompt_column, subset=d.subset)
        eval_subset = (
            d.eval_subset if d.eval_subset is not None else (d.subset if d.eval_path == d.path else None)
        )
        held = (
            load_rows(
                d.eval_path,
                split=d.eval_split,
                prompt_column=d.prompt_column,
                subset=eval_subset,
                need=HELD_OUT_NEED,
            )
            if d.eval_path
            else []
        )
    else:
        assert d.task is not None  # validate() requires data.path or data.task
        train, held = make_task(
            d.task, n_train=d.n_train, n_eval=d.n_eval, seed=d.task_seed, **d.task_options
        )
    return train, held[: cfg.eval_limit] if held else held


def loading_path(cfg: TrainConfig, strategy: str, *, given: bool) -> str:
    """Returns how this run's processes get the policy's weights: "rank0" (process 0 reads them and sends each
    process its shard) or "every" (each process reads them, or was given the model object)."""
    path = resolve_load(cfg.distributed.load, strategy)
    if given and path == "rank0":
        if cfg.distributed.load == "rank0":
            raise ConfigError(
                "distributed.load=rank0 reads model.name_or_path on process 0 only, but the model was given as an "
                "object, which every process already holds; pass its folder instead, or set distributed.load=auto"
            )
        return "every"
    return path


def _read_policy(cfg: TrainConfig, device: torch.device) -> torch.nn.Module:
    """Returns the config's policy read from model.name_or_path (with LoRA when configured) on `device`
    (meta: its modules without weights)."""
    with quiet_hf_progress():  # no "Loading weights" bar
        return load_model(
            cfg.model.name_or_path,
            dtype=cfg.model.dtype,
            device=str(device),
            trust_remote_code=cfg.model.trust_remote_code,
            attn_implementation=cfg.model.attn_implementation,
            lora=cfg.model.lora if cfg.model.lora.enabled else None,
            trainable_adapter=True,  # an adapter folder given as the model continues training as LoRA
        )


def rank0_weights(cfg: TrainConfig) -> Rank0Weights:
    """Returns the policy's weights as process 0 reads them from model.name_or_path into host memory, checked
    finite (empty on the other processes); a process 0 that cannot read them raises its error on every process."""
    full, error = None, None
    if dist.is_main():
        try:
            full = _read_policy(cfg, torch.device("cpu"))  # each tensor moves to the device as it is sent
            check_finite_weights(full, "the model to train")
        except (ValueError, OSError, TrainingError) as e:
            error = e
    dist.raise_together(error)
    return Rank0Weights.of(full)


def load_policy(
    cfg: TrainConfig,
    model: torch.nn.Module | None,
    tokenizer: Any,
    device: torch.device,
    *,
    empty: bool = False,
) -> tuple[torch.nn.Module, Any]:
    """Returns (the policy to train, its tokenizer): the given ones or the config's, loaded, with LoRA when
    configured, on `device`, in eval mode (no dropout) and with activation checkpointing when asked; `empty`:
    built on the meta device, its weights read by process 0 only (rank0_weights)."""
    tokenizer = tokenizer or load_tokenizer(
        cfg.model.name_or_path, trust_remote_code=cfg.model.trust_remote_code
    )
    given = model is not None
    if model is not None:
        policy = model
    elif empty:
        with torch.random.fork_rng(devices=[]):  # a LoRA adapter's init on the meta device keeps no value
            policy = _read_policy(cfg, torch.device("meta"))
    else:
        policy = _read_policy(cfg, device)
    if given and cfg.model.lora.enabled and not hasattr(policy, "disable_adapter"):
        policy = wrap_lora(policy, cfg.model.lora)  # a model object given with a LoRA config
    if not empty:
        policy.to(device)
    policy.eval()  # dropout off: π_old must equal the detached current policy at μ = 1
    # on for the whole run: the layers train (and recompute) only during updates (cohort.train.update)
    if cfg.model.gradient_checkpointing and not checkpoint_activations(policy):
        raise ConfigError(
            f"model.gradient_checkpointing=true, but {type(policy).__name__} cannot checkpoint "
            "activations (not a transformers model); set it to false"
        )
    return policy, tokenizer


def encode_rows(
    cfg: TrainConfig, tokenizer: Any, rows: list[dict], episodes: EpisodeSpec | None = None
) -> list[list[int]]:
    """Returns the token ids of each row's prompt (through the chat template for conversations; with the
    row's tool schemas in a multi-turn run, before any environment's reset adds to it)."""
    d = cfg.data
    if episodes is not None:
        return [
            render_prompt(
                tokenizer,
                prompt_messages(r[d.prompt_column]),
                tools=episodes.schemas(episodes.environment_for(r)) or None,
                chat_template_kwargs=d.chat_template_kwargs or None,
            )
            for r in rows
        ]
    return encode_prompts(
        tokenizer,
        [r[d.prompt_column] for r in rows],
        chat_template=d.chat_template,
        chat_template_kwargs=d.chat_template_kwargs or None,
    )


def drop_long_prompts(
    rows: list[dict], prompt_ids: list[list[int]], limit: int | None
) -> tuple[list[dict], list[list[int]], int]:
    """Returns (rows, prompt ids, how many were dropped) without the prompts longer than `limit` tokens."""
    if not limit:
        return rows, prompt_ids, 0
    keep = [i for i, p in enumerate(prompt_ids) if len(p) <= limit]
    if not keep:
        raise ValueError(
            f"every training prompt is longer than data.max_prompt_length={limit} tokens; raise it"
        )
    dropped = len(prompt_ids) - len(keep)
    if dropped:
        print(
            f"data.max_prompt_length={limit}: {dropped} of {len(prompt_ids)} training prompts are "
            "longer and are left out",
            flush=True,
        )
    return [rows[i] for i in keep], [prompt_ids[i] for i in keep], dropped


def check_context(
    model: torch.nn.Module, max_completion_length: int, train_ids: list[list[int]], eval_ids: list[list[int]]
) -> None:
    """Returns None; raises TrainingError when a prompt + max_completion_length exceeds the model's context."""
    context = getattr(text_config(model), "max_position_embeddings", None)
    if not isinstance(context, int) or context <= 0:
        return
    room = context - max_completion_length
    for where, ids in (("training", train_ids), ("held-out", eval_ids)):
        long = [len(p) for p in ids if len(p) > room]
        if not long:
            continue
        fits = context - max(len(p) for p in ids)  # the completion length under which every prompt fits
        fixes = [f"lower rollout.max_completion_length to {fits} or less"] if fits >= 1 else []
        if where == "training" and len(long) < len(ids) and room >= 1:
            # data.max_prompt_length drops training prompts only, and helps only while some prompt stays
            fixes.append(f"set data.max_prompt_length={room} to leave those prompts out")
        if not fixes:
            fixes.append(
                f"shorten the {where} prompts (the longest is {max(long)} tokens)"
                + (
                    ", or lower rollout.max_completion_length and leave the longest prompts out with "
                    "data.max_prompt_length (the two summing to at most the context)"
                    if where == "training" and min(len(p) for p in ids) < context
                    else ""
                )
            )
        raise TrainingError(
            f"{len(long)} of {len(ids)} {where} prompts (the longest {max(long)} tokens) do not leave room for "
            f"rollout.max_completion_length={max_completion_length} tokens within the model's context of "
            f"{context} (max_position_embeddings): {', or '.join(fixes)}"
        )
