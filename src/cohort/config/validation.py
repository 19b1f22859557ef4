"""The checks of a config: every value that can be checked before a model is loaded.

:func:`validate_config` (what ``TrainConfig.validate`` runs after deriving) checks each section in turn;
every failure is a ConfigError naming the key, the value and the fix, and an option that is accepted but
changes nothing warns (or is refused) through :mod:`cohort.config.inert`. The checks change nothing and
read nothing from the environment: they see the config as given (derived by :mod:`cohort.config.derive`)
and the facts about the machine passed in (the process count, whether CUDA is visible). The names a value is checked against
come from light modules (:mod:`cohort.choices`, the name lists of :mod:`cohort.algo`); a user loss or
advantage estimator named by spec is imported and its signature checked (:mod:`cohort.runtime.plugins`).
This module reads the schema's classes only as types, so the schema can delegate its checks here.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import numbers
import os
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from cohort import choices
from cohort.algo.options import check_algo
from cohort.choices import (
    ATTENTION_KINDS,
    DISTRIBUTED_BACKENDS,
    DTYPE_NAMES,
    ENGINES,
    HEALTH_CHECKS,
    LOAD_MODES,
    MIXED_PRECISIONS,
    SAMPLER_DTYPES,
    SCHEDULES,
    WEIGHT_TRANSPORTS,
    WORKER_ENGINES,
    check_sampling,
    resolve_strategy,
)
from cohort.config.derive import per_process_batch
from cohort.config.inert import inert_options
from cohort.config.presets import PRESETS
from cohort.config.schema import OptimConfig, TrainFields, check_lora
from cohort.errors import ConfigError, ConfigWarning
from cohort.fastpath.switches import FastPathConfigError

__all__ = ["check_lora", "check_optim", "check_reward_weights", "validate_config"]


def validate_config(
    cfg: TrainFields,
    *,
    world_size: int,
    cuda_available: bool,
    need_model: bool = True,
    need_data: bool = True,
    reward_funcs: Sequence[str | Callable] | None = None,
    stacklevel: int = 2,
    environment_rewards: bool = False,
) -> TrainFields:
    """Return `cfg`, unchanged, after checking every value that can be checked before a model is loaded.

    `cfg` is checked as given: derive it first (:func:`cohort.config.derive.derive`). `world_size`: the
    processes the run is launched on; `cuda_available`: whether a CUDA GPU is visible (see
    :class:`cohort.config.derive.RunEnvironment`). `reward_funcs`: the reward functions the run uses
    instead of `rewards` (GRPOTrainer's argument of that name); `reward_weights` must then give one weight
    per one of them. `stacklevel`: as ``warnings.warn``'s, for the warnings about inert options (2: the
    caller of this function). `environment_rewards`: an environment factory given outside the config may
    own the run's reward, so `rewards` may be empty. Nothing is imported or registered: a loss or estimator
    named as `module:function` / `file.py:function` is checked for its form and file here, and for what it reads
    by :func:`cohort.runtime.plugins.check_user_objective`, which a trainer calls after its model, data and run
    folder are checked (so a refused run runs none of the user's code).
    """
    r, a, o = cfg.rollout, cfg.algo, cfg.optim
    _check_distributed(cfg, world_size, cuda_available)
    _check_workers(cfg)
    _check_transport(cfg, cuda_available)
    if cfg.episodes.enabled:
        check_episode_sampling(cfg)
    if need_model and not cfg.model.name_or_path:
        raise ConfigError("model.name_or_path is empty: set it to a local model folder or a hub name")
    if r.group_size < 2:
        raise ConfigError(
            f"rollout.group_size={r.group_size}: GRPO needs at least 2 completions per prompt "
            "to compare them; set rollout.group_size to 2 or more (8 or 16 are usual)"
        )
    if r.batch_size <= 0 or r.batch_size % r.group_size:
        lo = max(r.group_size, r.batch_size - r.batch_size % r.group_size)
        raise ConfigError(
            f"rollout.batch_size={r.batch_size} is not a positive multiple of "
            f"rollout.group_size={r.group_size}: each prompt needs a whole group; "
            f"set rollout.batch_size to e.g. {lo} or {lo + r.group_size}"
        )
    if r.max_completion_length <= 0:
        raise ConfigError(
            f"rollout.max_completion_length={r.max_completion_length} must be a positive number of tokens"
        )
    check_sampling(r.temperature, r.top_p, r.top_k, greedy=r.temperature == 0, prefix="rollout.")
    _check_choice("rollout.engine", r.engine, ENGINES + WORKER_ENGINES)
    _check_choice("optim.schedule", o.schedule, SCHEDULES)
    _check_choice("model.dtype", str(cfg.model.dtype).lower(), tuple(DTYPE_NAMES))
    _check_device(cfg.model.device)
    _check_sinks(cfg)
    if cfg.model.lora.enabled:
        check_lora(cfg.model.lora)
    attn = cfg.model.attn_implementation
    if attn is not None and attn not in ATTENTION_KINDS and "/" not in str(attn):
        raise ConfigError(
            f"model.attn_implementation={attn!r} is not one of {', '.join(ATTENTION_KINDS)} (or a hub kernel "
            "'org/name'); sdpa is the default"
        )
    if a.beta < 0:
        raise ConfigError(f"algo.beta={a.beta} must be >= 0 (0 disables the KL penalty)")
    if a.num_iterations < 1 or a.num_minibatches < 1:
        raise ConfigError("algo.num_iterations and algo.num_minibatches must be >= 1")
    if r.batch_size % (a.num_minibatches * r.group_size):
        raise ConfigError(
            f"rollout.batch_size={r.batch_size} must split into algo.num_minibatches={a.num_minibatches} "
            f"minibatches of whole groups of {r.group_size}: change either value"
        )
    if cfg.steps < 1:
        raise ConfigError(f"steps={cfg.steps} must be >= 1")
    if cfg.micro_batch_tokens < 1:
        raise ConfigError(f"micro_batch_tokens={cfg.micro_batch_tokens} must be >= 1")
    _check_lr(o, "optim.")
    given = reward_funcs or cfg.rewards
    # An environment may score its episodes itself (get_reward, step rewards): the builder checks it does.
    if not given and not (environment_rewards or cfg.episodes.environment or cfg.episodes.environments):
        raise ConfigError("rewards is empty: name at least one reward function, e.g. rewards=[accuracy]")
    if given or cfg.reward_weights is not None:
        try:
            check_reward_weights(cfg.reward_weights, _reward_names(given))
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if need_data and not cfg.data.task and not cfg.data.path:
        raise ConfigError(
            "no prompts: set data.path to a JSONL file / datasets name, or data.task to a built-in "
            "task (addition, multistep, code, multiply)"
        )
    _check_ranges(cfg)
    check_algo(cfg.algo)
    _check_topk_source(cfg)
    _check_beside_algo(cfg)
    _check_fast(cfg, cuda_available)
    for key, value, why, error in inert_options(cfg, world_size=world_size):
        message = f"{_shown(key, value)} changes nothing in this configuration: {why}"
        if error:
            raise ConfigError(message)
        warnings.warn(message, ConfigWarning, stacklevel=stacklevel)
    if cfg.preset is not None:
        _check_choice("preset", cfg.preset, tuple(PRESETS))
    return cfg


def _shown(key: str, value: Any) -> str:
    """Returns a key and its value as a user writes them: a section's settings one by one (algo.ref_sync.every=3,
    which algo.ref_update_every=3 sets), not its dict."""
    if isinstance(value, dict):
        settings = [f"{key}.{k}={v!r}" for k, v in value.items()]
        return " ".join(settings) if settings else f"{key}=true"
    return f"{key}={value!r}"


def check_optim(o: OptimConfig, prefix: str = "optim.") -> OptimConfig:
    """Return `o` after checking an optimizer section: every number finite, a known schedule, a positive
    learning rate and every value in its range (ConfigError naming `prefix` + the key).

    The checks of GRPO's own `optim:` section, which ``TrainConfig.validate`` runs among the rest; supervised
    fine-tuning, reward-model training and iterative GRPO check theirs with this."""
    for key, value in _leaves(o, prefix):
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{key}={value}: must be a finite number")
    _check_choice(f"{prefix}schedule", o.schedule, SCHEDULES)
    _check_lr(o, prefix)
    _check_rules(_optim_ranges(o, prefix))
    return o


def _check_lr(o: OptimConfig, prefix: str) -> None:
    """Raises ConfigError when the learning rate is not above 0."""
    if o.lr <= 0:
        raise ConfigError(f"{prefix}lr={o.lr} must be > 0")


def _optim_ranges(o: OptimConfig, prefix: str) -> list[tuple[str, Any, bool, str]]:
    """Returns (key, value, whether it holds, the rule) for each range an optimizer setting must lie in."""
    return [
        (f"{prefix}weight_decay", o.weight_decay, o.weight_decay >= 0, ">= 0"),
        (f"{prefix}adam_beta1", o.adam_beta1, 0 <= o.adam_beta1 < 1, "in [0, 1)"),
        (f"{prefix}adam_beta2", o.adam_beta2, 0 <= o.adam_beta2 < 1, "in [0, 1)"),
        (f"{prefix}adam_eps", o.adam_eps, o.adam_eps > 0, "> 0"),
        (f"{prefix}max_grad_norm", o.max_grad_norm, o.max_grad_norm >= 0, ">= 0 (0 disables clipping)"),
        (f"{prefix}warmup_steps", o.warmup_steps, o.warmup_steps >= 0, ">= 0"),
    ]


def _check_rules(rules: Sequence[tuple[str, Any, bool, str]]) -> None:
    """Raises ConfigError for the first (key, value, holds, rule) that does not hold."""
    for key, value, ok, rule in rules:
        if not ok:
            raise ConfigError(f"{key}={value} must be {rule}")


def _check_distributed(cfg: TrainFields, world: int, cuda_available: bool) -> None:
    """Raises ConfigError for a multi-process setting that cannot run on `world` processes here, or a
    rollout.batch_size that is not the derived share of distributed.global_batch_size."""
    d, r = cfg.distributed, cfg.rollout
    strategy = resolve_strategy(d.strategy, world)
    _check_choice("distributed.backend", d.backend, DISTRIBUTED_BACKENDS)
    _check_choice("distributed.mixed_precision", d.mixed_precision, MIXED_PRECISIONS)
    _check_choice("distributed.load", d.load, LOAD_MODES)
    if d.backend == "nccl" and world > 1 and not cuda_available:
        raise ConfigError(
            "distributed.backend=nccl needs CUDA GPUs, and this machine has none visible; set "
            "distributed.backend=gloo (or auto) to train on CPUs"
        )
    if world > 1 and cuda_available:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if str(cfg.model.device).lower() not in ("auto", "cuda", f"cuda:{local}"):
            raise ConfigError(
                f"model.device={cfg.model.device} cannot run under torchrun on a machine with CUDA GPUs: each "
                f"process trains on the GPU of its local rank (cuda:{local} for this one), where FSDP places the "
                "model and the process group talks; set model.device=auto, or hide the GPUs "
                "(CUDA_VISIBLE_DEVICES=) to train on CPUs"
            )
    if d.mixed_precision != "none" and strategy == "none":
        raise ConfigError(
            f"distributed.mixed_precision={d.mixed_precision} is FSDP's policy and this run has one process; "
            "use model.dtype / model.bf16_autocast instead, or launch with torchrun"
        )
    if d.global_batch_size is not None:
        per = world * r.group_size
        if d.global_batch_size <= 0 or d.global_batch_size % per:
            raise ConfigError(
                f"distributed.global_batch_size={d.global_batch_size} does not split into {world} processes x "
                f"whole groups of rollout.group_size={r.group_size}; use a multiple of {per}, or another "
                "number of processes"
            )
        if r.batch_size != per_process_batch(cfg, world):
            raise ConfigError(
                f"rollout.batch_size={r.batch_size} is not distributed.global_batch_size={d.global_batch_size} / "
                f"{world} processes: derive the config before checking it (cohort.config.derive)"
            )
    if strategy != "none":
        if r.sampler_dtype is not None and str(r.sampler_dtype).lower() not in (
            "none",
            str(cfg.model.dtype).lower(),
        ):
            raise ConfigError(
                f"rollout.sampler_dtype cannot run under distributed.strategy={strategy}: the sampling copy "
                "would hold the whole model on every process; leave it unset, or train on one process"
            )
        if cfg.model.lora.enabled and cfg.algo.ref_sync is not None:
            raise ConfigError(
                "a LoRA reference that follows the policy adds a second adapter during the run, which a model "
                "already wrapped by FSDP cannot take; set algo.ref_sync=none "
                "under torchrun, or train the full model"
            )
        if cfg.iterative.every:
            raise ConfigError(
                "iterative GRPO retrains its reward model on one process; set iterative.every=0 under torchrun"
            )


def _check_workers(cfg: TrainFields) -> None:
    """Raises ConfigError for a rollout.workers / max_staleness / timeout value that cannot work, or rollout
    workers combined with what they cannot serve (docs/serving.md says what is not built)."""
    r = cfg.rollout
    k = r.max_staleness
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ConfigError(
            f"rollout.max_staleness={k!r} must be an int >= 0: 0 samples every batch with the current weights "
            "(the synchronous step); set rollout.max_staleness=0"
        )
    for key in ("worker_timeout", "connect_timeout", "push_bucket_mib"):
        value = getattr(r, key)
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
            unit = "MiB" if key == "push_bucket_mib" else "seconds"
            raise ConfigError(f"rollout.{key}={value!r} must be a positive number of {unit}")
    w = r.workers
    if r.engine == "vllm":
        _check_vllm(cfg)
    if w is None:
        if k > 0:
            raise ConfigError(
                f"rollout.max_staleness={k} lets batches be sampled with older weights, which only rollout "
                "workers do; set rollout.workers (addresses or a number of local workers), or max_staleness=0"
            )
        return
    if isinstance(w, bool) or (isinstance(w, int) and w < 1):
        raise ConfigError(
            f"rollout.workers={w!r}: give a number of local workers >= 1, a list of host:port addresses, or "
            "null to sample in the trainer"
        )
    if not isinstance(w, int):
        if not isinstance(w, list) or not w:
            raise ConfigError(
                f"rollout.workers={w!r}: give a list of host:port addresses (e.g. [127.0.0.1:5555]), a number "
                "of local workers, or null"
            )
        for address in w:
            host, _, port = str(address).rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ConfigError(
                    f"rollout.workers lists {address!r}, which is not host:port (e.g. 127.0.0.1:5555 or "
                    "node5:5555, with the port `cohort serve --port` listens on)"
                )
        if len(set(w)) != len(w):
            raise ConfigError(f"rollout.workers lists an address twice ({w}); list each worker once")


def _check_transport(cfg: TrainFields, cuda_available: bool) -> None:
    """Raises ConfigError for a rollout.weight_transport that is not a transport, or nccl where the trainer's
    weights cannot be on a GPU (NCCL sends from GPU memory); the worker's side is checked on connecting."""
    t = cfg.rollout.weight_transport
    if t not in WEIGHT_TRANSPORTS:
        raise ConfigError(
            f"rollout.weight_transport={t!r} is not one of {', '.join(WEIGHT_TRANSPORTS)}; auto picks nccl where "
            "the trainer and a worker are on distinct GPUs, gloo elsewhere"
        )
    device = cfg.model.device
    on_gpu = device.startswith("cuda") or (device == "auto" and cuda_available)
    if t == "nccl" and not on_gpu:
        where = "no CUDA GPU is visible" if device == "auto" else f"model.device={device}"
        raise ConfigError(
            f"rollout.weight_transport=nccl sends the weights from the trainer's GPU, and {where}: set "
            "rollout.weight_transport=auto (gloo through host memory), or train on a GPU"
        )


