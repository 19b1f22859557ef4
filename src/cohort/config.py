"""Typed run configuration: dataclasses, YAML files, dotted ``key=value`` overrides, validation.

One tree of dataclasses is the single source of truth for a run. It is built in this order, each layer
overriding the one before: field defaults, the named ``preset`` (see :mod:`cohort.presets`), the YAML
file, then command-line overrides such as ``algo.beta=0.04``. Every check that can be done without
loading a model is done in :meth:`TrainConfig.validate`, so a typo costs seconds, not a model load.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import types
import typing
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

from cohort.algo import COMBINE_MODES as REWARD_MODES
from cohort.algo import IMPORTANCE_LEVELS as IMPORTANCE
from cohort.algo import KL_KINDS, SCALES
from cohort.algo import STD_KINDS as STDS
from cohort.algo.controls import COV_METHODS, SAMPLER_CORRECTIONS
from cohort.choices import ENGINES
from cohort.errors import ConfigError, ConfigWarning
from cohort.fastpath.switches import FastConfig
from cohort.models import DTYPES
from cohort.optim import SCHEDULES
from cohort.presets import PRESETS, apply_preset
from cohort.rewards import reward_weights


@dataclass
class LoraConfig:
    """LoRA adapter settings (needs ``pip install cohort[peft]``)."""

    enabled: bool = False
    """Train a LoRA adapter instead of the full model; the reference is the base with the adapter off."""
    r: int = 16
    """Rank of the adapter matrices."""
    alpha: int = 32
    """LoRA scaling numerator (the update is scaled by alpha / r)."""
    dropout: float = 0.0
    """Dropout on the adapter input."""
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    """Names (last path component) of the Linear layers that get adapters."""

    def check(self) -> LoraConfig:
        """Return self after checking the adapter settings (raises ConfigError naming the bad key)."""
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r <= 0:
            raise ConfigError(f"model.lora.r={self.r!r} must be a positive integer (typical: 8, 16, 64)")
        if not self.alpha > 0:
            raise ConfigError(f"model.lora.alpha={self.alpha!r} must be > 0 (typical: 2 * r)")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.lora.dropout={self.dropout!r} must be in [0, 1)")
        if isinstance(self.target_modules, str) or not self.target_modules:
            raise ConfigError(
                f"model.lora.target_modules={self.target_modules!r} must be a non-empty list of module "
                "names, e.g. ['q_proj', 'v_proj']"
            )
        return self


@dataclass
class ModelConfig:
    """Which policy to train and how to load it."""

    name_or_path: str = ""
    """Local folder or hub name of any AutoModelForCausalLM (its tokenizer is loaded from the same place)."""
    dtype: str = "float32"
    """Parameter dtype: float32, bfloat16, float16 or auto."""
    attn_implementation: str = "sdpa"
    """Attention kernel passed to from_pretrained (sdpa, eager, flash_attention_2)."""
    trust_remote_code: bool = False
    """Allow model code from the hub (only for models you trust)."""
    device: str = "auto"
    """cpu, cuda, cuda:N or auto (CUDA when available)."""
    bf16_autocast: bool = True
    """On CUDA, run forward passes under bfloat16 autocast."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass instead of keeping them (transformers'
    non-reentrant checkpointing): less memory per micro-batch for about one more forward. The grouped layout
    and segment attention work with it (during an update the recomputed layers follow the same plan)."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapter settings."""


@dataclass
class DataConfig:
    """Where prompts come from."""

    task: str | None = None
    """Built-in synthetic task (addition, multistep); used when `path` is empty."""
    path: str | None = None
    """JSONL file, or a `datasets` name / folder, with a prompt column."""
    split: str = "train"
    """Split to read when `path` is a `datasets` dataset."""
    eval_path: str | None = None
    """Held-out JSONL / dataset for evaluation (a built-in task has its own held-out split)."""
    eval_split: str = "test"
    """Split of `eval_path` to read when it is a `datasets` dataset."""
    prompt_column: str = "prompt"
    """Column holding the prompt (text, or a list of chat messages); other columns reach rewards."""
    task_options: dict[str, Any] = field(default_factory=dict)
    """Parameters of the built-in task, e.g. {digits_a: 2, digits_b: 2} for addition."""
    n_train: int = 2000
    """Number of training problems a built-in task generates."""
    n_eval: int = 200
    """Number of held-out problems a built-in task generates (or the cap on eval rows read)."""
    task_seed: int = 1234
    """Seed of the built-in task's problem generator (fixes the train / held-out split)."""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments of the tokenizer's apply_chat_template, e.g. {enable_thinking: false}."""
    subset: str | None = None
    """Subset (configuration) of a `datasets` hub dataset, e.g. main for openai/gsm8k."""
    eval_subset: str | None = None
    """Subset of eval_path (None: `subset` when eval_path is path)."""
    chat_template: bool | None = None
    """Apply the tokenizer's chat template: None = only for conversational prompts."""
    max_prompt_length: int | None = None
    """Drop prompts longer than this many tokens (None keeps all)."""


@dataclass
class RolloutConfig:
    """How completions are sampled."""

    engine: str = "builtin"
    """builtin (KV-cache sampler, prompt prefilled once per group) or hf (transformers generate)."""
    group_size: int = 8
    """G: completions sampled per prompt."""
    batch_size: int = 64
    """Completions per training step (prompts per step = batch_size / group_size)."""
    max_completion_length: int = 256
    """Longest completion in tokens; longer ones are cut and flagged as truncated."""
    temperature: float = 1.0
    """Sampling temperature, 0 for greedy (log-probs in the loss use the same temperature, as TRL does)."""
    top_p: float = 1.0
    """Nucleus sampling mass (1.0 disables)."""
    top_k: int = 0
    """Keep only the k most likely tokens (0 disables)."""
    sampler_dtype: str | None = None
    """Sample from a copy of the policy in this dtype (bfloat16, float16, float32), synced before every rollout,
    as an inference engine would; None samples with the training weights. See algo.sampler_correction."""

    def logprob_temperature(self) -> float:
        """Return the temperature log-probs are computed at: `temperature`, or 1.0 when it is 0 (greedy sampling)."""
        return self.temperature if self.temperature > 0 else 1.0


