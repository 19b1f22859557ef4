"""The config tree: one dataclass per section of a run, every field with its default and its docstring.

This module holds the schema only. The checks live in :mod:`cohort.config.validation` (the methods here
that check delegate to it), YAML files and ``key=value`` overrides in :mod:`cohort.config.loading`. The
names a field may take are listed in :mod:`cohort.choices` and in the implementing packages' name lists.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from cohort.config.kinds import KIND_KEY, Alias, kind_aliases
from cohort.errors import ConfigError
from cohort.fastpath.switches import FastConfig

__all__ = [
    "AdaptiveEntropy",
    "AlgoConfig",
    "AutoSamplerIS",
    "ClipCov",
    "DynamicSampling",
    "KLCov",
    "CurriculumConfig",
    "DataConfig",
    "DistributedConfig",
    "HealthConfig",
    "IterativeConfig",
    "LoraConfig",
    "ModelConfig",
    "OptimConfig",
    "ProcessConfig",
    "RefSync",
    "EpisodeConfig",
    "RolloutConfig",
    "SamplerIS",
    "SequenceMIS",
    "SequenceTIS",
    "TokenMIS",
    "TokenTIS",
    "TrainFields",
    "check_lora",
    "optim_aliases",
]

_C = TypeVar("_C", bound=type)


def optim_aliases(*names: str, **renamed: str) -> Callable[[_C], _C]:
    """Returns a class decorator for a dataclass with an `optim: OptimConfig` field: each alias (an older flat
    name: one of `names`, e.g. "lr", for the field of that name, or a key of `renamed`, e.g. rm_lr="lr")
    becomes a constructor keyword and an attribute, both of which read and write that field of `optim`
    (cohort.config.kinds.Alias, as every flat alias)."""
    aliases = {**{name: name for name in names}, **renamed}
    return kind_aliases(**{alias: Alias("optim", name, None) for alias, name in aliases.items()})


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
        return check_lora(self)


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
    """Built-in task (addition, multistep, code, multiply); used when `path` is empty."""
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
    """builtin (KV-cache sampler, prompt prefilled once per group), hf (transformers generate), or vllm (vLLM in
    rollout workers started with `cohort serve --engine vllm`, listed in rollout.workers; docs/vllm.md: it has
    not run on a GPU yet)."""
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
    as an inference engine would; None samples with the training weights. See algo.sampler_is."""
    workers: int | list[str] | None = None
    """Rollout workers (`cohort serve`) that generate instead of this process: a list of "host:port" addresses
    of running workers, or a number of workers this trainer starts on this machine (and stops when it ends;
    under torchrun, process 0 starts them); None samples in this process. Weights are pushed to them after every optimizer step (docs/serving.md).
    Workers sample in rollout.sampler_dtype when it is set (local ones load in it; start listed ones with
    `cohort serve --dtype`), else in model.dtype."""
    max_staleness: int = 0
    """With rollout.workers: how many optimizer steps older than the policy being trained the weights that
    sample a batch may be (0: every batch samples the current weights, the same completions as in-process)."""
    worker_timeout: float = 600.0
    """Seconds a rollout worker may take to answer a request or receive a weight push before it counts as lost
    (its requests go to the other workers)."""
    connect_timeout: float = 60.0
    """Seconds to wait for each rollout worker's first answer (a local worker's start-up included) and for its
    weight channel to open."""
    push_bucket_mib: float = 64.0
    """With several training processes, or an NCCL push: a weight push gathers and sends about this many MiB of
    whole tensors at a time, the most any process holds beyond its shards while pushing (one process pushing
    over gloo sends its weights at once)."""
    weight_transport: str = "auto"
    """How weight pushes reach the rollout workers: gloo (through host memory; CPU or GPU), nccl (from the
    trainer's GPU into the worker's GPUs; each on a GPU of its own), or auto (nccl where both ends are on
    distinct GPUs, else gloo). docs/serving.md: NCCL pushes have not run on a GPU yet."""

    def logprob_temperature(self) -> float:
        """Return the temperature log-probs are computed at: `temperature`, or 1.0 when it is 0 (greedy sampling)."""
        return self.temperature if self.temperature > 0 else 1.0