def check_episode_sampling(cfg: TrainFields) -> None:
    """Raises ConfigError when multi-turn episodes cannot be sampled as configured: rollout workers asked to roll
    them out ahead of their step (rollout.max_staleness > 0; at 0 the workers sample each turn of the trainer's
    agent loop), or rollout.engine=hf in the trainer (episodes decode with cohort's own turn decoder)."""
    k = cfg.rollout.max_staleness
    if cfg.rollout.workers is not None and k > 0:
        raise ConfigError(
            f"rollout.max_staleness={k} with multi-turn episodes: a batch of episodes cannot be requested ahead "
            "(their tools and environments run in the trainer between turns); set rollout.max_staleness=0"
        )
    if cfg.rollout.workers is None and cfg.rollout.engine == "hf":
        raise ConfigError(
            "rollout.engine=hf with multi-turn episodes: episodes decode with cohort's own turn decoder, which "
            "extends the KV cache between turns; set rollout.engine=builtin"
        )


def _check_vllm(cfg: TrainFields) -> None:
    """Raises ConfigError when rollout.engine=vllm meets what a vLLM rollout worker cannot serve (docs/vllm.md)."""
    r = cfg.rollout
    if r.workers is None:
        raise ConfigError(
            "rollout.engine=vllm samples in rollout workers, and rollout.workers is unset: start `cohort serve "
            "--engine vllm --model PATH` on GPUs of their own and list their addresses in rollout.workers, or set "
            "rollout.engine=builtin to sample in the trainer"
        )
    if isinstance(r.workers, int) and not isinstance(r.workers, bool):
        raise ConfigError(
            f"rollout.workers={r.workers}: a trainer does not start vLLM workers itself (each needs GPUs the "
            "trainer does not use); start them with `CUDA_VISIBLE_DEVICES=... cohort serve --engine vllm --model "
            "PATH --port N` and list their addresses in rollout.workers"
        )
    if cfg.model.lora.enabled:
        raise ConfigError(
            "rollout.engine=vllm with model.lora.enabled: a vLLM worker does not take LoRA adapter pushes (not "
            "built); train the full model, or use rollout.engine=builtin"
        )
    filters = (isinstance(r.top_p, int | float) and r.top_p < 1.0) or (
        isinstance(r.top_k, int) and r.top_k > 0
    )
    if filters and r.temperature != 0:  # greedy sampling ignores both
        raise ConfigError(
            f"rollout.engine=vllm with rollout.top_p={r.top_p} / top_k={r.top_k}: vLLM reports log-probs after "
            "top-p / top-k renormalise the distribution and the trainer compares them with its own before; set "
            "rollout.top_p=1.0 and rollout.top_k=0, or use rollout.engine=builtin"
        )
    high, low = choices.VLLM_MAX_TEMPERATURE, choices.VLLM_MIN_TEMPERATURE
    if isinstance(r.temperature, int | float) and r.temperature > high:
        raise ConfigError(
            f"rollout.engine=vllm with rollout.temperature={r.temperature}: vLLM samples at temperatures up to "
            f"{high:g}; lower it, or use rollout.engine=builtin"
        )
    if isinstance(r.temperature, int | float) and 0 < r.temperature < low:
        raise ConfigError(
            f"rollout.engine=vllm with rollout.temperature={r.temperature}: vLLM raises a temperature under {low:g} "
            f"to {low:g}, so it would sample and report log-probs at {low:g} while the trainer recomputes at "
            f"{r.temperature}; set rollout.temperature >= {low:g} (or 0 for greedy), or use rollout.engine=builtin"
        )


