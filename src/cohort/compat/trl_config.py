"""TRL's `GRPOConfig` as a dataclass: every field of TRL 1.16's (transformers' TrainingArguments and TRL's own),
with TRL's defaults, so that TRL's argument parsers (`HfArgumentParser`, `TrlParser`) build it from a command
line or a YAML file, and callbacks read it as they read TrainingArguments.

What cohort does not implement is accepted at TRL's default only (or at any value where it changes nothing,
`fields.ANY_VALUE` and `Field.any_value`); any other value is an error at construction or assignment naming the
nearest cohort option. A field set after construction is read when the trainer is built, as TRL reads it.
`GRPOConfig.to_train_config` maps the fields onto cohort's config.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import json
import math
import os
import typing
from typing import Any

from cohort.compat.fields import ANY_VALUE, TRL_FIELDS
from cohort.config import TrainConfig, _valid_keys, load_config, torchrun_world_size
from cohort.errors import ConfigError

__all__ = ["GRPOConfig", "SCHEDULES", "plain"]

SCHEDULES = ("linear", "cosine", "constant", "constant_with_warmup")
"""The lr_scheduler_type values cohort implements (transformers' names)."""

_DICT_FIELDS = ("chat_template_kwargs", "model_init_kwargs", "generation_kwargs", "lr_scheduler_kwargs")
"""Fields TRL and transformers also take as a JSON string (from a command line): parsed at construction."""


def plain(value: Any) -> Any:
    """Returns an enum's value (transformers' SchedulerType, IntervalStrategy ...), anything else as it is."""
    return getattr(value, "value", value)


@functools.cache
def _training_arguments() -> dict[str, tuple[Any, Any]]:
    """Returns transformers.TrainingArguments' init fields: name -> (type, default)."""
    from transformers import TrainingArguments

    hints = typing.get_type_hints(TrainingArguments)
    out: dict[str, tuple[Any, Any]] = {}
    for f in dataclasses.fields(TrainingArguments):
        if not f.init:
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = None
        out[f.name] = (hints.get(f.name, Any), default)
    return out


def _specs() -> dict[str, tuple[Any, Any]]:
    """Returns every GRPOConfig field: name -> (type, TRL's default); TrainingArguments' first, in their order."""
    out = dict(_training_arguments())
    for name, spec in TRL_FIELDS.items():
        kind = out[name][0] if name in out else (spec.kind or type(spec.default))
        out[name] = (kind, spec.default)
    return out


def _dataclass_field(default: Any) -> Any:
    if isinstance(default, (list, dict, set)):
        return dataclasses.field(default_factory=functools.partial(copy.deepcopy, default))
    return dataclasses.field(default=default)


_SPECS = _specs()
DEFAULTS: dict[str, Any] = {name: default for name, (_, default) in _SPECS.items()}
"""Every field's default: TRL 1.16's where TRL sets one, else transformers'."""

_Fields = dataclasses.make_dataclass(
    "_GRPOConfigFields",
    [(name, kind, _dataclass_field(default)) for name, (kind, default) in _SPECS.items()],
    repr=False,
)


class GRPOConfig(_Fields):  # type: ignore[valid-type,misc]
    """TRL's GRPOConfig, by field name: `GRPOConfig(output_dir=..., learning_rate=..., num_generations=...)`.

    A dataclass of TRL 1.16's fields and defaults. `cohort` takes cohort's own keys on top
    (`{"fast.segments": "off"}` or `{"micro_batch_tokens": 4096}`)."""

    def __init__(self, output_dir: str | None = None, *, cohort: dict[str, Any] | None = None, **fields: Any):
        unknown = [k for k in fields if k not in DEFAULTS]
        if unknown:
            raise ConfigError("; ".join(_unknown_message(k) for k in unknown))
        object.__setattr__(self, "cohort", dict(cohort or {}))
        super().__init__(output_dir=output_dir, **fields)
        self._resolve()

    def __setattr__(self, name: str, value: Any) -> None:
        if not name.startswith("_") and name != "cohort":
            if name not in DEFAULTS:
                raise ConfigError(_unknown_message(name))
            value = _checked(name, value)
        object.__setattr__(self, name, value)

    def _resolve(self) -> None:
        """Derives what TRL's __post_init__ derives (the generation batch's two sizes, greater_is_better) and
        checks the choices cohort can tell wrong now, before any model loads."""
        if self.metric_for_best_model is not None and self.greater_is_better is None:
            setattr(self, "greater_is_better", not str(self.metric_for_best_model).endswith("loss"))  # noqa: B010
        schedule = plain(self.lr_scheduler_type)
        if schedule not in SCHEDULES:
            raise ConfigError(
                f"GRPOConfig(lr_scheduler_type={schedule!r}) is not implemented by cohort; choose one of "
                f"{', '.join(SCHEDULES)}"
            )
        for name, allowed in (("save_strategy", ("no", "steps")), ("eval_strategy", ("no", "steps"))):
            value = plain(getattr(self, name))
            if value not in allowed:
                what = "saves by steps ('steps') or at the end ('no')"
                if name == "eval_strategy":
                    what = "evaluates by steps ('steps') or not ('no')"
                raise ConfigError(f"GRPOConfig({name}={value!r}): cohort {what}")
        # TRL fills both sizes in (callbacks read them); a size filled in here and not set since is derived
        # anew, so that a batch size set after construction counts
        for name, value in getattr(self, "_derived", {}).items():
            if getattr(self, name) == value:
                object.__setattr__(self, name, None)
        world = torchrun_world_size()
        spg = self._steps_per_generation(world)
        derived = {}
        if self.generation_batch_size is None:
            derived["generation_batch_size"] = self.per_device_train_batch_size * spg * world
        if self.steps_per_generation is None:
            derived["steps_per_generation"] = spg
        for name, value in derived.items():
            setattr(self, name, value)
        object.__setattr__(self, "_derived", derived)

    # ------------------------------------------------------------------ what callbacks read
    @property
    def world_size(self) -> int:
        """Returns the number of processes (torchrun's WORLD_SIZE)."""
        return torchrun_world_size()

    @property
    def process_index(self) -> int:
        """Returns this process's global rank."""
        return int(os.environ.get("RANK", "0") or 0)

    @property
    def local_process_index(self) -> int:
        """Returns this process's rank on its machine."""
        return int(os.environ.get("LOCAL_RANK", "0") or 0)

    @property
    def should_log(self) -> bool:
        """Returns whether this process logs (the main one)."""
        return self.process_index == 0

    @property
    def should_save(self) -> bool:
        """Returns whether this process writes checkpoints' shared files (the main one)."""
        return self.process_index == 0

    @property
    def n_gpu(self) -> int:
        """Returns the GPUs this process trains on (0 or 1: one process per GPU)."""
        import torch

        return int(torch.cuda.is_available() and not self.use_cpu)

    @property
    def device(self) -> Any:
        """Returns the device this process trains on."""
        import torch

        if self.n_gpu:
            return torch.device("cuda", self.local_process_index)
        return torch.device("cpu")

    @property
    def train_batch_size(self) -> int:
        """Returns per_device_train_batch_size (one process per device)."""
        return int(self.per_device_train_batch_size)

    @property
    def eval_batch_size(self) -> int:
        """Returns per_device_eval_batch_size (one process per device)."""
        return int(self.per_device_eval_batch_size)

    # ------------------------------------------------------------------ views
    def given(self) -> dict[str, Any]:
        """Returns the fields whose value differs from TRL's default, by TRL name."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if _differs(getattr(self, f.name), DEFAULTS[f.name])
        }

    def to_dict(self) -> dict[str, Any]:
        """Returns every field with its value, enums as their values (TrainingArguments.to_dict)."""
        return {f.name: plain(getattr(self, f.name)) for f in dataclasses.fields(self)}

    def to_json_string(self) -> str:
        """Returns to_dict() as indented JSON (TrainingArguments.to_json_string, which W&B and TensorBoard log)."""
        return json.dumps(self.to_dict(), indent=2, default=str)

    def to_sanitized_dict(self) -> dict[str, Any]:
        """Returns to_dict() with values TensorBoard's hparams cannot hold written as strings."""
        return {
            k: v if isinstance(v, (bool, int, float, str)) else str(v)
            for k, v in {**self.to_dict(), "train_batch_size": self.train_batch_size}.items()
        }

    def __repr__(self) -> str:
        return f"GRPOConfig({', '.join(f'{k}={v!r}' for k, v in self.given().items())})"

    def to_train_config(self, model: str, num_rows: int | None) -> TrainConfig:
        """Returns cohort's TrainConfig for these fields, the model `model` and a dataset of `num_rows` rows."""
        self._resolve()  # fields set after construction are checked as at construction
        g = self.given()
        out: dict[str, Any] = {"model.name_or_path": model, "rewards": [], "progress": not self.disable_tqdm}
        out["out_dir"] = self.output_dir or "trainer_output"
        out["seed"] = self.seed
        # cohort's rollout.batch_size is per process (each process samples whole groups of its own prompts),
        # TRL's generation batch is per_device x steps_per_generation on each device: the same count.
        world = torchrun_world_size()  # every process samples its own prompts
        per_generation = self.steps_per_generation
        out["rollout.batch_size"] = self.per_device_train_batch_size * per_generation
        out["rollout.group_size"] = self.num_generations
        out["algo.num_minibatches"] = per_generation // self.gradient_accumulation_steps
        out["eval_batch_size"] = self.per_device_eval_batch_size
        for name in ("max_completion_length", "temperature", "top_p"):
            out[f"rollout.{name}"] = getattr(self, name)
        out["rollout.top_k"] = self.top_k or 0
        if self.chat_template_kwargs:
            out["data.chat_template_kwargs"] = dict(self.chat_template_kwargs)
        if self.max_prompt_length is not None:
            out["data.max_prompt_length"] = self.max_prompt_length
        out["algo.loss_type"] = self.loss_type
        out["algo.beta"] = self.beta
        out["algo.eps_low"] = self.epsilon
        if self.loss_type == "cispo":
            if self.epsilon_high is None:
                raise ConfigError(
                    "GRPOConfig(loss_type='cispo') caps the importance ratio at epsilon_high, which is unset (TRL "
                    "would cap it at epsilon); set epsilon_high (ScaleRL's recommendation: 5.0)"
                )
            out["algo.loss_kwargs"] = {"max_ratio": self.epsilon_high}
        elif self.loss_type == "sapo":
            out["algo.loss_kwargs"] = {
                "tau_pos": self.sapo_temperature_pos,
                "tau_neg": self.sapo_temperature_neg,
            }
        elif self.loss_type == "vespo":
            out["algo.loss_kwargs"] = {
                "k_pos": self.vespo_k_pos,
                "lambda_pos": self.vespo_lambda_pos,
                "k_neg": self.vespo_k_neg,
                "lambda_neg": self.vespo_lambda_neg,
            }
        else:
            out["algo.eps_high"] = self.epsilon_high
        vespo_fields = sorted(k for k in g if k.startswith("vespo_"))
        if self.loss_type != "vespo" and vespo_fields:
            raise ConfigError(
                f"GRPOConfig: {', '.join(vespo_fields)} apply to loss_type='vespo', not {self.loss_type!r}; leave "
                "them out or set loss_type='vespo'"
            )
        if self.loss_type != "sapo" and {"sapo_temperature_pos", "sapo_temperature_neg"} & set(g):
            raise ConfigError(
                f"GRPOConfig: sapo_temperature_pos / sapo_temperature_neg apply to loss_type='sapo', not "
                f"{self.loss_type!r}; leave them out or set loss_type='sapo'"
            )
        if self.loss_type not in ("cispo", "sapo", "vespo") or self.delta is not None:
            out["algo.delta"] = self.delta
        if self.off_policy_mask_threshold is not None:
            out["algo.off_policy_mask_threshold"] = self.off_policy_mask_threshold
        if self.beta != 0:  # TRL applies the correction only with a KL term: its default True follows it
            out["algo.use_bias_correction_kl"] = bool(self.use_bias_correction_kl)
        out["algo.top_entropy_quantile"] = self.top_entropy_quantile
        out["algo.entropy_coef"] = self.entropy_coef
        if self.use_adaptive_entropy:  # the section's settings (a mapping turns it on)
            for name in ("entropy_target", "entropy_coef_min", "entropy_coef_max", "entropy_coef_delta"):
                out[str(TRL_FIELDS[name].cohort)] = getattr(self, name)
        else:
            out["algo.adaptive_entropy"] = False
        out["algo.num_iterations"] = self.num_iterations
        scale = self.scale_rewards
        out["algo.scale"] = (
            {True: "group", False: "none"}.get(scale, scale) if isinstance(scale, bool) else scale
        )
        out["algo.importance"] = self.importance_sampling_level
        out["algo.mask_truncated"] = self.mask_truncated_completions
        aggregation = self.multi_objective_aggregation
        modes = {"sum_then_normalize": "sum", "normalize_then_sum": "decoupled"}
        if aggregation not in modes:
            raise ConfigError(
                f"GRPOConfig(multi_objective_aggregation={aggregation!r}): choose one of {list(modes)}"
            )
        out["algo.reward_mode"] = modes[aggregation]
        if not isinstance(self.torch_compile, bool):
            raise ConfigError(f"GRPOConfig(torch_compile={self.torch_compile!r}): give True or False")
        out["fast.compile_update"] = "auto" if self.torch_compile else "off"
        if self.sync_ref_model:
            out["algo.ref_update_every"] = self.ref_model_sync_steps
            out["algo.ref_mixup_alpha"] = self.ref_model_mixup_alpha
        if self.reward_weights is not None:
            out["reward_weights"] = list(self.reward_weights)
        if self.max_tool_calling_iterations is not None:
            out["episodes.max_tool_calling_iterations"] = self.max_tool_calling_iterations
        out["optim.lr"] = self.learning_rate
        schedule = plain(self.lr_scheduler_type)
        out["optim.schedule"] = "constant" if schedule == "constant_with_warmup" else schedule
        out["optim.weight_decay"] = self.weight_decay
        out["optim.adam_beta1"] = self.adam_beta1
        out["optim.adam_beta2"] = self.adam_beta2
        out["optim.adam_eps"] = self.adam_epsilon
        out["optim.max_grad_norm"] = self.max_grad_norm
        if self.use_cpu:
            out["model.device"] = "cpu"
        if self.bf16 is not None:
            out["model.bf16_autocast"] = bool(self.bf16)
        out["model.trust_remote_code"] = self.trust_remote_code
        out["model.gradient_checkpointing"] = bool(self.gradient_checkpointing)
        fsdp = self.fsdp
        words = fsdp.split() if isinstance(fsdp, str) else [str(w) for w in (fsdp or [])]
        if words:
            shards = {"full_shard", "shard_grad_op", "hybrid_shard", "hybrid_shard_zero2"}
            if not shards & set(words):
                raise ConfigError(
                    f"GRPOConfig(fsdp={fsdp!r}): cohort shards with FSDP2 when fsdp names a sharding strategy "
                    "('full_shard'); options such as 'offload' alone are not implemented"
                )
            out["distributed.strategy"] = "fsdp"
        if self.ddp_backend is not None:
            if self.ddp_backend not in ("nccl", "gloo"):
                raise ConfigError(
                    f"GRPOConfig(ddp_backend={self.ddp_backend!r}): cohort runs on nccl or gloo"
                )
            out["distributed.backend"] = self.ddp_backend
        for key, value in (self.model_init_kwargs or {}).items():
            target = {
                "dtype": "model.dtype",
                "torch_dtype": "model.dtype",
                "trust_remote_code": "model.trust_remote_code",
                "attn_implementation": "model.attn_implementation",
            }.get(key)
            if target is None:
                raise ConfigError(
                    f"GRPOConfig(model_init_kwargs={{{key!r}: ...}}) is not implemented by cohort; it takes dtype / "
                    "torch_dtype, trust_remote_code and attn_implementation"
                )
            out[target] = str(value).replace("torch.", "")
        report = self.report_to
        sinks = {report} if isinstance(report, str) else set(report or [])
        bad = sinks - {"none", "tensorboard", "wandb", "all"}
        if bad:
            raise ConfigError(
                f"GRPOConfig(report_to={report!r}): cohort reports to tensorboard and wandb only"
            )
        out["tensorboard"] = bool(sinks & {"tensorboard", "all"})
        out["wandb"] = bool(sinks & {"wandb", "all"})
        saving, evaluating = plain(self.save_strategy) == "steps", plain(self.eval_strategy) == "steps"
        out["save_every"] = self.save_steps if saving else 0
        out["eval_every"] = (self.eval_steps or 0) if evaluating else 0
        if self.num_completions_to_print is not None:
            out["num_samples_logged"] = self.num_completions_to_print
        # How long: TRL counts optimizer steps; cohort counts generation batches, each making `per_batch`.
        per_batch = self.num_iterations * out["algo.num_minibatches"]
        steps = self.optimizer_steps(num_rows, world)
        if not (self.max_steps is not None and self.max_steps > 0):  # from epochs: whole generation batches
            steps = math.ceil(steps / per_batch) * per_batch
        if steps % per_batch:
            raise ConfigError(
                f"GRPOConfig(max_steps={steps}): each generation batch makes {per_batch} optimizer steps "
                f"(num_iterations={self.num_iterations} x steps_per_generation / gradient_accumulation_steps = "
                f"{out['algo.num_minibatches']}) and cohort trains whole generation batches; set max_steps to a "
                f"multiple of {per_batch} (e.g. {max(per_batch, steps - steps % per_batch)})"
            )
        out["steps"] = steps // per_batch
        # cohort's scheduler steps once per optimizer step (steps x num_iterations x num_minibatches in all).
        warmup = self.warmup_steps
        if isinstance(warmup, float) and 0 < warmup < 1:  # transformers 5: a float < 1 is a ratio
            warmup = math.ceil(warmup * steps)
        if not 0 <= self.warmup_ratio <= 1:
            raise ConfigError(
                f"GRPOConfig(warmup_ratio={self.warmup_ratio}) must be in [0, 1] (a fraction of the steps)"
            )
        out["optim.warmup_steps"] = int(
            warmup or (math.ceil(self.warmup_ratio * steps) if self.warmup_ratio else 0)
        )
        if schedule == "constant":  # transformers' constant schedule has no warm-up: warmup_steps is not read
            out["optim.warmup_steps"] = 0
        # TRL keeps every checkpoint without a save_total_limit
        out["keep_checkpoints"] = (
            steps + 1 if self.save_total_limit is None else max(1, int(self.save_total_limit))
        )
        # logging_steps, save_steps and eval_steps count optimizer steps (a value in (0, 1): that fraction of
        # max_steps); cohort acts on whole generation batches, so each rounds up to them.
        out["logging_steps"] = self.logging_steps
        if evaluating and not self.eval_steps:
            out["eval_every"] = self.logging_steps  # TRL's default for eval_steps
        for key in ("logging_steps", "save_every", "eval_every"):
            every = out[key]
            if isinstance(every, float) and 0 < every < 1:
                every = max(1, math.ceil(every * steps))
            out[key] = math.ceil(every / per_batch) if every else 0
        out.update(self.cohort)
        return load_config(None, out)

    def _steps_per_generation(self, world: int) -> int:
        """Returns the optimizer-step-sized parts of one generation batch, per TRL: steps_per_generation, or
        generation_batch_size / (per_device_train_batch_size x processes), or gradient_accumulation_steps."""
        per_device, accumulation = self.per_device_train_batch_size, self.gradient_accumulation_steps
        for name in ("per_device_train_batch_size", "gradient_accumulation_steps", "num_generations"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"GRPOConfig({name}={value!r}) must be an integer >= 1")
        spg, gbs = self.steps_per_generation, self.generation_batch_size
        if spg is not None and gbs is not None:
            raise ConfigError(
                "GRPOConfig: set steps_per_generation or generation_batch_size, not both (TRL derives one from "
                "the other)"
            )
        if gbs is not None:
            if isinstance(gbs, bool) or not isinstance(gbs, int) or gbs < 1 or gbs % (per_device * world):
                raise ConfigError(
                    f"GRPOConfig(generation_batch_size={gbs!r}) must be a positive multiple of "
                    f"per_device_train_batch_size x processes = {per_device * world}"
                )
            spg = gbs // (per_device * world)
        spg = accumulation if spg is None else spg
        if isinstance(spg, bool) or not isinstance(spg, int) or spg < 1:
            raise ConfigError(f"GRPOConfig(steps_per_generation={spg!r}) must be an integer >= 1")
        if spg % accumulation:
            raise ConfigError(
                f"GRPOConfig: one generation batch holds {spg} micro-batches (steps_per_generation), which is "
                f"not a whole number of optimizer steps of gradient_accumulation_steps={accumulation}; cohort "
                "generates once per whole optimizer steps: make steps_per_generation a multiple of "
                "gradient_accumulation_steps"
            )
        minibatch = per_device * accumulation
        if spg > accumulation and minibatch % self.num_generations:
            raise ConfigError(
                f"GRPOConfig: with {spg // accumulation} optimizer steps per generation batch, each step takes "
                f"per_device_train_batch_size x gradient_accumulation_steps = {minibatch} completions, not a "
                f"whole number of groups of num_generations={self.num_generations}; cohort's optimizer steps take "
                "whole groups: make that product a multiple of num_generations"
            )
        return spg

    def optimizer_steps(self, num_rows: int | None, world: int = 1) -> int:
        """Returns the run's optimizer steps as TRL counts them: max_steps, else from num_train_epochs."""
        if self.max_steps is not None and self.max_steps > 0:
            return int(self.max_steps)
        if num_rows is None:
            raise ConfigError(
                "GRPOConfig: a dataset of unknown length (an IterableDataset) needs max_steps; set max_steps=N"
            )
        if not self.num_train_epochs > 0:
            raise ConfigError(
                f"GRPOConfig(num_train_epochs={self.num_train_epochs}) with max_steps={self.max_steps} trains "
                "nothing; set num_train_epochs > 0 or max_steps=N"
            )
        per_generation = self.steps_per_generation
        prompts = self.per_device_train_batch_size * per_generation * world // self.num_generations
        # TRL's sampler drops the last incomplete generation batch of an epoch.
        batches = max(1, num_rows // max(1, prompts))
        per_batch = self.num_iterations * per_generation // self.gradient_accumulation_steps
        return max(1, math.ceil(self.num_train_epochs * batches * per_batch))


_OFF = (None, False, "", "no")
"""The spellings of "off" that argument parsers give a field at its default (transformers' parser turns the
default 'no' of a str-or-bool field into False, and '' into None)."""


def _differs(value: Any, default: Any) -> bool:
    """Returns whether a field's value is other than its default (enums compared by value, "off" by meaning)."""
    value, default = plain(value), plain(default)
    try:
        if value is not True and default is not True and value in _OFF and default in _OFF:
            return False
        return bool(value != default)
    except Exception:  # noqa: BLE001 - an array or other value without a plain truth: it was set
        return True


def _checked(name: str, value: Any) -> Any:
    """Returns the value a field is set to (JSON strings of dict fields parsed), refusing a value cohort does not
    implement with the nearest option."""
    if name in _DICT_FIELDS and isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ConfigError(f"GRPOConfig({name}={value!r}): give a dict or its JSON ({e})") from None
    spec = TRL_FIELDS.get(name)
    if spec is not None:
        if spec.cohort is None and not spec.any_value and _differs(value, spec.default):
            raise ConfigError(
                f"GRPOConfig({name}={value!r}) is not implemented by cohort; nearest: {spec.note}. "
                f"Leave it out (TRL's default is {spec.default!r})"
            )
        return value
    if name in ANY_VALUE:
        return value
    default = DEFAULTS[name]
    if _differs(value, default) and not _same_behaviour(name, value):
        raise ConfigError(
            f"GRPOConfig({name}={value!r}): transformers' TrainingArguments field {name!r} is not implemented by "
            f"cohort; leave it at its default ({default!r}). docs/trl.md lists what is mapped"
        )
    return value


def _same_behaviour(name: str, value: Any) -> bool:
    """Returns whether a TrainingArguments value other than the default asks for what cohort does anyway."""
    if name == "optim":  # cohort's AdamW is torch's, fused where every parameter allows
        return plain(value) in ("adamw_torch", "adamw_torch_fused")
    if name == "gradient_checkpointing_kwargs":  # cohort checkpoints non-reentrantly
        return isinstance(value, dict) and value in ({}, {"use_reentrant": False})
    if name == "logging_strategy":
        return plain(value) == "steps"
    return False


def _unknown_message(name: str) -> str:
    """Returns the error for a GRPOConfig field name that is neither TRL's nor transformers'."""
    close = difflib.get_close_matches(name, list(DEFAULTS), n=3, cutoff=0.6)
    cohort_close = difflib.get_close_matches(
        name, [k.split(".")[-1] for k in _valid_keys(TrainConfig)], n=1, cutoff=0.75
    )
    hint = (
        f"did you mean {', '.join(repr(c) for c in close)}?"
        if close
        else "it is not a field of TRL 1.16's GRPOConfig or of transformers' TrainingArguments"
    )
    if cohort_close and not close:
        hint += f" (cohort's own keys go in GRPOConfig(cohort={{...}}), e.g. {cohort_close[0]!r})"
    return f"unknown GRPOConfig field {name!r}: {hint}"