@dataclass
class AdaptiveEntropy:
    """Skywork-OR1's adaptive entropy coefficient (algo.adaptive_entropy)."""

    KIND: ClassVar[str] = "adaptive"
    target: float = 0.2
    """The mean per-token entropy (nats) the controller defends (TRL's default 0.2 acts only near collapse; a
    value near the early-training entropy acts sooner)."""
    coef_min: float = 0.0
    """The lowest coefficient."""
    coef_max: float = 1.0
    """The highest coefficient."""
    delta: float = 0.005
    """The coefficient's change per optimizer step."""


@dataclass
class DynamicSampling:
    """DAPO's dynamic sampling with refill (algo.dynamic_sampling)."""

    KIND: ClassVar[str] = "dynamic"
    max_rounds: int = 4
    """Generation rounds per step at most (the first included)."""


@dataclass
class ClipCov:
    """Clip-Cov (algo.cov kind clip_cov): the gradient of a few tokens drawn among those of high covariance is
    detached."""

    KIND: ClassVar[str] = "clip_cov"
    ratio: float = 2e-4
    """Share of tokens it acts on (the paper's 2e-4)."""
    bounds: list[float] = field(default_factory=lambda: [1.0, 5.0])
    """It draws its tokens among those whose covariance lies in [low, high] (the paper's 1 and 5)."""


@dataclass
class KLCov:
    """KL-Cov (algo.cov kind kl_cov): |log(pi/pi_old)| penalised on the tokens of highest covariance."""

    KIND: ClassVar[str] = "kl_cov"
    ratio: float = 2e-3
    """Share of tokens it acts on (the paper's 2e-3)."""
    coef: float = 1.0
    """The penalty's coefficient (the paper's 1)."""


@dataclass
class AutoSamplerIS:
    """algo.sampler_is kind auto: token_tis (at TIS's C = 2) where the sampler's log-probs are another model's
    (rollout.max_staleness > 0, rollout.engine=vllm), else none; resolved when the config is derived."""

    KIND: ClassVar[str] = "auto"


@dataclass
class TokenTIS:
    """algo.sampler_is kind token_tis: each token weighted by its ratio pi / pi_sampler, truncated at max_ratio."""

    KIND: ClassVar[str] = "token_tis"
    max_ratio: float = 2.0
    """Upper bound of the ratio (TIS's C = 2)."""


@dataclass
class SequenceTIS:
    """algo.sampler_is kind sequence_tis: each sequence weighted by its ratio (the product of its tokens'),
    truncated at max_ratio."""

    KIND: ClassVar[str] = "sequence_tis"
    max_ratio: float = 2.0
    """Upper bound of the ratio (TIS's C = 2)."""


@dataclass
class TokenMIS:
    """algo.sampler_is kind token_mis: tokens whose ratio leaves [min_ratio, max_ratio] are dropped."""

    KIND: ClassVar[str] = "token_mis"
    max_ratio: float = 2.0
    """Upper bound of the ratio."""
    min_ratio: float | None = None
    """Lower bound of the ratio (None: none)."""


@dataclass
class SequenceMIS:
    """algo.sampler_is kind sequence_mis: sequences whose ratio leaves [min_ratio, max_ratio] are dropped."""

    KIND: ClassVar[str] = "sequence_mis"
    max_ratio: float = 2.0
    """Upper bound of the ratio."""
    min_ratio: float | None = None
    """Lower bound of the ratio (None: none)."""


@dataclass
class RefSync:
    """Syncing the reference to the policy during the run (algo.ref_sync; cohort.reference): on a schedule, on
    KL drift, or both."""

    KIND: ClassVar[str] = "ref_sync"
    every: int = 0
    """Sync every this many steps (TRL's ref_model_sync_steps; 0: not on a schedule)."""
    kl: float | None = None
    """Sync after a step whose mean per-token KL exceeds this (seed 002 suggests 0.5; None: not on drift)."""
    alpha: float = 1.0
    """Each sync sets ref = alpha * policy + (1 - alpha) * ref (TRL's ref_model_mixup_alpha; 1 copies). Under
    LoRA the adapter parameters are mixed."""


SamplerIS = TokenTIS | SequenceTIS | TokenMIS | SequenceMIS
"""The sampler importance corrections that run (algo.sampler_is once derived: one of these, or None)."""