def _check_beside_algo(cfg: TrainFields) -> None:
    """Raises ConfigError for a value of the sampler copy, iterative GRPO, process supervision or episodes that
    cannot work."""
    r = cfg.rollout
    if r.sampler_dtype is not None:
        _check_choice("rollout.sampler_dtype", str(r.sampler_dtype).lower(), SAMPLER_DTYPES)
    it = cfg.iterative
    if it.every < 0:
        raise ConfigError(f"iterative.every={it.every} must be >= 0 (0 turns iterative GRPO off)")
    if it.every:
        if not isinstance(it.labeler, str) or not it.labeler.strip():
            raise ConfigError(
                "iterative.every is set but iterative.labeler is empty: the fresh samples need a source of labels "
                "(a verifier reward such as accuracy, or your own 'module:function')"
            )
        for name in ("prompts", "max_pairs_per_prompt", "rm_steps", "rm_batch_size"):
            if getattr(it, name) < 1:
                raise ConfigError(f"iterative.{name}={getattr(it, name)} must be >= 1")
        if not 0 <= it.replay < 1:
            raise ConfigError(f"iterative.replay={it.replay} must be in [0, 1) (the seed's 10 %: 0.1)")
        check_optim(it.optim, "iterative.optim.")
        if (
            it.initial_data
            and Path(it.initial_data).suffix in (".jsonl", ".json")
            and not Path(it.initial_data).is_file()
        ):
            raise ConfigError(f"iterative.initial_data={it.initial_data!r} does not exist")
    if not isinstance(cfg.process.step_separator, str) or not cfg.process.step_separator:
        raise ConfigError(
            f"process.step_separator={cfg.process.step_separator!r} must be a non-empty string (e.g. '\\n')"
        )
    _check_episodes(cfg)