SAMPLER_DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class AlgoConfig:
    """The GRPO-family objective (see docs/algorithms.md for every formula)."""

    loss_type: str = "grpo"
    """Policy loss: grpo, bnpo, dapo, dr_grpo (PPO's clip with that aggregation), cispo, sapo, gmpo, or your own
    'my_pkg.module:function' / 'file.py:function' (see cohort.algo.LossInputs for the signature)."""
    aggregation: str | None = None
    """How per-token losses are averaged: grpo, bnpo, dapo or dr_grpo; None uses the loss type's own (dapo for
    your own losses)."""
    loss_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword parameters of the loss: cispo {max_ratio: 5.0, min_ratio: null}, sapo {tau_pos: 1.0, tau_neg:
    1.05}, gmpo {clip: 0.4}, or your own loss's."""
    advantage: str = "grpo"
    """Advantage estimator: grpo (group z-score, with scale / std / adv_eps), rloo, reinforce_pp,
    reinforce_pp_baseline, or your own 'my_pkg.module:function'."""
    advantage_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of your own advantage estimator."""
    top_entropy_quantile: float = 1.0
    """Keep only this top share of each micro-batch's tokens by entropy in the policy loss ("Beyond the 80/20
    Rule" uses 0.2; 1.0 keeps every token)."""
    entropy_coef: float = 0.0
    """Entropy regularisation: subtract this times the mean per-token entropy from the loss (an exploration
    bonus; 0 is off). With adaptive_entropy it is the controller's starting coefficient."""
    adaptive_entropy: bool = False
    """Skywork-OR1's adaptive coefficient (TRL's use_adaptive_entropy): after each optimizer step it moves by
    entropy_coef_delta, up when the step's entropy was at or below entropy_target and down otherwise, within
    [entropy_coef_min, entropy_coef_max]; the bonus applies only while the last entropy is at or below the
    target."""
    entropy_target: float = 0.2
    """With adaptive_entropy: the mean per-token entropy (nats) the controller defends (TRL's default 0.2 acts
    only near collapse; a value near the early-training entropy acts sooner)."""
    entropy_coef_min: float = 0.0
    """With adaptive_entropy: the lowest coefficient."""
    entropy_coef_max: float = 1.0
    """With adaptive_entropy: the highest coefficient."""
    entropy_coef_delta: float = 0.005
    """With adaptive_entropy: the coefficient's change per optimizer step."""
    cov_method: str = "none"
    """Entropy control by covariance (Cui et al. 2025): none, clip_cov (detach the gradient of a few tokens of
    high log-prob/advantage covariance) or kl_cov (penalise |log(pi/pi_old)| on the top-covariance tokens)."""
    cov_ratio: float | None = None
    """Share of tokens clip_cov / kl_cov act on (None: the paper's, 2e-4 for clip_cov and 2e-3 for kl_cov)."""
    clip_cov_bounds: list[float] = field(default_factory=lambda: [1.0, 5.0])
    """clip_cov draws its tokens among those whose covariance lies in [low, high] (the paper's 1 and 5)."""
    kl_cov_coef: float = 1.0
    """kl_cov's penalty coefficient (the paper's 1)."""
    sampler_correction: str = "none"
    """Importance correction for a sampler whose log-probs differ from the trainer's (rollout.sampler_dtype):
    none, token_tis, sequence_tis (truncate the ratio at sampler_is_max) or token_mis, sequence_mis (drop
    tokens / sequences whose ratio leaves [sampler_is_min, sampler_is_max])."""
    sampler_is_max: float = 2.0
    """Upper bound of the sampler importance ratio (TIS's C = 2)."""
    sampler_is_min: float | None = None
    """Lower bound of the sampler importance ratio (None: none)."""

    def advantage_arguments(self) -> dict[str, Any]:
        """Return the keyword arguments the chosen advantage estimator is called with."""
        if self.advantage == "grpo":
            return {"scale": self.scale, "std": self.std, "eps": self.adv_eps}
        if self.advantage in ("reinforce_pp", "reinforce_pp_baseline"):
            return {"std": self.std, "eps": self.adv_eps}
        return dict(self.advantage_kwargs)  # rloo takes none; a user estimator its own

    scale: str = "group"
    """Advantage scaling: group (z-score), batch (std over the batch) or none (Dr. GRPO)."""
    std: str = "sample"
    """Standard deviation: sample (unbiased, TRL) or population (DeepSeekMath)."""
    adv_eps: float = 1e-4
    """Added to the std before dividing."""
    eps_low: float = 0.2
    """Lower clip range: the ratio is clipped at 1 - eps_low."""
    eps_high: float | None = None
    """Upper clip range (None = eps_low); DAPO's clip-higher uses 0.28."""
    delta: float | None = None
    """Two-sided clipping: cap the ratio at delta for negative advantages too (None disables)."""
    beta: float = 0.0
    """KL coefficient; 0 loads no reference model."""
    importance: str = "token"
    """Importance ratio: token (GRPO) or sequence (GSPO)."""
    num_iterations: int = 1
    """mu: optimisation passes over each generated batch."""
    num_minibatches: int = 1
    """Optimizer steps per pass (each over batch_size / num_minibatches completions)."""
    reward_mode: str = "sum"
    """How several rewards combine: sum (weighted) or decoupled (GDPO, per-reward normalisation)."""
    filter_zero_std: bool = False
    """Drop groups whose rewards are all equal from the loss (the batch shrinks; dynamic_sampling refills it)."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling with refill: groups whose rewards are all equal are dropped and groups for new
    prompts are generated (batched, in rounds) until the step holds rollout.batch_size / group_size groups
    with unequal rewards, or max_sampling_rounds is reached (then it trains on the groups it has)."""
    max_sampling_rounds: int = 4
    """With dynamic_sampling: generation rounds per step at most (the first included)."""
    mask_truncated: bool = False
    """Leave completions cut at max_completion_length out of the loss (DAPO overlong filtering)."""
    kl_estimator: str = "k3"
    """Per-token KL estimator of the beta term: k3 (DeepSeekMath's, unbiased, low variance), k2 (its gradient
    is that of the reverse KL it estimates) or k1 (log-ratio; regularises only through the reward)."""
    ref_update_every: int = 0
    """Sync the reference to the policy every this many steps (0 never); see cohort.reference."""
    ref_sync_kl: float | None = None
    """Sync the reference after a step whose mean per-token KL exceeds this (None never; seed 002 suggests 0.5)."""
    ref_mixup_alpha: float = 1.0
    """Each sync sets ref = alpha * policy + (1 - alpha) * ref (TRL's ref_model_mixup_alpha; 1 copies). Under
    LoRA the adapter parameters are mixed."""


@dataclass
class CurriculumConfig:
    """Setting aside prompts that are always or never solved (off by default; see cohort.curriculum)."""

    enabled: bool = False
    """Track each training prompt's pass rate and set aside those that every or no completion passed."""
    pass_threshold: float = 1.0
    """A completion passes when the first reward function scores it at least this (1.0: a correct answer)."""
    min_samplings: int = 1
    """Times a prompt must have been sampled (G completions each) before it can be set aside."""
    retry_after: int = 50
    """Steps a set-aside prompt waits before it returns to the pool and is judged afresh."""


