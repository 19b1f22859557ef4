"""Names that cohort.config checks but heavier modules implement, kept here free of heavy imports.

Validating a config must not import transformers (nor the model, sharding or health code), so the
config reads these names instead of the implementations; each module that implements them either
builds its table from these names or checks at import time that its keys match. This module imports
nothing from cohort but :mod:`cohort.errors`, so both sides can import it.
"""

from __future__ import annotations

from cohort.errors import ConfigError

ENGINES: tuple[str, ...] = ("builtin", "hf")
"""Rollout engines, in the order error messages list them; implemented by ``cohort.rollout.ENGINES``."""

WORKER_ENGINES: tuple[str, ...] = ("vllm",)
"""rollout.engine names that only rollout workers run (``cohort serve --engine vllm``,
``cohort.serve.vllm_backend``); the trainer's own engine is then the builtin one (held-out evaluation)."""

TOOL_PARSERS: tuple[str, ...] = ("hermes", "qwen", "llama3_json", "llama3", "mistral", "transformers")
"""episodes.tool_parser names; implemented by ``cohort.episodes.parsers.TOOL_PARSERS`` (+ transformers' parsing)."""

RESULT_FORMATS: tuple[str, ...] = ("str", "json")
"""episodes.result_format names (how a tool's return value becomes the text the model reads)."""

DTYPE_NAMES: dict[str, str] = {
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "auto": "auto",
}
"""model.dtype names, in the order error messages list them, and the torch dtype each stands for ("auto":
the checkpoint's own); ``cohort.models.DTYPES`` maps them to torch dtypes."""

SAMPLER_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")
"""rollout.sampler_dtype names (a sampling copy of the policy in that dtype)."""

ATTENTION_KINDS: tuple[str, ...] = (
    "sdpa",
    "eager",
    "flash_attention_2",
    "flash_attention_3",
    "flex_attention",
)
"""transformers' attention implementations (a hub kernel 'org/name' is passed through as well)."""

SCHEDULES: tuple[str, ...] = ("constant", "linear", "cosine")
"""Learning-rate shapes after the linear warm-up: constant, linear to 0, cosine to 0 (``cohort.runtime.optim``)."""

HEALTH_CHECKS: tuple[str, ...] = (
    "no_reward",
    "rows_dropped",
    "no_advantage",
    "zero_gradient",
    "zero_variance",
    "truncation",
    "clipping",
    "kl_early",
    "kl_drift",
    "grad_spike",
    "length_drift",
    "collapse",
    "surrogate_zero",
    "logprob_gap",
    "non_finite",
)
"""Every health check by name (``health.off`` lists the ones to skip); ``cohort.train.health.CHECKS``."""

STRATEGIES: tuple[str, ...] = ("auto", "replicate", "fsdp")
"""distributed.strategy: auto (replicate under torchrun, nothing on one process), replicate, fsdp."""

MIXED_PRECISIONS: tuple[str, ...] = ("none", "bf16", "fp16")
"""distributed.mixed_precision names; ``cohort.runtime.sharding.MIXED_PRECISION`` maps them to FSDP's compute dtype."""

LOAD_MODES: tuple[str, ...] = ("auto", "rank0", "every")
"""distributed.load: auto (rank0 under fsdp, every otherwise), rank0 (process 0 reads the checkpoint and sends
each process its shard), every (each process reads the whole checkpoint, then shards it)."""


def resolve_load(load: str, strategy: str) -> str:
    """Returns how a run of `strategy` ("none", "replicate", "fsdp") loads its model: "rank0" or "every"."""
    if load not in LOAD_MODES:
        raise ConfigError(f"distributed.load={load!r} is not one of {', '.join(LOAD_MODES)}")
    if strategy == "none":
        return "every"
    if load == "auto":
        return "rank0" if strategy == "fsdp" else "every"
    return load


def resolve_strategy(strategy: str, world: int) -> str:
    """Returns the strategy that runs with `world` processes: "none", "replicate" or "fsdp"."""
    if strategy not in STRATEGIES:
        raise ConfigError(f"distributed.strategy={strategy!r} is not one of {', '.join(STRATEGIES)}")
    if world <= 1:
        if strategy == "fsdp":
            raise ConfigError(
                "distributed.strategy=fsdp shards the model across processes, but this run has one process; "
                "launch it with torchrun --nproc_per_node=N (N >= 2), or set distributed.strategy=auto"
            )
        return "none"
    return "replicate" if strategy == "auto" else strategy


def is_function_spec(value: object) -> bool:
    """Return True when `value` reads as a ``module:function`` or ``file.py:function`` spec (user code)."""
    return isinstance(value, str) and ":" in value and not value.startswith(":")


VLLM_MAX_TEMPERATURE = 2.0
"""vLLM refuses a higher temperature (SamplingParams._verify_args, 0.27.0 to 0.34.0)."""
VLLM_MIN_TEMPERATURE = 0.01
"""vLLM raises a temperature above 0 and below this to it, with a warning (SamplingParams.__post_init__, 0.27.0 to
0.34.0): it would sample at 0.01 and report those log-probs, while the trainer recomputes at the temperature it set."""
VLLM_SEED_MAX = 2**32 - 1
"""The largest engine seed vLLM takes: 0.34 validates LLM(seed=...) to [0, 2**32 - 1] (vllm/config/model.py), and
it seeds numpy's global generator with it (set_random_seed, vllm/utils/torch_utils.py), which takes that range."""
VLLM_GPU_MEMORY_UTILIZATION = 0.92
"""The share of each GPU's memory a vLLM worker lets vLLM take when --gpu-memory-utilization is not given: vLLM's
own default up to 0.33. vLLM 0.34 leaves it unset, and then sizes its (extensible) KV cache to all the memory free
after warm-up (vllm/config/cache.py, `resolved_gpu_memory_utilization`), leaving no room for what it does not
measure: here the buffers an NCCL weight push is received into (one rollout.push_bucket_mib bucket at a time) and
NCCL's own. Passed on every version, so that a worker behaves the same on all of them."""

WEIGHT_TRANSPORTS = ("auto", "gloo", "nccl")
"""rollout.weight_transport's values (cohort.serve.weights implements them)."""

DISTRIBUTED_BACKENDS = ("auto", "gloo", "nccl")
"""distributed.backend's values: auto is nccl with GPUs, gloo without (cohort.runtime.distributed)."""


def check_sampling(
    temperature: object, top_p: object, top_k: object, *, greedy: bool, prefix: str = ""
) -> None:
    """Raises ConfigError (a ValueError) for a sampling parameter out of its range: the one rule of the
    sampler's settings, for the config's `rollout.*` (`prefix`, where temperature 0 means `greedy`) and for
    every engine's SamplingParams."""
    if not greedy and not (isinstance(temperature, (int, float)) and temperature > 0):
        raise ConfigError(
            f"{prefix}temperature must be > 0, got {temperature!r}; "
            + ("0 decodes greedily" if prefix else "use greedy=True for argmax decoding")
        )
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0.0 < top_p <= 1.0:
        raise ConfigError(f"{prefix}top_p must be in (0, 1], got {top_p!r}; use 1.0 to switch it off")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ConfigError(f"{prefix}top_k must be an int >= 0, got {top_k!r}; use 0 to switch it off")