def _check_topk_source(cfg: TrainFields) -> None:
    """Raises ConfigError when algo.dppo_topk > 0 and the rollouts come from a source that cannot return each
    token's top-K log-probs: only the trainer's builtin engine does (not hf, rollout workers or episodes)."""
    k, r = cfg.algo.dppo_topk, cfg.rollout
    if isinstance(k, bool) or not isinstance(k, int) or k <= 0:
        return
    why = None
    if r.engine != "builtin":
        why = f"rollout.engine={r.engine!r} does not return them; set rollout.engine=builtin"
    elif r.workers is not None:
        why = (
            f"rollout workers (rollout.workers={r.workers!r}) do not return them; unset rollout.workers to sample "
            "with the trainer's builtin engine"
        )
    elif cfg.episodes.enabled:
        why = (
            "multi-turn episodes do not return them (their turn decoder does not); drop episodes.tools, "
            "episodes.environment and episodes.environments"
        )
    if why is not None:
        raise ConfigError(
            f"algo.dppo_topk={k} needs each sampled token's top-{k} log-probs from the rollout engine, and {why}, "
            "or algo.dppo_topk=0 for DPPO's binary mask"
        )


def _check_episodes(cfg: TrainFields) -> None:
    """Raises ConfigError for an episodes.* value that cannot work (the tools and factories themselves are
    imported and checked by the builder, still before the model loads)."""
    e = cfg.episodes
    if not isinstance(e.tools, list) or not all(isinstance(t, str) and t for t in e.tools):
        raise ConfigError(
            f"episodes.tools={e.tools!r} must be a list of tool names or 'module:function' strings"
        )
    if len(set(e.tools)) != len(e.tools):
        twice = sorted({t for t in e.tools if e.tools.count(t) > 1})
        raise ConfigError(f"episodes.tools lists {twice} more than once; list each tool once")
    if e.environment and e.environments:
        raise ConfigError(
            "episodes.environment and episodes.environments are both set; use environment for one factory, "
            "environments (name -> factory, rows routed by their `environment` column) for several"
        )
    if not isinstance(e.environments, dict) or not all(
        isinstance(k, str) and k and isinstance(v, str) and v for k, v in e.environments.items()
    ):
        raise ConfigError(
            f"episodes.environments={e.environments!r} must map names to 'module:Factory' strings"
        )
    n = e.max_tool_calling_iterations
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
        raise ConfigError(
            f"episodes.max_tool_calling_iterations={n!r} must be an int >= 0 (0: no tool is ever run) or null"
        )
    if e.tool_parser is not None and e.tool_parser not in choices.TOOL_PARSERS:
        raise ConfigError(
            f"episodes.tool_parser={e.tool_parser!r} is not a known tool-call format; choose one of "
            f"{list(choices.TOOL_PARSERS)} or leave it null to tell it from the chat template"
        )
    if (
        isinstance(e.tool_timeout, bool)
        or not isinstance(e.tool_timeout, int | float)
        or not e.tool_timeout > 0
    ):
        raise ConfigError(f"episodes.tool_timeout={e.tool_timeout!r} must be a positive number of seconds")
    chars = e.max_tool_result_chars
    if chars is not None and (isinstance(chars, bool) or not isinstance(chars, int) or chars < 64):
        raise ConfigError(
            f"episodes.max_tool_result_chars={chars!r} must be an int >= 64 (the truncation note must fit) or null"
        )
    if e.result_format not in choices.RESULT_FORMATS:
        raise ConfigError(
            f"episodes.result_format={e.result_format!r}: choose one of {list(choices.RESULT_FORMATS)}"
        )
    if not e.enabled:
        return
    if e.turn_rewards and not (e.environment or e.environments):
        raise ConfigError(
            "episodes.turn_rewards=true reads a TextEnvironment's per-turn rewards; set episodes.environment"
        )
    if cfg.rollout.engine != "builtin":
        raise ConfigError(
            f"rollout.engine={cfg.rollout.engine!r}: episodes are sampled by cohort's multi-turn decoder, which "
            "extends the builtin engine's KV cache across turns; set rollout.engine=builtin"
        )