@kind_aliases(
    sampler_correction=Alias("sampler_is", KIND_KEY, "auto"),
    sampler_is_max=Alias("sampler_is", "max_ratio", 2.0),
    sampler_is_min=Alias("sampler_is", "min_ratio", None),
    ref_update_every=Alias("ref_sync", "every", 0, turns_on=True),
    ref_sync_kl=Alias("ref_sync", "kl", None, turns_on=True),
    ref_mixup_alpha=Alias("ref_sync", "alpha", 1.0),
    cov_method=Alias("cov", KIND_KEY, "none"),
    cov_ratio=Alias("cov", "ratio", None),
    clip_cov_bounds=Alias("cov", "bounds", [1.0, 5.0]),
    kl_cov_coef=Alias("cov", "coef", 1.0),
    entropy_target=Alias("adaptive_entropy", "target", 0.2),
    entropy_coef_min=Alias("adaptive_entropy", "coef_min", 0.0),
    entropy_coef_max=Alias("adaptive_entropy", "coef_max", 1.0),
    entropy_coef_delta=Alias("adaptive_entropy", "delta", 0.005),
    max_sampling_rounds=Alias("dynamic_sampling", "max_rounds", 4),
)
@dataclass
class AlgoConfig:
    """The GRPO-family objective (see docs/algorithms.md for every formula)."""

    loss_type: str = "grpo"
    """Policy loss: grpo, bnpo, dapo, dr_grpo, luspo (PPO's clip with that aggregation), cispo, sapo, gmpo,
    vespo, dppo_tv, dppo_kl, dro (needs kl_tau > 0), or your own 'my_pkg.module:function' / 'file.py:function'
    (see cohort.algo.LossInputs for the signature)."""
    aggregation: str | None = None
    """How per-token losses are averaged: grpo, bnpo, dapo, dr_grpo or luspo; None uses the loss type's own
    (dapo for your own losses)."""
    loss_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword parameters of the loss: cispo {max_ratio: 5.0, min_ratio: null}, sapo {tau_pos: 1.0, tau_neg:
    1.05}, gmpo {clip: 0.4}, vespo {k_pos: 2.0, lambda_pos: 3.0, k_neg: 3.0, lambda_neg: 2.0}, dppo_tv
    {mask_low: 0.15, mask_high: 0.15, max_ratio: null}, dppo_kl {mask_low: 0.05, mask_high: 0.05, max_ratio:
    null}, or your own loss's."""
    advantage: str = "grpo"
    """Advantage estimator: grpo (group z-score, with scale / std / adv_eps), rloo, reinforce_pp,
    reinforce_pp_baseline, max_rl ((r - mean) / mean per group), optimal_token_baseline (per-token baselines
    from the update's pi_old pass; not with gmpo or process rewards), or your own 'my_pkg.module:function'."""
    advantage_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of your own advantage estimator."""
    top_entropy_quantile: float = 1.0
    """Keep only this top share of each micro-batch's tokens by entropy in the policy loss ("Beyond the 80/20
    Rule" uses 0.2; 1.0 keeps every token)."""
    entropy_coef: float = 0.0
    """Entropy regularisation: subtract this times the mean per-token entropy from the loss (an exploration
    bonus; 0 is off). With adaptive_entropy it is the controller's starting coefficient."""
    adaptive_entropy: AdaptiveEntropy | None = None
    """Skywork-OR1's adaptive entropy coefficient (TRL's use_adaptive_entropy): true (its defaults), a mapping
    of its settings (target, coef_min, coef_max, delta) or none. After each optimizer step the coefficient
    moves by delta, up when the step's entropy was at or below the target and down otherwise, within [coef_min,
    coef_max]; the bonus applies only while the last entropy is at or below the target. The flat names
    entropy_target, entropy_coef_min, entropy_coef_max and entropy_coef_delta are aliases of its settings."""
    cov: ClipCov | KLCov | None = None
    """Entropy control by covariance (Cui et al. 2025), a kind: none; clip_cov (detach the gradient of a few
    tokens of high log-prob/advantage covariance: ratio, bounds) or kl_cov (penalise |log(pi/pi_old)| on the
    top-covariance tokens: ratio, coef). Written as the kind's name (its defaults) or a mapping, e.g.
    ``cov: {kind: kl_cov, coef: 2.0}``; the flat names cov_method, cov_ratio, clip_cov_bounds and kl_cov_coef
    are aliases."""
    sampler_is: TokenTIS | SequenceTIS | TokenMIS | SequenceMIS | AutoSamplerIS | None = field(
        default_factory=AutoSamplerIS
    )
    """Importance correction for a sampler whose log-probs differ from the trainer's (rollout.sampler_dtype,
    rollout.max_staleness, rollout.engine=vllm), a kind: none; token_tis or sequence_tis (weigh each token or
    sequence by its ratio pi / pi_sampler truncated at max_ratio); token_mis or sequence_mis (drop the tokens or
    sequences whose ratio leaves [min_ratio, max_ratio]); auto (the default): token_tis with
    rollout.max_staleness > 0 or rollout.engine=vllm, else none. Written as the kind's name or a mapping, e.g.
    ``sampler_is: {kind: token_mis, min_ratio: 0.5}``; the flat names sampler_correction (the kind's name),
    sampler_is_max and sampler_is_min are aliases."""
    off_policy_mask_threshold: float | None = None
    """DeepSeek-V3.2's off-policy sequence mask (TRL's field of that name): drop a completion with a negative
    advantage from the policy loss when its mean per-token KL from the sampler, mean_t (log pi_sampler - log
    pi), exceeds this (None: off; TRL's example 0.5)."""
    use_bias_correction_kl: bool = False
    """DeepSeek-V3.2's unbiased KL: multiply the beta term's per-token estimate by the token ratio pi / pi_old
    (only with beta > 0; TRL's default is true, cohort's false keeps DeepSeekMath's gradient)."""
    kl_tau: float = 0.0
    """Squared log-ratio penalty: add kl_tau * (log pi / pi_anchor)^2 on every completion token, unscaled by
    token or sampler weights (prime-rl's kl_tau, 1e-3 there; 0 is off). loss_type dro needs it > 0."""
    trust_region_anchor: str = "old"
    """What the importance ratio, DPPO's masks and kl_tau are measured against: old (pi_old, the trainer's
    log-probs before the update) or sampler (the rollout engine's log-probs, as the DPPO paper and prime-rl;
    then sampler_correction must be none, since the ratio already is pi / pi_sampler)."""
    dppo_topk: int = 0
    """DPPO's top-K divergence mask over the sampler's K most likely tokens, the sampled one forced in (0: the
    binary mask of the sampled token). Needs loss_type dppo_tv / dppo_kl and the builtin engine in the trainer
    (not hf, rollout workers or episodes); the anchor follows trust_region_anchor."""

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
    dynamic_sampling: DynamicSampling | None = None
    """DAPO's dynamic sampling with refill, a section that is on or off: true (its defaults), a mapping of its
    settings (max_rounds) or none. Groups whose rewards are all equal are dropped and groups for new prompts
    are generated (batched, in rounds) until the step holds rollout.batch_size / group_size groups with
    unequal rewards, or max_rounds is reached (then it trains on the groups it has). The flat name
    max_sampling_rounds is an alias of max_rounds."""
    mask_truncated: bool = False
    """Leave completions cut at max_completion_length out of the loss (DAPO overlong filtering)."""
    kl_estimator: str = "k3"
    """Per-token KL estimator of the beta term: k3 (DeepSeekMath's, unbiased, low variance), k2 (its gradient
    is that of the reverse KL it estimates) or k1 (log-ratio; regularises only through the reward)."""
    ref_sync: RefSync | None = None
    """Sync the reference to the policy during the run (needs beta > 0; cohort.reference), a section: none (the
    reference stays the initial policy) or its settings every (steps), kl (a mean per-token KL that triggers a
    sync) and alpha (how far each sync moves it), e.g. ``ref_sync: {every: 64, alpha: 0.6}``. The flat names
    ref_update_every and ref_sync_kl (each turns the section on) and ref_mixup_alpha are aliases."""

    def applied_sampler_is(self) -> SamplerIS | None:
        """Returns the sampler correction the update applies: the kind held, or None for none and for an auto
        not yet resolved (the config's derive step resolves it; an AlgoConfig built by hand applies none)."""
        return None if isinstance(self.sampler_is, AutoSamplerIS) else self.sampler_is