@dataclass
class HealthConfig:
    """Live health checks (cohort.health): seed 002's failure modes, each with a threshold."""

    enabled: bool = True
    """Evaluate the checks every step (they reuse what the step computed: no extra forward pass)."""
    abort: bool = False
    """Stop the run, after saving a checkpoint, the first time a check fires (exit code 1)."""
    off: list[str] = field(default_factory=list)
    """Checks to skip, by name (see cohort.health.CHECKS)."""
    window: int = 20
    """Steps the rate checks average over (zero_variance, truncation, length_drift, surrogate_zero, grad_spike)."""
    zero_variance_max: float = 0.9
    """zero_variance fires when more than this share of groups had all-equal rewards over the window."""
    truncation_max: float = 0.5
    """truncation fires when more than this share of completions hit max_completion_length over the window."""
    clip_max: float = 0.3
    """clipping fires when more than this share of tokens had a clipped ratio (seed 002's pilot threshold)."""
    kl_early_max: float = 1.0
    """kl_early fires when the mean per-token KL exceeds this before step kl_early_steps (seed 002's pilot)."""
    kl_early_steps: int = 1000
    """See kl_early_max."""
    kl_drift_ratio: float = 1.0
    """kl_drift fires when beta * KL exceeds this many times the surrogate loss's magnitude."""
    grad_spike: float = 50.0
    """grad_spike fires when the gradient norm exceeds this many times the window's median (the demo's largest
    ratio is about 30: steps with few informative groups have tiny gradients)."""
    length_ratio: float = 3.0
    """length_drift fires when the window's mean completion length leaves [1/r, r] times the first window's."""
    collapse_max: float = 0.5
    """collapse fires when more than this share of groups have G identical completions below the best reward."""
    logprob_gap_max: float = 1e-3
    """logprob_gap fires when, at num_iterations = 1, the trainer's and the sampler's log-prob of a sampled
    token differ by more than this (float32 on a CPU: at most 3e-4 over the demo's 3000 steps, where fast paths
    sum in another order)."""


@dataclass
class ProcessConfig:
    """Process supervision: reward functions that score each reasoning step (see cohort.rewards.process)."""

    step_separator: str = "\n"
    """Where a step ends in the completion's text when a reward gives step rewards without explicit ends
    (also where a process reward model reads each step's score)."""


@dataclass
class IterativeConfig:
    """Iterative GRPO: reset the reference and retrain the reward model on fresh policy samples (cohort.iterative)."""

    every: int = 0
    """Steps between iterations (0: off)."""
    reward: str | None = None
    """The reward function (by name) that is the reward model to retrain; None: the run's only reward model."""
    labeler: str = "accuracy"
    """Reward spec that labels fresh completions (a verifier; it sees the dataset's columns)."""
    label_threshold: float = 1.0
    """A completion is correct when the labeler scores it at least this."""
    prompts: int = 16
    """Training prompts sampled afresh per iteration (G completions each)."""
    max_pairs_per_prompt: int = 8
    """(correct, incorrect) pairs kept per prompt."""
    replay: float = 0.1
    """Share of each retraining's examples drawn from earlier pairs (the replay buffer)."""
    initial_data: str | None = None
    """The reward model's earlier training pairs (prompt/chosen/rejected JSONL): the replay buffer's start."""
    rm_steps: int = 50
    """Reward-model optimizer steps per iteration."""
    rm_batch_size: int = 16
    """Pairs per reward-model step."""
    rm_lr: float = 1e-4
    """Reward-model learning rate (AdamW)."""


@dataclass
class DistributedConfig:
    """Multi-process training under torchrun (cohort.sharding; docs/usage.md, "Several processes")."""

    strategy: str = "auto"
    """auto (replicate under torchrun, nothing on one process), replicate (every process holds the whole model;
    FSDP all-reduces gradients), or fsdp (parameters, gradients and AdamW state sharded across processes)."""
    backend: str = "auto"
    """torch.distributed backend: auto (nccl with GPUs, gloo without), nccl, or gloo."""
    mixed_precision: str = "none"
    """FSDP's mixed-precision policy: none, bf16 or fp16 compute (gradients reduce in float32); meant for GPUs."""
    global_batch_size: int | None = None
    """Completions per step over all processes (each samples global_batch_size / processes); None: rollout.batch_size
    is each process's share. Keeps a run's batch when it is resumed on another number of processes."""


@dataclass
class OptimConfig:
    """AdamW and the learning-rate schedule."""

    lr: float = 1e-6
    """Peak learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.99
    """AdamW beta2."""
    adam_eps: float = 1e-8
    """AdamW epsilon."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this (0 disables)."""
    warmup_steps: int = 0
    """Linear warm-up steps."""
    schedule: str = "constant"
    """After warm-up: constant, linear (to 0) or cosine (to 0)."""