def _check_ranges(cfg: TrainFields) -> None:
    """Raises ConfigError for a non-finite number anywhere, or a value outside its documented range."""
    for key, value in _leaves(cfg):
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{key}={value}: must be a finite number")
    r, o = cfg.rollout, cfg.optim
    if r.temperature == 0 and r.group_size > 1:
        raise ConfigError(
            f"rollout.temperature=0 decodes greedily: the {r.group_size} completions of a prompt would be "
            "identical, every advantage 0 and nothing learned; set rollout.temperature > 0 (1.0 is usual)"
        )
    _check_health(cfg)
    cur = cfg.curriculum
    if cur.enabled:
        if cur.min_samplings < 1:
            raise ConfigError(f"curriculum.min_samplings={cur.min_samplings} must be >= 1")
        if cur.retry_after < 1:
            raise ConfigError(
                f"curriculum.retry_after={cur.retry_after} must be >= 1 (steps before a set-aside prompt returns)"
            )
    checks = [
        *_optim_ranges(o, "optim."),
        ("save_every", cfg.save_every, cfg.save_every >= 0, ">= 0 (0 saves only at the end)"),
        ("keep_checkpoints", cfg.keep_checkpoints, cfg.keep_checkpoints >= 1, ">= 1"),
        ("eval_every", cfg.eval_every, cfg.eval_every >= 0, ">= 0 (0 evaluates only at the ends)"),
        ("eval_limit", cfg.eval_limit, cfg.eval_limit >= 1, ">= 1"),
        ("eval_k", cfg.eval_k, cfg.eval_k >= 1, ">= 1 (1: greedy accuracy only)"),
        ("num_samples_logged", cfg.num_samples_logged, cfg.num_samples_logged >= 0, ">= 0"),
        ("logging_steps", cfg.logging_steps, cfg.logging_steps >= 1, ">= 1"),
        ("eval_batch_size", cfg.eval_batch_size, cfg.eval_batch_size >= 1, ">= 1"),
        (
            "threads",
            cfg.threads,
            cfg.threads is None or cfg.threads >= 1,
            ">= 1, or null for torch's default",
        ),
        ("data.n_train", cfg.data.n_train, cfg.data.n_train >= 1, ">= 1"),
        ("data.n_eval", cfg.data.n_eval, cfg.data.n_eval >= 0, ">= 0"),
        (
            "data.max_prompt_length",
            cfg.data.max_prompt_length,
            cfg.data.max_prompt_length is None or cfg.data.max_prompt_length >= 1,
            ">= 1, or null to keep every prompt",
        ),
    ]
    _check_rules(checks)
    for key, seed in (("seed", cfg.seed), ("data.task_seed", cfg.data.task_seed)):
        if not 0 <= seed < 2**32:
            raise ConfigError(f"{key}={seed} must be in 0 .. 2**32 - 1 (torch and numpy seeds are 32-bit)")
    _check_out_dir(cfg.out_dir)
    if cfg.resume not in (None, "auto") and not str(cfg.resume).strip():
        raise ConfigError(
            "resume is an empty string: use resume=auto, a checkpoint folder, or leave it unset"
        )