@dataclass
class CurriculumConfig:
    """Setting aside prompts that are always or never solved (off by default; see cohort.train.curriculum)."""

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
    """Live health checks (cohort.train.health): seed 002's failure modes, each with a threshold."""

    enabled: bool = True
    """Evaluate the checks every step (they reuse what the step computed: no extra forward pass)."""
    abort: bool = False
    """Stop the run, after saving a checkpoint, the first time a check fires (exit code 1)."""
    off: list[str] = field(default_factory=list)
    """Checks to skip, by name (see cohort.train.health.CHECKS)."""
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
    """kl_drift fires when the KL term's pull on a token, beta * sqrt(2 * KL), exceeds this many times the mean
    |advantage| of the completions in the loss."""
    grad_spike: float = 50.0
    """grad_spike fires when the gradient norm exceeds this many times the window's median (the demo's largest
    ratio is about 30: steps with few informative groups have tiny gradients)."""
    length_ratio: float = 3.0
    """length_drift fires when the window's mean completion length leaves [1/r, r] times the first window's."""
    collapse_max: float = 0.5
    """collapse fires when more than this share of groups have G identical completions below the best reward."""
    logprob_gap_max: float | None = None
    """logprob_gap fires when, at num_iterations = 1, the trainer's and the sampler's log-prob of a sampled
    token differ by more than this. None follows the least precise dtype the sampler's and the trainer's forward
    passes compute in (cohort.train.health.LOGPROB_GAP_MAX): 1e-3 in float32 (at most 3e-4 over the demo's 3000 CPU
    steps, where fast paths sum in another order), 0.5 in bfloat16 (weights, autocast or rollout.sampler_dtype:
    0.008-0.06 measured on a 0.5B model under CUDA autocast), 0.1 in float16."""