@dataclass
class TrainConfig:
    """A whole GRPO run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy."""
    data: DataConfig = field(default_factory=DataConfig)
    """The prompts."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Sampling."""
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    """The objective."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """The optimizer."""
    curriculum: CurriculumConfig = field(default_factory=CurriculumConfig)
    """Prompt selection by pass rate (off by default)."""
    health: HealthConfig = field(default_factory=HealthConfig)
    """Live health checks and their thresholds."""
    process: ProcessConfig = field(default_factory=ProcessConfig)
    """Process supervision (rewards per reasoning step)."""
    iterative: IterativeConfig = field(default_factory=IterativeConfig)
    """Iterative GRPO with a learned reward model (off by default)."""
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    """Multi-process training (strategy, backend, mixed precision, global batch)."""
    rewards: list[str] = field(default_factory=lambda: ["accuracy"])
    """Reward functions: built-in names (accuracy, format, overlong) or "module:function" / "file.py:function"."""
    reward_weights: list[float] | None = None
    """One weight per reward function (None = all 1.0)."""
    steps: int = 100
    """Training steps (one generation batch each)."""
    micro_batch_tokens: int = 8192
    """Token budget of one forward/backward (gradient accumulation splits larger minibatches)."""
    seed: int = 0
    """Seed for sampling, shuffling and initialisation."""
    out_dir: str = "runs/cohort"
    """Run directory: config, metrics, report, checkpoints."""
    save_every: int = 50
    """Checkpoint every this many steps (and always at the end)."""
    keep_checkpoints: int = 2
    """How many step checkpoints to keep on disk."""
    resume: str | None = None
    """Resume from a checkpoint folder, or "auto" for the latest one in out_dir that loads (without one,
    an out_dir that already holds a run is refused)."""
    allow_config_change: bool = False
    """On resume, continue even though the config differs from the checkpoint's (beyond steps, logging,
    saving and fast-path keys, which may always change); without it the differences are listed and refused."""
    eval_every: int = 0
    """Greedy held-out accuracy every this many steps (0: only at the start and end when eval_at_ends)."""
    eval_at_ends: bool = True
    """Evaluate held-out accuracy before the first and after the last step."""
    eval_limit: int = 200
    """Evaluate on at most this many held-out rows."""
    eval_batch_size: int = 64
    """Completions generated at once when evaluating (TRL's per_device_eval_batch_size; memory, not results)."""
    num_samples_logged: int = 4
    """Completions logged per step to samples.jsonl (and TensorBoard / W&B), as whole groups: the G completions
    of ceil(num_samples_logged / G) prompts, each with every reward function's score and its advantage."""
    tensorboard: bool = False
    """Also log to TensorBoard (out_dir/tb)."""
    wandb: bool = False
    """Also log to Weights & Biases."""
    wandb_project: str = "cohort"
    """W&B project name."""
    progress: bool = True
    """Show progress: a live bar in a terminal, plain log lines (every logging_steps steps) when stdout is not
    one (nohup, SLURM, CI), and a line per held-out evaluation; false prints none of them."""
    logging_steps: int = 10
    """When stdout is not a terminal, print a plain progress line (step, reward, KL, length, s/step, ETA) every
    this many steps and at the last step; metrics.jsonl still gets every step."""
    threads: int | None = None
    """torch.set_num_threads (None leaves torch's default)."""
    fast: FastConfig = field(default_factory=FastConfig)
    """Switches (auto | on | off) and thresholds of the fast paths (cohort.fastpath; docs/architecture.md)."""
    preset: str | None = None
    """Named recipe applied before the file and overrides (cohort.presets): r1, dapo, dr_grpo, gspo, cispo,
    sapo, gmpo, rloo, reinforce_pp, top_entropy, clip_cov, kl_cov, ppo_classic."""

    @property
    def prompts_per_step(self) -> int:
        """Return the number of distinct prompts sampled per step."""
        return self.rollout.batch_size // self.rollout.group_size

    def validate(
        self,
        *,
        need_model: bool = True,
        need_data: bool = True,
        reward_funcs: Sequence[str | Callable] | None = None,
    ) -> TrainConfig:
        """Return self after checking every value that can be checked before a model is loaded.

        `reward_funcs`: the reward functions the run uses instead of `rewards` (GRPOTrainer's argument of
        that name); `reward_weights` must then give one weight per one of them.
        """
        r, a, o = self.rollout, self.algo, self.optim
        self._validate_distributed()  # first: a global batch sets rollout.batch_size
        if need_model and not self.model.name_or_path:
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
        if r.temperature < 0:
            raise ConfigError(f"rollout.temperature={r.temperature} must be >= 0")
        if not 0 < r.top_p <= 1:
            raise ConfigError(f"rollout.top_p={r.top_p} must be in (0, 1]")
        _check_choice("rollout.engine", r.engine, ENGINES)
        _check_choice("algo.scale", a.scale, SCALES)
        _check_choice("algo.std", a.std, STDS)
        _check_choice("algo.importance", a.importance, IMPORTANCE)
        _check_choice("algo.kl_estimator", a.kl_estimator, KL_KINDS)
        _check_choice("algo.reward_mode", a.reward_mode, REWARD_MODES)
        _check_choice("optim.schedule", o.schedule, SCHEDULES)
        _check_choice("model.dtype", str(self.model.dtype).lower(), tuple(DTYPES))
        _check_device(self.model.device)
        if self.model.lora.enabled:
            self.model.lora.check()
        attn = self.model.attn_implementation
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
        if self.steps < 1:
            raise ConfigError(f"steps={self.steps} must be >= 1")
        if self.micro_batch_tokens < 1:
            raise ConfigError(f"micro_batch_tokens={self.micro_batch_tokens} must be >= 1")
        if o.lr <= 0:
            raise ConfigError(f"optim.lr={o.lr} must be > 0")
        if not self.rewards and not reward_funcs:
            raise ConfigError("rewards is empty: name at least one reward function, e.g. rewards=[accuracy]")
        try:
            reward_weights(self.reward_weights, reward_funcs or self.rewards)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if need_data and not self.data.task and not self.data.path:
            raise ConfigError(
                "no prompts: set data.path to a JSONL file / datasets name, or data.task to a built-in "
                "task (addition, multistep)"
            )
        self._validate_ranges()
        self._validate_objective()
        self._validate_fast()
        for key, value, why, error in inert_options(self):
            message = f"{key}={value!r} changes nothing in this configuration: {why}"
            if error:
                raise ConfigError(message)
            warnings.warn(message, ConfigWarning, stacklevel=2)
        if self.preset is not None:
            _check_choice("preset", self.preset, tuple(PRESETS))
        return self

    def _validate_distributed(self) -> None:
        """Raises ConfigError for a multi-process setting that cannot run with torchrun's process count here;
        sets rollout.batch_size from distributed.global_batch_size."""
        from cohort.sharding import MIXED_PRECISION, resolve_strategy

        d, r = self.distributed, self.rollout
        world = _world_size()
        strategy = resolve_strategy(d.strategy, world)
        _check_choice("distributed.backend", d.backend, ("auto", "gloo", "nccl"))
        _check_choice("distributed.mixed_precision", d.mixed_precision, tuple(MIXED_PRECISION))
        if d.backend == "nccl" and world > 1 and not torch.cuda.is_available():
            raise ConfigError(
                "distributed.backend=nccl needs CUDA GPUs, and this machine has none visible; set "
                "distributed.backend=gloo (or auto) to train on CPUs"
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
            r.batch_size = d.global_batch_size // world
        if strategy != "none":
            if r.sampler_dtype is not None and str(r.sampler_dtype).lower() not in (
                "none",
                str(self.model.dtype).lower(),
            ):
                raise ConfigError(
                    f"rollout.sampler_dtype cannot run under distributed.strategy={strategy}: the sampling copy "
                    "would hold the whole model on every process; leave it unset, or train on one process"
                )
            if self.model.lora.enabled and (self.algo.ref_update_every or self.algo.ref_sync_kl is not None):
                raise ConfigError(
                    "a LoRA reference that follows the policy adds a second adapter during the run, which a model "
                    "already wrapped by FSDP cannot take; set algo.ref_update_every=0 and algo.ref_sync_kl=null "
                    "under torchrun, or train the full model"
                )
            if self.iterative.every:
                raise ConfigError(
                    "iterative GRPO retrains its reward model on one process; set iterative.every=0 under torchrun"
                )

    def _validate_objective(self) -> None:
        """Raises ConfigError for a loss, advantage estimator, entropy control or sampler correction that cannot
        run as configured (user code named by spec is imported and its signature checked here)."""
        from cohort.algo import AGGREGATIONS, POLICY_LOSSES, clip_loss
        from cohort.plugins import resolve_advantage, resolve_loss

        a, r = self.algo, self.rollout
        for key in ("loss_kwargs", "advantage_kwargs"):
            if not isinstance(getattr(a, key), dict):
                raise ConfigError(f"algo.{key}={getattr(a, key)!r} must be a mapping of keyword arguments")
        from cohort.algo.estimators import ADVANTAGE_TYPES

        if a.advantage in ADVANTAGE_TYPES and a.advantage_kwargs:
            raise ConfigError(
                f"algo.advantage_kwargs={a.advantage_kwargs!r} is for your own estimator; the built-in "
                f"{a.advantage!r} reads algo.std and algo.adv_eps (grpo also algo.scale)"
            )
        try:
            resolve_loss(a.loss_type, a.loss_kwargs)
            resolve_advantage(a.advantage, a.advantage_arguments())
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if a.aggregation is not None:
            _check_choice("algo.aggregation", a.aggregation, AGGREGATIONS)
        spec = POLICY_LOSSES[a.loss_type]
        if spec.fn is not clip_loss:
            for key, value in (("delta", a.delta), ("eps_high", a.eps_high)):
                if value is not None:
                    raise ConfigError(
                        f"algo.{key}={value} belongs to PPO's clip loss, which loss_type={a.loss_type!r} does not use; "
                        f"set algo.{key}=null (its own parameters go in algo.loss_kwargs)"
                    )
        if spec.token_importance and a.importance != "token":
            raise ConfigError(
                f"loss_type={a.loss_type!r} is built on token-level ratios; set algo.importance=token"
            )
        if a.advantage != "grpo":
            if a.scale != "group":
                raise ConfigError(
                    f"algo.scale={a.scale!r} applies to the grpo estimator; algo.advantage={a.advantage!r} "
                    "has its own normalisation: set algo.scale=group"
                )
            if a.reward_mode != "sum":
                raise ConfigError(
                    f"algo.reward_mode={a.reward_mode!r} computes GDPO's own advantages; it needs "
                    f"algo.advantage=grpo, not {a.advantage!r}"
                )
        if not 0 < a.top_entropy_quantile <= 1:
            raise ConfigError(
                f"algo.top_entropy_quantile={a.top_entropy_quantile} must be in (0, 1] (the share of highest-"
                "entropy tokens kept; the paper uses 0.2, 1.0 keeps all)"
            )
        _check_entropy_regularisation(a)
        _check_choice("algo.cov_method", a.cov_method, COV_METHODS)
        if a.cov_ratio is not None and not 0 < a.cov_ratio <= 1:
            raise ConfigError(
                f"algo.cov_ratio={a.cov_ratio} must be in (0, 1] (clip_cov: 2e-4, kl_cov: 2e-3)"
            )
        bounds = a.clip_cov_bounds
        if (
            not isinstance(bounds, (list, tuple))
            or len(bounds) != 2
            or not all(isinstance(b, (int, float)) and not isinstance(b, bool) for b in bounds)
            or not bounds[0] < bounds[1]
        ):
            raise ConfigError(
                f"algo.clip_cov_bounds={bounds!r} must be [low, high] with low < high (the paper's [1, 5])"
            )
        if a.kl_cov_coef < 0:
            raise ConfigError(f"algo.kl_cov_coef={a.kl_cov_coef} must be >= 0 (the paper uses 1)")
        if a.cov_method == "kl_cov" and a.num_iterations * a.num_minibatches == 1:
            raise ConfigError(
                "algo.cov_method=kl_cov penalises |log(pi/pi_old)|, which is 0 (with no gradient) when each batch "
                "makes one optimizer step; set algo.num_minibatches or algo.num_iterations above 1"
            )
        _check_choice("algo.sampler_correction", a.sampler_correction, tuple(SAMPLER_CORRECTIONS))
        if not a.sampler_is_max > 1:
            raise ConfigError(f"algo.sampler_is_max={a.sampler_is_max} must be > 1 (TIS uses 2)")
        if a.sampler_is_min is not None and not 0 <= a.sampler_is_min < 1:
            raise ConfigError(f"algo.sampler_is_min={a.sampler_is_min} must be in [0, 1), or null")
        if r.sampler_dtype is not None:
            _check_choice("rollout.sampler_dtype", str(r.sampler_dtype).lower(), SAMPLER_DTYPES)
        it = self.iterative
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
            if not it.rm_lr > 0:
                raise ConfigError(f"iterative.rm_lr={it.rm_lr} must be > 0")
            if (
                it.initial_data
                and Path(it.initial_data).suffix in (".jsonl", ".json")
                and not Path(it.initial_data).is_file()
            ):
                raise ConfigError(f"iterative.initial_data={it.initial_data!r} does not exist")
        if not isinstance(self.process.step_separator, str) or not self.process.step_separator:
            raise ConfigError(
                f"process.step_separator={self.process.step_separator!r} must be a non-empty string (e.g. '\\n')"
            )

    def _validate_ranges(self) -> None:
        """Raises ConfigError for a non-finite number anywhere, or a value outside its documented range."""
        for key, value in _leaves(self):
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"{key}={value}: must be a finite number")
        r, a, o = self.rollout, self.algo, self.optim
        if r.temperature == 0 and r.group_size > 1:
            raise ConfigError(
                f"rollout.temperature=0 decodes greedily: the {r.group_size} completions of a prompt would be "
                "identical, every advantage 0 and nothing learned; set rollout.temperature > 0 (1.0 is usual)"
            )
        if not 0 <= a.eps_low < 1:
            raise ConfigError(
                f"algo.eps_low={a.eps_low} must be in [0, 1) (the ratio is clipped at 1 - eps_low; 0.2 is usual)"
            )
        if a.eps_high is not None and a.eps_high < 0:
            raise ConfigError(f"algo.eps_high={a.eps_high} must be >= 0 (DAPO's clip-higher uses 0.28)")
        high = a.eps_low if a.eps_high is None else a.eps_high
        if a.delta is not None and not a.delta > 1 + high:
            raise ConfigError(
                f"algo.delta={a.delta} must be > 1 + eps_high = {1 + high} (e.g. 4.0), or null to disable it"
            )
        if not a.adv_eps > 0:
            raise ConfigError(
                f"algo.adv_eps={a.adv_eps} must be > 0 (it keeps the std division finite; 1e-4 is usual)"
            )
        if a.ref_update_every < 0:
            raise ConfigError(
                f"algo.ref_update_every={a.ref_update_every} must be >= 0 (0 never copies the policy)"
            )
        if a.ref_sync_kl is not None and not a.ref_sync_kl > 0:
            raise ConfigError(
                f"algo.ref_sync_kl={a.ref_sync_kl} must be > 0 (the mean per-token KL above which the reference "
                "syncs; seed 002 suggests 0.5), or null"
            )
        if not 0 < a.ref_mixup_alpha <= 1:
            raise ConfigError(
                f"algo.ref_mixup_alpha={a.ref_mixup_alpha} must be in (0, 1] (1 copies the policy; TRL uses 0.6)"
            )
        if a.max_sampling_rounds < 1:
            raise ConfigError(f"algo.max_sampling_rounds={a.max_sampling_rounds} must be >= 1")
        self._validate_health()
        cur = self.curriculum
        if cur.enabled:
            if cur.min_samplings < 1:
                raise ConfigError(f"curriculum.min_samplings={cur.min_samplings} must be >= 1")
            if cur.retry_after < 1:
                raise ConfigError(
                    f"curriculum.retry_after={cur.retry_after} must be >= 1 (steps before a set-aside prompt returns)"
                )
        checks = [
            ("optim.weight_decay", o.weight_decay, o.weight_decay >= 0, ">= 0"),
            ("optim.adam_beta1", o.adam_beta1, 0 <= o.adam_beta1 < 1, "in [0, 1)"),
            ("optim.adam_beta2", o.adam_beta2, 0 <= o.adam_beta2 < 1, "in [0, 1)"),
            ("optim.adam_eps", o.adam_eps, o.adam_eps > 0, "> 0"),
            ("optim.max_grad_norm", o.max_grad_norm, o.max_grad_norm >= 0, ">= 0 (0 disables clipping)"),
            ("optim.warmup_steps", o.warmup_steps, o.warmup_steps >= 0, ">= 0"),
            ("rollout.top_k", r.top_k, r.top_k >= 0, ">= 0 (0 disables it)"),
            ("save_every", self.save_every, self.save_every >= 0, ">= 0 (0 saves only at the end)"),
            ("keep_checkpoints", self.keep_checkpoints, self.keep_checkpoints >= 1, ">= 1"),
            ("eval_every", self.eval_every, self.eval_every >= 0, ">= 0 (0 evaluates only at the ends)"),
            ("eval_limit", self.eval_limit, self.eval_limit >= 1, ">= 1"),
            ("num_samples_logged", self.num_samples_logged, self.num_samples_logged >= 0, ">= 0"),
            ("logging_steps", self.logging_steps, self.logging_steps >= 1, ">= 1"),
            ("eval_batch_size", self.eval_batch_size, self.eval_batch_size >= 1, ">= 1"),
            (
                "threads",
                self.threads,
                self.threads is None or self.threads >= 1,
                ">= 1, or null for torch's default",
            ),
            ("data.n_train", self.data.n_train, self.data.n_train >= 1, ">= 1"),
            ("data.n_eval", self.data.n_eval, self.data.n_eval >= 0, ">= 0"),
            (
                "data.max_prompt_length",
                self.data.max_prompt_length,
                self.data.max_prompt_length is None or self.data.max_prompt_length >= 1,
                ">= 1, or null to keep every prompt",
            ),
        ]
        for key, value, ok, rule in checks:
            if not ok:
                raise ConfigError(f"{key}={value} must be {rule}")
        for key, seed in (("seed", self.seed), ("data.task_seed", self.data.task_seed)):
            if not 0 <= seed < 2**32:
                raise ConfigError(
                    f"{key}={seed} must be in 0 .. 2**32 - 1 (torch and numpy seeds are 32-bit)"
                )
        _check_out_dir(self.out_dir)
        if self.resume not in (None, "auto") and not str(self.resume).strip():
            raise ConfigError(
                "resume is an empty string: use resume=auto, a checkpoint folder, or leave it unset"
            )

    def _validate_health(self) -> None:
        """Raises ConfigError for an unknown health check name or a threshold outside its range."""
        from cohort.health import CHECKS  # the check names live with the checks

        h = self.health
        unknown = [name for name in h.off if name not in CHECKS]
        if unknown:
            raise ConfigError(
                f"health.off names unknown check(s) {unknown}; the checks are: {', '.join(CHECKS)}"
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
            ("health.logprob_gap_max", h.logprob_gap_max, h.logprob_gap_max > 0, "> 0"),
        ]
        for key, value, ok, rule in rules:
            if not ok:
                raise ConfigError(f"{key}={value} must be {rule}")

    def _validate_fast(self) -> None:
        """Raises ConfigError for a fast-path setting that is invalid or that this config cannot honour."""
        f, m = self.fast, self.model
        try:
            f.validate()
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if f.skip_zero_advantage == "on" and self.algo.beta > 0:
            raise ConfigError(
                f"fast.skip_zero_advantage=on with algo.beta={self.algo.beta}: at beta > 0 a zero-advantage row "
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
        float32 = DTYPES.get(str(m.dtype).lower()) in (torch.float32, "auto")
        if f.packed_weights == "on" and (
            self.rollout.engine != "builtin" or not float32 or m.device.startswith("cuda")
        ):
            raise ConfigError(
                "fast.packed_weights=on needs the builtin engine decoding float32 weights on a CPU "
                f"(rollout.engine={self.rollout.engine!r}, model.dtype={m.dtype!r}, model.device={m.device!r}); "
                "set fast.packed_weights=auto"
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


ATTENTION_KINDS = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention")
"""transformers' attention implementations (a hub kernel 'org/name' is passed through as well)."""

MOVED_KEYS: dict[str, str] = {
    "rollout.packed_weights": "fast.packed_weights",
    "malloc_mmap_threshold_mib": "fast.heap_mmap_threshold_mib",
}
"""Keys that moved, and where to: an old config naming one gets an error pointing at the new key."""


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


def _check_entropy_regularisation(a: AlgoConfig) -> None:
    """Raises ConfigError for entropy-regularisation settings that cannot work."""
    for key in (
        "entropy_coef",
        "entropy_target",
        "entropy_coef_min",
        "entropy_coef_max",
        "entropy_coef_delta",
    ):
        value = getattr(a, key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(f"algo.{key}={value!r} must be a finite number")
    if not a.adaptive_entropy:
        return
    if a.entropy_coef_delta <= 0:
        raise ConfigError(
            f"algo.entropy_coef_delta={a.entropy_coef_delta} must be > 0 (the adaptive coefficient's step; "
            "TRL's default is 0.005)"
        )
    if a.entropy_coef_min > a.entropy_coef_max:
        raise ConfigError(
            f"algo.entropy_coef_min={a.entropy_coef_min} is above algo.entropy_coef_max={a.entropy_coef_max}; "
            "the adaptive coefficient stays within [min, max]"
        )
    if a.entropy_target < 0:
        raise ConfigError(
            f"algo.entropy_target={a.entropy_target} must be >= 0 (a mean per-token entropy in nats)"
        )


def _check_choice(key: str, value: Any, valid: tuple[str, ...]) -> None:
    if value not in valid:
        raise ConfigError(f"{key}={value!r} is not valid; choose one of: {', '.join(valid)}")


# ---------------------------------------------------------------------------- loading and overrides


@dataclass(frozen=True)
class Inert:
    """An option that changes nothing in some configurations: `why(cfg)` says why (None: it has an effect here)."""

    key: str
    """Dotted config key."""
    why: Callable[[TrainConfig], str | None]
    """Returns the reason and the fix when the option is inert in `cfg`, else None."""
    error: bool = False
    """True: refusing is right (the setting contradicts another); False: a ConfigWarning."""


def _world_size() -> int:
    """Returns torchrun's process count (1 outside torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def _no_reference(cfg: TrainConfig) -> str | None:
    return (
        "algo.beta=0 runs no reference model (no KL penalty); set algo.beta > 0 or drop this key"
        if (cfg.algo.beta == 0)
        else None
    )


def _estimator_ignores(name: str) -> Callable[[TrainConfig], str | None]:
    def why(cfg: TrainConfig) -> str | None:
        a = cfg.algo
        if name in a.advantage_arguments() or (name == "adv_eps" and "eps" in a.advantage_arguments()):
            return None
        return (
            f"algo.advantage={a.advantage!r} does not read algo.{name} (drop it, or pick grpo / reinforce_pp)"
        )

    return why


INERT_OPTIONS: tuple[Inert, ...] = (
    Inert("algo.kl_estimator", _no_reference),
    Inert("algo.ref_update_every", _no_reference, error=True),
    Inert("algo.ref_sync_kl", _no_reference, error=True),
    Inert(
        "algo.ref_mixup_alpha",
        lambda c: (
            None
            if c.algo.ref_update_every or c.algo.ref_sync_kl is not None
            else "the reference never syncs; set algo.ref_update_every or algo.ref_sync_kl too"
        ),
        error=True,
    ),
    Inert(
        "algo.max_sampling_rounds",
        lambda c: (
            None
            if c.algo.dynamic_sampling
            else "only dynamic sampling draws more than one round; set algo.dynamic_sampling=true or drop this key"
        ),
    ),
    Inert(
        "algo.scale",
        lambda c: (
            "algo.reward_mode=decoupled (GDPO) normalises each reward in its group and the sum over the "
            "batch itself; drop this key"
            if c.algo.reward_mode == "decoupled"
            else None
        ),
    ),
    *(
        Inert(
            f"algo.{key}",
            lambda c: (
                None
                if c.algo.adaptive_entropy
                else "only the adaptive entropy coefficient reads it; set algo.adaptive_entropy=true or drop this key"
            ),
        )
        for key in ("entropy_target", "entropy_coef_min", "entropy_coef_max", "entropy_coef_delta")
    ),
    Inert("algo.std", _estimator_ignores("std")),
    Inert("algo.adv_eps", _estimator_ignores("adv_eps")),
    Inert(
        "algo.sampler_correction",
        lambda c: (
            None
            if c.rollout.sampler_dtype not in (None, "none", str(c.model.dtype)) or c.rollout.engine == "vllm"
            else "the completions are sampled by the weights being trained, in their precision, so the sampler and "
            "the trainer differ only by rounding; set rollout.sampler_dtype (a low-precision sampling copy) or "
            "rollout.engine=vllm, or drop this key"
        ),
    ),
    Inert(
        "algo.sampler_is_max",
        lambda c: (
            "algo.sampler_correction=none applies no ratio" if c.algo.sampler_correction == "none" else None
        ),
    ),
    Inert(
        "algo.sampler_is_min",
        lambda c: (
            None
            if c.algo.sampler_correction.endswith("_mis")
            else "only the masking corrections (token_mis, sequence_mis) have a lower bound"
        ),
    ),
    Inert(
        "algo.cov_ratio",
        lambda c: (
            "algo.cov_method=none selects no tokens; set algo.cov_method"
            if c.algo.cov_method == "none"
            else None
        ),
    ),
    Inert(
        "algo.clip_cov_bounds",
        lambda c: (
            None if c.algo.cov_method == "clip_cov" else "only algo.cov_method=clip_cov reads these bounds"
        ),
    ),
    Inert(
        "algo.kl_cov_coef",
        lambda c: (
            None if c.algo.cov_method == "kl_cov" else "only algo.cov_method=kl_cov reads this coefficient"
        ),
    ),
    Inert(
        "distributed.backend",
        lambda c: (
            "a one-process run opens no process group (launch with torchrun to use it)"
            if _world_size() == 1
            else None
        ),
    ),
)
"""Every option that can be accepted yet change nothing, with why: the one place such checks live."""


def inert_options(cfg: TrainConfig) -> list[tuple[str, Any, str, bool]]:
    """Returns (key, value, why, is_error) for each option set away from its default that changes nothing in `cfg`."""
    default = TrainConfig()
    out = []
    for rule in INERT_OPTIONS:
        value, base = _dotted(cfg, rule.key), _dotted(default, rule.key)
        if value == base:
            continue
        why = rule.why(cfg)
        if why is not None:
            out.append((rule.key, value, why, rule.error))
    return out


def _dotted(obj: Any, key: str) -> Any:
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def field_docs(cls: type) -> dict[str, str]:
    """Return {field name: docstring} for a config dataclass, read from its source."""
    import ast
    import inspect
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for prev, node in zip(body, body[1:]):
        if (
            isinstance(prev, ast.AnnAssign)
            and isinstance(prev.target, ast.Name)
            and isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
        ):
            docs[prev.target.id] = str(node.value.value)
    return docs


def _valid_keys(cls: type, prefix: str = "") -> list[str]:
    keys = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        t = hints[f.name]
        if isinstance(t, type) and dataclasses.is_dataclass(t):
            keys += _valid_keys(t, f"{prefix}{f.name}.")
        else:
            keys.append(prefix + f.name)
    return keys


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Return `value` converted to the annotated type `tp`, or raise ConfigError naming `key`."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{key}: cannot use {value!r}")
    if origin is list:
        if isinstance(value, str):
            value = yaml.safe_load(value) if value.startswith("[") else [v for v in value.split(",") if v]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}={value!r}: expected a list, e.g. {key}=[a,b]")
        return [_coerce(v, args[0], key) for v in value] if args else list(value)
    if origin is dict or tp is dict:
        if isinstance(value, str):
            value = yaml.safe_load(value)
        if not isinstance(value, dict):
            raise ConfigError(f"{key}={value!r}: expected a mapping, e.g. {key}={{a: 1}}")
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
            return value.lower() in ("true", "1", "yes", "on")
        raise ConfigError(f"{key}={value!r}: expected true or false")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{key}={value!r}: expected an integer")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                f = float(value)
            except ValueError:
                f = None
            if f is not None and f.is_integer():
                return int(f)
        raise ConfigError(f"{key}={value!r}: expected an integer")
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{key}={value!r}: expected a number")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}={value!r}: expected a number") from None
    if tp is str:
        if isinstance(value, bool):  # YAML 1.1 reads a bare on / off (yes / no) as a boolean
            return "on" if value else "off"
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{key}={value!r}: expected a string")
        return str(value)
    return value


def _apply(obj: Any, values: dict[str, Any], prefix: str = "") -> None:
    hints = typing.get_type_hints(type(obj))
    names = {f.name for f in dataclasses.fields(obj)}
    for k, v in values.items():
        key = prefix + k
        if k not in names:
            if key in MOVED_KEYS:
                raise ConfigError(
                    f"config key {key!r} moved to {MOVED_KEYS[key]!r} (the fast-path switchboard, "
                    f"auto | on | off for switches); rename it"
                )
            raise ConfigError(_unknown_key_message(key, _valid_keys(type(obj), prefix)))
        tp = hints[k]
        if dataclasses.is_dataclass(tp):
            if not isinstance(v, dict):
                raise ConfigError(
                    f"{key} is a section; give its keys, e.g. {key}.{dataclasses.fields(tp)[0].name}=..."
                )
            _apply(getattr(obj, k), v, key + ".")
        else:
            setattr(obj, k, _coerce(v, tp, key))


def describe_keys(cls: type = TrainConfig, prefix: str = "", obj: Any = None) -> list[tuple[str, Any, str]]:
    """Returns (dotted key, default, docstring) for every key of the config tree, in declaration order."""
    obj = cls() if obj is None else obj
    docs = field_docs(cls)
    hints = typing.get_type_hints(cls)
    out: list[tuple[str, Any, str]] = []
    for f in dataclasses.fields(cls):
        t = hints[f.name]
        if isinstance(t, type) and dataclasses.is_dataclass(t):
            out += describe_keys(t, f"{prefix}{f.name}.", getattr(obj, f.name))
        else:
            out.append((prefix + f.name, getattr(obj, f.name), docs.get(f.name, "")))
    return out


def _unknown_key_message(key: str, valid: list[str]) -> str:
    """Returns the error for an unknown key: the closest valid keys, or the cohort twin of a TRL field name."""
    from cohort.compat import TRL_FIELDS  # compat builds on this module: imported only for this message

    leaf = key.rsplit(".", 1)[-1]
    trl = TRL_FIELDS.get(leaf)
    if trl is not None and trl.cohort is not None and trl.cohort.startswith("state."):
        return (
            f"unknown config key {key!r}: TRL's {leaf!r} belongs to the Python API (GRPOConfig({leaf}=...), read "
            f"by callbacks): {trl.note}"
        )
    if trl is not None and trl.cohort is not None and trl.cohort != leaf:
        return f"unknown config key {key!r}: {leaf!r} is TRL's name; cohort's is {trl.cohort!r}"
    if trl is not None and trl.cohort is None:
        return f"unknown config key {key!r}: TRL's {leaf!r} is not implemented by cohort; nearest: {trl.note}"
    everything = _valid_keys(TrainConfig)
    leaves = {v.rsplit(".", 1)[-1]: v for v in valid}  # this section's keys, by their last part
    close = [leaves[m] for m in difflib.get_close_matches(leaf, list(leaves), n=3, cutoff=0.6)]
    close += [m for m in difflib.get_close_matches(key, everything, n=3, cutoff=0.85) if m not in close]
    if close:
        return f"unknown config key {key!r}; did you mean {', '.join(repr(c) for c in close[:3])}?"
    section = f" in {key.rsplit('.', 1)[0]!r}" if "." in key else ""
    return (
        f"unknown config key {key!r}; the keys{section} are: {', '.join(valid)} (`cohort config` lists all)"
    )


def _nest(dotted: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in dotted.items():
        node = out
        parts = key.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{key}: {p} is not a section")
        node[parts[-1]] = value
    return out


def _deep_merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """Return the nested dict described by ``key=value`` strings (values parsed as YAML scalars)."""
    flat: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key=value (e.g. algo.beta=0.04)")
        key, raw = item.split("=", 1)
        key = key.strip().lstrip("-").replace("-", "_")
        if not key:
            raise ConfigError(
                f"override {item!r} has no key before '='; write key=value (e.g. algo.beta=0.04)"
            )
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        if isinstance(value, dict) and not raw.lstrip().startswith("{"):
            value = raw  # `rewards=f.py:` or `x=a: b` is a text with a colon, not a YAML mapping
        flat[key] = value
    return _nest(flat)


def load_config(
    path: str | os.PathLike | None = None,
    overrides: list[str] | dict[str, Any] | None = None,
    *,
    base: TrainConfig | None = None,
) -> TrainConfig:
    """Return a TrainConfig from defaults (or `base`), preset, YAML file and overrides, in that order."""
    layers: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if p.is_dir():
            hint = f" (e.g. {str(p / 'config.yaml')!r})" if (p / "config.yaml").is_file() else ""
            raise ConfigError(f"config file {str(p)!r} is a folder; pass the path of a YAML file{hint}")
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist; pass the path of a YAML file")
        loaded = read_yaml_file(p, "config file")
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {str(p)!r} must hold a mapping of keys to values")
        layers = _deep_merge(layers, _nest_top(loaded))
    if overrides:
        extra = parse_overrides(list(overrides)) if isinstance(overrides, list) else _nest_top(overrides)
        layers = _deep_merge(layers, extra)
    cfg = dataclasses.replace(base) if base is not None else TrainConfig()
    cfg = from_dict(to_dict(cfg))  # deep copy
    preset = layers.get("preset", cfg.preset)
    if preset is not None:
        apply_preset(cfg, preset)
    _apply(cfg, layers)
    return cfg


class _StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a key given twice in one mapping is an error, not last-wins."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, Any] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            try:
                first = seen.get(key)
            except TypeError:
                continue  # an unhashable key: the base class reports it
            if first is not None:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"key {key!r} is given twice (first on line {first.line + 1}); keep one of them",
                    key_node.start_mark,
                )
            seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)


def _yaml_problem(e: yaml.YAMLError) -> str:
    """Returns a YAML error as one line: the problem and the line it was found on."""
    problem = getattr(e, "problem", None)
    mark = getattr(e, "problem_mark", None)
    if problem is None:
        return " ".join(str(e).split())
    where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
    context = getattr(e, "context", None)
    return f"{context + ': ' if context else ''}{problem}{where}"


def read_yaml(text: str) -> Any:
    """Returns the YAML document in text, refusing a mapping that gives a key twice."""
    return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass


def read_yaml_file(path: str | os.PathLike, what: str) -> Any:
    """Returns the YAML document in a file ({} when empty); ConfigError in one line for any problem.

    Parsed as data only (a SafeLoader: a ``!!python/...`` tag is an error, never a call), refusing a
    key given twice. `what` names the file in messages ("config file", "pipeline file")."""
    p = Path(path)
    try:
        return read_yaml(p.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError as e:
        raise ConfigError(f"{what} {str(p)!r} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{what} {str(p)!r} is not valid YAML: {_yaml_problem(e)}") from None


def _nest_top(d: dict[str, Any]) -> dict[str, Any]:
    """Nest any dotted keys of a YAML mapping so `algo.beta: 0.1` and `algo: {beta: 0.1}` both work."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        v = _nest_top(v) if isinstance(v, dict) else v
        out = _deep_merge(out, _nest({str(k): v}))
    return out


def to_dict(cfg: Any) -> dict[str, Any]:
    """Return the config as plain nested dicts (for YAML / JSON)."""
    return dataclasses.asdict(cfg)


def from_dict(d: dict[str, Any]) -> TrainConfig:
    """Return a TrainConfig built from nested dicts (unknown keys raise ConfigError)."""
    cfg = TrainConfig()
    _apply(cfg, d)
    return cfg


def save_config(cfg: TrainConfig, path: str | os.PathLike) -> None:
    """Write the resolved config as YAML."""
    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