def _check_health(cfg: TrainFields) -> None:
    """Raises ConfigError for an unknown health check name or a threshold outside its range."""
    h = cfg.health
    unknown = [name for name in h.off if name not in HEALTH_CHECKS]
    if unknown:
        raise ConfigError(
            f"health.off names unknown check(s) {unknown}; the checks are: {', '.join(HEALTH_CHECKS)}"
        )
    rules = [
        ("health.window", h.window, h.window >= 1, ">= 1"),
        ("health.zero_variance_max", h.zero_variance_max, 0 <= h.zero_variance_max <= 1, "in [0, 1]"),
        ("health.truncation_max", h.truncation_max, 0 <= h.truncation_max <= 1, "in [0, 1]"),
        ("health.clip_max", h.clip_max, 0 <= h.clip_max <= 1, "in [0, 1]"),
        ("health.collapse_max", h.collapse_max, 0 <= h.collapse_max <= 1, "in [0, 1]"),
        ("health.kl_early_max", h.kl_early_max, h.kl_early_max > 0, "> 0"),
        ("health.kl_early_steps", h.kl_early_steps, h.kl_early_steps >= 0, ">= 0"),
        ("health.kl_drift_ratio", h.kl_drift_ratio, h.kl_drift_ratio > 0, "> 0"),
        ("health.grad_spike", h.grad_spike, h.grad_spike > 1, "> 1"),
        ("health.length_ratio", h.length_ratio, h.length_ratio > 1, "> 1"),
        (
            "health.logprob_gap_max",
            h.logprob_gap_max,
            h.logprob_gap_max is None or h.logprob_gap_max > 0,
            "> 0 (or null: by the compute precision)",
        ),
    ]
    _check_rules(rules)