@dataclass
class ProcessConfig:
    """Process supervision: reward functions that score each reasoning step (see cohort.rewards.process_rewards)."""

    step_separator: str = "\n"
    """Where a step ends in the completion's text when a reward gives step rewards without explicit ends
    (also where a process reward model reads each step's score)."""


@dataclass
class EpisodeConfig:
    """Multi-turn episodes: tools the policy may call and environments it talks to (docs/agents.md). Off while
    `tools`, `environment` and `environments` are all empty."""

    tools: list[str] = field(default_factory=list)
    """Tools by built-in name (cohort.episodes.catalog: multiply, python) or "module:function" / "file.py:function";
    each needs type hints and a Google-style docstring (its JSON schema comes from them)."""
    environment: str | None = None
    """"module:Factory" / "file.py:Factory" making one environment per rollout: TRL's contract (reset(**row), public
    methods as tools, optional get_reward) or a cohort.episodes.TextEnvironment (reset / step)."""
    environments: dict[str, str] = field(default_factory=dict)
    """Several environments by name, each row routed by its `environment` column (TRL's dict of factories)."""
    max_tool_calling_iterations: int | None = None
    """Most tool-calling turns per episode (None: as many as the token budget allows); a call past it stays
    unexecuted in the last assistant message, as in TRL."""
    tool_parser: str | None = None
    """Tool-call format: hermes, llama3_json, mistral or transformers (None: told from the chat template)."""
    tool_timeout: float = 30.0
    """Seconds a tool call (or an environment's step) may take; past it the model sees an error result."""
    max_tool_result_chars: int | None = None
    """Cut a tool result to this many characters (saying so in the result); None keeps it whole."""
    result_format: str = "str"
    """How a tool's return value becomes text: "str" (Python's str, as TRL) or "json"."""
    turn_rewards: bool = False
    """A TextEnvironment's per-turn rewards feed the process-reward path (each turn a step) instead of their sum."""

    @property
    def enabled(self) -> bool:
        """Returns whether runs roll out multi-turn episodes."""
        return bool(self.tools or self.environment or self.environments)


@dataclass
class OptimConfig:
    """AdamW and the learning-rate schedule: GRPO's `optim:` section, and the `optim` of supervised fine-tuning
    (cohort.commands.sft.SFTConfig), reward-model training (cohort.commands.rm.RMConfig) and iterative GRPO's reward model, each
    with defaults of its own (the ones below are GRPO's)."""

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