def _check_fast(cfg: TrainFields, cuda_available: bool = False) -> None:
    """Raises ConfigError for a fast-path setting that is invalid or that this config cannot honour."""
    f, m = cfg.fast, cfg.model
    try:
        f.check()
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if f.skip_zero_advantage == "on" and cfg.algo.beta > 0:
        raise ConfigError(
            f"fast.skip_zero_advantage=on with algo.beta={cfg.algo.beta}: at beta > 0 a zero-advantage row "
            "still has a KL gradient, so skipping it would change the update; set fast.skip_zero_advantage=auto"
        )
    if f.segments == "on" and m.attn_implementation != "sdpa":
        raise ConfigError(
            f"fast.segments=on needs model.attn_implementation=sdpa, got {m.attn_implementation!r}; "
            "set one of them differently"
        )
    if f.grouped == "on" and m.attn_implementation not in ("sdpa", "eager"):
        raise ConfigError(
            f"fast.grouped=on needs a custom attention mask (model.attn_implementation sdpa or eager), got "
            f"{m.attn_implementation!r}; set fast.grouped=auto"
        )
    float32 = DTYPE_NAMES.get(str(m.dtype).lower()) in ("float32", "auto")
    if f.packed_weights == "on" and (
        cfg.rollout.engine != "builtin"
        or not float32
        or m.device.startswith("cuda")
        or (m.device == "auto" and cuda_available)  # auto picks the GPU: it would fail mid-run
    ):
        raise ConfigError(
            "fast.packed_weights=on needs the builtin engine decoding float32 weights on a CPU "
            f"(rollout.engine={cfg.rollout.engine!r}, model.dtype={m.dtype!r}, model.device={m.device!r}); "
            "set fast.packed_weights=auto"
        )

    off_cuda = m.device == "cpu" or m.device.startswith("mps") or (m.device == "auto" and not cuda_available)
    if "on" in (f.graph_decode, f.compile_decode):
        why = _graph_decode_refusal(cfg, off_cuda)
        if why is not None and f.graph_decode == "on":
            raise FastPathConfigError(
                f"fast.graph_decode=on cannot run: {why}; set fast.graph_decode=auto or off"
            )
        if why is not None:
            raise FastPathConfigError(
                f"fast.compile_decode=on compiles the captured decode step, which cannot run: {why}; set "
                "fast.compile_decode=auto or off"
            )

    if f.cast_once == "on":
        why = None
        if off_cuda:
            why = f"it casts for CUDA autocast, and model.device={m.device!r} runs without autocast"
        elif not m.bf16_autocast:
            why = "model.bf16_autocast is off, so the forwards run in the weights' own dtype and nothing is cast"
        elif cfg.distributed.strategy == "fsdp":
            why = (
                f"distributed.strategy={cfg.distributed.strategy!r} shards the weights, which each forward "
                "gathers itself"
            )
        if why is not None:
            raise FastPathConfigError(f"fast.cast_once=on cannot run: {why}; set fast.cast_once=auto or off")

    if f.compile_update == "on":
        why = None
        if cfg.distributed.strategy == "fsdp":
            why = (
                f"distributed.strategy={cfg.distributed.strategy!r} shards the weights, which each FSDP unit "
                "gathers inside the forward"
            )
        elif m.gradient_checkpointing:
            why = "model.gradient_checkpointing is on, and the compiled forward does not recompute layers"
        elif off_cuda and f.unmasked_padding == "auto":
            why = (
                f"it compiles padded rows without a mask, and fast.unmasked_padding=auto keeps the mask off CUDA "
                f"(model.device={m.device!r}): set fast.unmasked_padding=on as well"
            )
        if why is not None:
            raise FastPathConfigError(
                f"fast.compile_update=on cannot run: {why}; or set fast.compile_update=auto or off"
            )