@optim_aliases(rm_lr="lr")
@dataclass
class IterativeConfig:
    """Iterative GRPO: reset the reference and retrain the reward model on fresh policy samples (cohort.train.iterative)."""

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
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-4, adam_beta2=0.999))
    """The reward model's AdamW (lr 1e-4, betas 0.9 / 0.999, gradient norm clipped at 1), at a constant learning
    rate: warm-up and schedules are refused. The older key iterative.rm_lr is an alias of iterative.optim.lr."""


@dataclass
class DistributedConfig:
    """Multi-process training under torchrun (cohort.runtime.sharding; docs/usage.md, "Several processes")."""

    strategy: str = "auto"
    """auto (replicate under torchrun, nothing on one process), replicate (every process holds the whole model;
    FSDP all-reduces gradients), or fsdp (parameters, gradients and AdamW state sharded across processes)."""
    backend: str = "auto"
    """torch.distributed backend: auto (nccl with GPUs, gloo without), nccl, or gloo."""
    mixed_precision: str = "none"
    """FSDP's mixed-precision policy: none, bf16 or fp16 compute (gradients reduce in float32); meant for GPUs."""
    load: str = "auto"
    """How the processes load the model: rank0 (process 0 reads the checkpoint; the others build the model on
    the meta device and receive their shards from it, one tensor at a time), every (each process reads the whole
    checkpoint, then shards it), or auto (rank0 under fsdp, every otherwise)."""
    global_batch_size: int | None = None
    """Completions per step over all processes (each samples global_batch_size / processes); None: rollout.batch_size
    is each process's share. Keeps a run's batch when it is resumed on another number of processes."""


@dataclass
class TrainFields:
    """A whole GRPO run's settings: the sections and the run-wide fields (cohort.config.TrainConfig adds the call
    that derives and checks them)."""

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
    episodes: EpisodeConfig = field(default_factory=EpisodeConfig)
    """Multi-turn episodes with tools and environments (off by default)."""
    rewards: list[str] = field(default_factory=lambda: ["accuracy"])
    """Reward functions: built-in names (accuracy, format, overlong) or "module:function" / "file.py:function"."""
    reward_weights: list[float] | None = None
    """One weight per reward function (None = all 1.0)."""
    steps: int = 100
    """Training steps (one generation batch each)."""
    micro_batch_tokens: int = 8192
    """Token budget of one forward/backward (gradient accumulation splits larger minibatches), counted in the layout
    the pass takes: a padded row's padding counts, a grouped prompt counts once."""
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
    eval_k: int = 1
    """Each held-out evaluation also samples this many completions per prompt (at the rollout temperature) and
    reports pass@k and maj@k beside greedy accuracy (1: greedy accuracy only)."""
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
    """Named recipe applied before the file and overrides (cohort.config.presets): r1, dapo, dr_grpo, gspo, cispo,
    sapo, gmpo, rloo, reinforce_pp, top_entropy, clip_cov, kl_cov, dppo, prime_rl, vespo, luspo, max_rl,
    ppo_classic (`cohort config --presets` lists each with its source)."""

    @property
    def prompts_per_step(self) -> int:
        """Return the number of distinct prompts sampled per step."""
        return self.rollout.batch_size // self.rollout.group_size


def check_lora(lora: LoraConfig) -> LoraConfig:
    """Return `lora` after checking the adapter settings (raises ConfigError naming the bad key)."""
    if isinstance(lora.r, bool) or not isinstance(lora.r, int) or lora.r <= 0:
        raise ConfigError(f"model.lora.r={lora.r!r} must be a positive integer (typical: 8, 16, 64)")
    if not lora.alpha > 0:
        raise ConfigError(f"model.lora.alpha={lora.alpha!r} must be > 0 (typical: 2 * r)")
    if not 0.0 <= lora.dropout < 1.0:
        raise ConfigError(f"model.lora.dropout={lora.dropout!r} must be in [0, 1)")
    if isinstance(lora.target_modules, str) or not lora.target_modules:
        raise ConfigError(
            f"model.lora.target_modules={lora.target_modules!r} must be a non-empty list of module "
            "names, e.g. ['q_proj', 'v_proj']"
        )
    return lora