def _graph_decode_refusal(cfg: Any, off_cuda: bool) -> str | None:
    """Returns why the config alone shows the captured decode step cannot run (None: nothing does)."""
    m = cfg.model
    why = None
    if cfg.rollout.engine != "builtin":
        why = f"the builtin engine samples with it, and rollout.engine={cfg.rollout.engine!r}"
    elif off_cuda:
        why = f"CUDA graphs need a CUDA GPU, and model.device={m.device!r} decodes on the CPU"
    elif cfg.distributed.strategy == "fsdp":
        why = (
            f"distributed.strategy={cfg.distributed.strategy!r} shards the weights, and every forward of a "
            "sharded model gathers them with collectives"
        )
    elif m.attn_implementation not in (None, "sdpa"):
        why = f"it replaces sdpa's attention, and model.attn_implementation={m.attn_implementation!r}"
    elif cfg.algo.dppo_topk > 0:
        why = (
            f"algo.dppo_topk={cfg.algo.dppo_topk} asks for each token's top-K log-probs, which the captured "
            "step does not return"
        )
    return why


def _check_sinks(cfg: TrainFields) -> None:
    """Raises ConfigError when a metrics sink is asked for and its package is not installed (found, not imported:
    the run folder is not created for a run that would stop at its first log)."""
    for key, package, extra in (("tensorboard", "tensorboard", "tensorboard"), ("wandb", "wandb", "wandb")):
        if getattr(cfg, key) and importlib.util.find_spec(package) is None:
            raise ConfigError(
                f"{key}=true needs the {package} package: pip install 'cohort[{extra}]' (or {key}=false)"
            )


def _check_device(name: str) -> None:
    """Raises ConfigError when model.device is not auto or a device string torch can parse."""
    if name == "auto":
        return
    try:
        torch.device(name)
    except (RuntimeError, TypeError):
        raise ConfigError(
            f"model.device={name!r} is not a device; use auto, cpu, cuda, cuda:N (e.g. cuda:0) or mps"
        ) from None


def _check_out_dir(out_dir: str) -> None:
    """Raises ConfigError when out_dir is a file, sits under a file, or cannot be created or written."""
    if not str(out_dir).strip():
        raise ConfigError(
            "out_dir is empty: set it to the folder the run writes to, e.g. out_dir=runs/my-run"
        )
    path = Path(out_dir).expanduser()
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    if existing is None:
        return
    if not existing.is_dir():
        where = "is a file" if existing == path else f"sits under {str(existing)!r}, which is a file"
        raise ConfigError(f"out_dir={out_dir!r} {where}; choose a folder path for the run")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(
            f"out_dir={out_dir!r} cannot be written ({str(existing)!r} is not writable by this user); "
            "choose another out_dir"
        )


def _leaves(obj: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """Returns (dotted key, value) of every non-section field of a config dataclass, list items included."""
    out: list[tuple[str, Any]] = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            out += _leaves(value, f"{prefix}{f.name}.")
        elif isinstance(value, list):
            out += [(f"{prefix}{f.name}[{i}]", v) for i, v in enumerate(value)]
        else:
            out.append((prefix + f.name, value))
    return out


def _check_choice(key: str, value: Any, valid: tuple[str, ...]) -> None:
    """Raises ConfigError when `value` is not one of `valid`, listing them."""
    if value not in valid:
        raise ConfigError(f"{key}={value!r} is not valid; choose one of: {', '.join(valid)}")


def _reward_names(funcs: Any) -> list[str]:
    """Returns the names of reward functions given as specs or callables (one spec alone counts as a list)."""
    items = [funcs] if isinstance(funcs, str) or callable(funcs) else list(funcs)
    return [f if isinstance(f, str) else getattr(f, "__name__", type(f).__name__) for f in items]


def check_reward_weights(weights: Any, names: Sequence[str]) -> list[float]:
    """Returns the reward weights as floats (1.0 each when `weights` is None) after checking that there is one
    finite number per reward function `names` (ConfigError, a ValueError, otherwise)."""
    if weights is None:
        return [1.0] * len(names)
    if isinstance(weights, (str, bytes)) or not isinstance(weights, Sequence):
        raise ConfigError(
            f"reward_weights={weights!r} must be a list of numbers, one per reward function {list(names)}"
        )
    values = list(weights)
    if len(values) != len(names):
        raise ConfigError(
            f"reward_weights has {len(values)} values but there are {len(names)} reward functions {list(names)}: "
            "give one weight per function"
        )
    for i, (w, name) in enumerate(zip(values, names)):
        if isinstance(w, bool) or not isinstance(w, numbers.Real):
            raise ConfigError(
                f"reward_weights[{i}]={w!r} (for {name!r}) is not a number; give one float per function"
            )
        if not math.isfinite(w):
            raise ConfigError(
                f"reward_weights[{i}]={float(w)} (for {name!r}) is not finite; every weight must be a finite number "
                "(use 0 to switch a reward off)"
            )
    return [float(w) for w in values]
