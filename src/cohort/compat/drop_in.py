"""TRL's `GRPOConfig` / `GRPOTrainer(model=, reward_funcs=, args=, train_dataset=, ...)` mapped onto cohort.

A TRL GRPO script runs on cohort with only its import changed: `GRPOConfig` takes TRL's field names,
and `to_train_config` turns them into cohort's config tree in this one place (`TRL_FIELDS` is the
mapping; docs/trl.md is generated from it). A TRL field cohort does not implement is accepted only at
TRL's default value; any other value is an error naming the nearest cohort option, so nothing a user
asks for is silently ignored. A name that is neither (a typo) gets "did you mean".
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import math
import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from cohort.compat.fields import TRL_FIELDS as TRL_FIELDS  # re-exported: the table lives in a leaf module
from cohort.compat.fields import Field as Field
from cohort.config import TrainConfig, _valid_keys, load_config, torchrun_world_size
from cohort.errors import ConfigError, TrainingError
from cohort.models import load_tokenizer


class GRPOConfig:
    """TRL's GRPOConfig, by field name: `GRPOConfig(output_dir=..., learning_rate=..., num_generations=...)`.

    Fields read as attributes, with TRL's defaults for those not given. `cohort` takes cohort's own keys
    on top (`{"fast.segments": "off"}` or `{"micro_batch_tokens": 4096}`)."""

    def __init__(self, output_dir: str | None = None, *, cohort: dict[str, Any] | None = None, **fields: Any):
        given = {"output_dir": output_dir, **fields} if output_dir is not None else dict(fields)
        unknown = [k for k in given if k not in TRL_FIELDS]
        if unknown:
            raise ConfigError("; ".join(_unknown_message(k) for k in unknown))
        for name, value in given.items():
            spec = TRL_FIELDS[name]
            if spec.cohort is None and value != spec.default:
                raise ConfigError(
                    f"GRPOConfig({name}={value!r}) is not implemented by cohort; nearest: {spec.note}. "
                    f"Leave it out (TRL's default is {spec.default!r})"
                )
        self._given = given
        self.cohort = dict(cohort or {})

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name == "cohort":
            raise AttributeError(name)
        if name in self._given:
            return self._given[name]
        if name in TRL_FIELDS:
            return TRL_FIELDS[name].default
        # Callbacks (W&B, MLflow, early stopping) read TrainingArguments' other fields: their defaults.
        defaults = _training_arguments_defaults()
        if name in defaults:
            return defaults[name]
        raise AttributeError(f"GRPOConfig has no field {name!r}")

    def to_dict(self) -> dict[str, Any]:
        """Returns every TRL field cohort knows with its value (TrainingArguments.to_dict, which callbacks log)."""
        return {**{k: spec.default for k, spec in TRL_FIELDS.items()}, **self._given}

    def __repr__(self) -> str:
        return f"GRPOConfig({', '.join(f'{k}={v!r}' for k, v in self._given.items())})"

    def given(self) -> dict[str, Any]:
        """Returns the fields set explicitly, by TRL name."""
        return dict(self._given)

    def to_train_config(self, model: str, num_rows: int | None) -> TrainConfig:
        """Returns cohort's TrainConfig for these fields, the model `model` and a dataset of `num_rows` rows."""
        g = self._given
        out: dict[str, Any] = {"model.name_or_path": model, "rewards": [], "progress": True}
        out["out_dir"] = g.get("output_dir") or "trainer_output"
        out["seed"] = g.get("seed", 42)
        # cohort's rollout.batch_size is per process (each process samples whole groups of its own prompts),
        # TRL's generation batch is per_device x steps_per_generation on each device: the same count.
        world = torchrun_world_size()  # every process samples its own prompts
        per_generation = self.steps_per_generation_resolved(world)
        out["rollout.batch_size"] = self.per_device_train_batch_size * per_generation
        out["rollout.group_size"] = self.num_generations
        out["algo.num_minibatches"] = per_generation // self.gradient_accumulation_steps
        out["eval_batch_size"] = self.per_device_eval_batch_size
        for name in ("max_completion_length", "temperature", "top_p"):
            out[f"rollout.{name}"] = getattr(self, name)
        out["rollout.top_k"] = self.top_k or 0
        if self.chat_template_kwargs:
            out["data.chat_template_kwargs"] = dict(self.chat_template_kwargs)
        if g.get("max_prompt_length") is not None:
            out["data.max_prompt_length"] = g["max_prompt_length"]
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
        out["optim.schedule"] = self.lr_scheduler_type
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
        out["save_every"] = (
            0 if self.save_strategy == "no" else (self.save_steps if self.save_strategy == "steps" else 0)
        )
        if self.save_strategy not in ("no", "steps"):
            raise ConfigError(
                f"GRPOConfig(save_strategy={self.save_strategy!r}): cohort saves by steps ('steps') or at the end ('no')"
            )
        if self.save_total_limit is not None:
            out["keep_checkpoints"] = max(1, int(self.save_total_limit))
        if self.eval_strategy not in ("no", "steps"):
            raise ConfigError(
                f"GRPOConfig(eval_strategy={self.eval_strategy!r}): cohort evaluates by steps ('steps') or not ('no')"
            )
        out["eval_every"] = (self.eval_steps or 0) if self.eval_strategy == "steps" else 0
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
        # logging_steps, save_steps and eval_steps count optimizer steps (a value in (0, 1): that fraction of
        # max_steps); cohort acts on whole generation batches, so each rounds up to them.
        out["logging_steps"] = self.logging_steps
        if self.eval_strategy == "steps" and not self.eval_steps:
            out["eval_every"] = self.logging_steps  # TRL's default for eval_steps
        for key in ("logging_steps", "save_every", "eval_every"):
            every = out[key]
            if isinstance(every, float) and 0 < every < 1:
                every = max(1, math.ceil(every * steps))
            out[key] = math.ceil(every / per_batch) if every else 0
        out.update(self.cohort)
        return load_config(None, out)

    def steps_per_generation_resolved(self, world: int = 1) -> int:
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
        per_generation = self.steps_per_generation_resolved(world)
        prompts = self.per_device_train_batch_size * per_generation * world // self.num_generations
        # TRL's sampler drops the last incomplete generation batch of an epoch.
        batches = max(1, num_rows // max(1, prompts))
        per_batch = self.num_iterations * per_generation // self.gradient_accumulation_steps
        return max(1, math.ceil(self.num_train_epochs * batches * per_batch))


@functools.cache
def _training_arguments_defaults() -> dict[str, Any]:
    """Returns transformers.TrainingArguments' field defaults, by name."""
    from transformers import TrainingArguments

    out: dict[str, Any] = {}
    for f in dataclasses.fields(TrainingArguments):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


def _unknown_message(name: str) -> str:
    """Returns the error for a GRPOConfig field name that is neither TRL's nor known to cohort."""
    close = difflib.get_close_matches(name, list(TRL_FIELDS), n=3, cutoff=0.6)
    cohort_close = difflib.get_close_matches(
        name, [k.split(".")[-1] for k in _valid_keys(TrainConfig)], n=1, cutoff=0.75
    )
    hint = (
        f"did you mean {', '.join(repr(c) for c in close)}?"
        if close
        else "it is not a TRL GRPOConfig field cohort knows"
    )
    if cohort_close and not close:
        hint += f" (cohort's own keys go in GRPOConfig(cohort={{...}}), e.g. {cohort_close[0]!r})"
    return f"unknown GRPOConfig field {name!r}: {hint}"


def dataset_rows(
    dataset: Any, *, limit: int | None = None, what: str = "train_dataset"
) -> list[dict[str, Any]] | None:
    """Returns a dataset's rows as dicts: a list of dicts, a `datasets.Dataset`, or an iterable (IterableDataset,
    read up to `limit` rows); None for None."""
    if dataset is None:
        return None
    if isinstance(dataset, list):
        return dataset
    to_list = getattr(dataset, "to_list", None)
    if callable(to_list) and hasattr(dataset, "__len__"):
        return list(to_list())
    if isinstance(dataset, Iterable) and not isinstance(dataset, (str, bytes, dict)):
        rows = []
        for row in dataset:
            rows.append(dict(row))
            if limit is not None and len(rows) >= limit:
                break
        return rows
    raise ConfigError(
        f"{what} must be a list of dicts, a datasets.Dataset or an IterableDataset, got {type(dataset).__name__}"
    )


def peft_to_lora(peft_config: Any) -> dict[str, Any]:
    """Returns cohort `model.lora.*` overrides for a peft.LoraConfig (its other settings must be peft's defaults)."""
    if peft_config is None:
        return {}
    if type(peft_config).__name__ != "LoraConfig":
        raise ConfigError(
            f"peft_config={type(peft_config).__name__}: cohort trains LoRA adapters only; pass a peft.LoraConfig"
        )
    extras = {"bias": "none", "modules_to_save": None, "use_dora": False, "use_rslora": False}
    for name, default in extras.items():
        if getattr(peft_config, name, default) not in (default, None if default is None else default):
            raise ConfigError(
                f"peft_config.{name}={getattr(peft_config, name)!r} is not implemented by cohort's LoRA (leave it at {default!r})"
            )
    targets = peft_config.target_modules
    if targets is None or isinstance(targets, str):
        targets_list = None if targets is None else [targets]
    else:
        targets_list = sorted(targets)
    out = {
        "model.lora.enabled": True,
        "model.lora.r": peft_config.r,
        "model.lora.alpha": peft_config.lora_alpha,
        "model.lora.dropout": peft_config.lora_dropout,
    }
    if targets_list:
        out["model.lora.target_modules"] = targets_list
    return out


def model_name(model: Any) -> str:
    """Returns the name or path a model object was loaded from ('' when unknown)."""
    return str(
        getattr(model, "name_or_path", "")
        or getattr(getattr(model, "config", None), "_name_or_path", "")
        or ""
    )


RewardLike = str | Callable | Any


def mapping_table() -> str:
    """Returns the markdown table of TRL_FIELDS (docs/trl.md embeds it; a test keeps the two equal)."""
    lines = ["| TRL `GRPOConfig` field | TRL default | cohort | how / nearest option |", "|---|---|---|---|"]
    for name, spec in TRL_FIELDS.items():
        target = f"`{spec.cohort}`" if spec.cohort else "not implemented (accepted at TRL's default only)"
        lines.append(f"| `{name}` | `{spec.default!r}` | {target} | {spec.note} |")
    return "\n".join(lines) + "\n"


def trl_arguments(
    model,
    args,
    train_dataset,
    eval_dataset,
    processing_class,
    peft_config,
    train_rows,
    eval_rows,
    tokenizer,
    owns_data: bool = False,
    routed: bool = False,
):
    """Returns (config, train rows, eval rows, model, tokenizer) for GRPOTrainer's TRL form: model, args,
    datasets, processing_class and peft_config mapped onto cohort's config in this one place. `owns_data`: one
    environment factory was given, whose reset() may write the prompts, so no train_dataset is needed (train
    rows are then None and the run's length is max_steps). `routed`: a dict of environment factories was given,
    whose rows name their environment, so a dataset is needed."""
    if model is None:
        raise ConfigError(
            "GRPOTrainer needs a model: model='Qwen/Qwen2.5-0.5B-Instruct', a local folder, or a model object"
        )
    args = args if args is not None else GRPOConfig()
    if not isinstance(args, GRPOConfig):
        raise ConfigError(f"args must be a cohort.GRPOConfig (TRL's field names), got {type(args).__name__}")
    name = str(model) if isinstance(model, (str, os.PathLike)) else model_name(model)
    limit = None
    if args.max_steps and args.max_steps > 0:
        limit = args.max_steps * max(1, args.per_device_train_batch_size * args.gradient_accumulation_steps)
    train = dataset_rows(train_dataset, limit=limit) if train_rows is None else train_rows
    if train is None and routed:
        raise ConfigError(
            "a dict of environment factories routes each row by its `environment` column, so it needs a "
            "train_dataset with that column; or pass a single environment factory, whose reset() may write the prompts"
        )
    if train is None and owns_data:
        if not (args.max_steps and args.max_steps > 0):
            raise ConfigError(
                "training without a train_dataset (the environment's reset writes the prompts) needs the run's "
                "length: set GRPOConfig(max_steps=...)"
            )
        config = args.to_train_config(name, None)
        return config, None, [], model, _tokenizer(model, name, processing_class, tokenizer)
    if train is None:
        raise ConfigError(
            "GRPOTrainer needs train_dataset= (a datasets.Dataset, an IterableDataset or a list of dicts)"
        )
    held = dataset_rows(eval_dataset, what="eval_dataset") if eval_rows is None else eval_rows
    sized = hasattr(train_dataset, "__len__") or train_dataset is None or isinstance(train_dataset, list)
    config = args.to_train_config(name, len(train) if sized else None)
    for key, value in peft_to_lora(peft_config).items():
        section, _, leaf = key.rpartition(".")
        obj = config
        for part in section.split("."):
            obj = getattr(obj, part)
        setattr(obj, leaf, value)
    # TRL evaluates on its eval_steps schedule only; without one cohort evaluates the held-out rows at both ends.
    config.eval_at_ends = bool(held) and args.eval_strategy == "no"
    return config, train, held or [], model, _tokenizer(model, name, processing_class, tokenizer)


def _tokenizer(model: Any, name: str, processing_class: Any, tokenizer: Any) -> Any:
    """Returns the TRL form's tokenizer: processing_class, else the model object's own (None: the trainer loads
    the named model's), with the EOS as pad token when it has none."""
    if processing_class is not None:
        tokenizer = processing_class
    if not isinstance(model, (str, os.PathLike)) and tokenizer is None:
        if not name:
            raise ConfigError("a model object without a name_or_path needs processing_class=<its tokenizer>")
        tokenizer = load_tokenizer(name)
    if tokenizer is not None and tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


@contextlib.contextmanager
def errors_in_trl_terms(active: bool = True) -> Iterator[None]:
    """A block whose ConfigError or TrainingError, when `active` (TRL's form), also names the GRPOConfig fields
    behind the cohort keys its message speaks of (`in_trl_terms`)."""
    try:
        yield
    except (ConfigError, TrainingError) as e:
        if active and e.args and isinstance(e.args[0], str):
            e.args = (in_trl_terms(e.args[0]), *e.args[1:])
        raise


def in_trl_terms(message: str) -> str:
    """Returns `message` followed by the GRPOConfig fields that set the cohort keys it names (as it is when it
    names none): an error of the TRL form speaks of the config the fields were mapped onto."""
    by_key: dict[str, list[str]] = {}
    for name, field in TRL_FIELDS.items():
        key = field.cohort
        if key is None:
            continue
        # a dotted key anywhere as a word; a bare one (steps, seed, out_dir) only where it is given a value
        tail = r"(?![\w]|\.\w)" if "." in key else "="
        if re.search(rf"(?<![\w.]){re.escape(key)}{tail}", message):
            by_key.setdefault(key, []).append(name)
    if not by_key:
        return message
    named = "; ".join(f"{key} is set by {' or '.join(names)}" for key, names in by_key.items())
    return f"{message} (in GRPOConfig's terms: {named})"


def trl_view(cfg: TrainConfig) -> GRPOConfig:
    """Returns a GRPOConfig stating a cohort config in TRL's terms (optimizer steps): what callbacks get as
    `args` when the trainer was built in cohort's form."""
    per_step = cfg.algo.num_iterations * cfg.algo.num_minibatches
    fields: dict[str, Any] = {
        "max_steps": cfg.steps * per_step,
        "seed": cfg.seed,
        "per_device_train_batch_size": cfg.rollout.batch_size // cfg.algo.num_minibatches,
        "num_generations": cfg.rollout.group_size,
        "num_iterations": cfg.algo.num_iterations,
        "max_completion_length": cfg.rollout.max_completion_length,
        "temperature": cfg.rollout.temperature,
        "beta": cfg.algo.beta,
        "learning_rate": cfg.optim.lr,
        "logging_steps": cfg.logging_steps * per_step,
        "save_strategy": "steps" if cfg.save_every else "no",
        "save_steps": (cfg.save_every or 500) * per_step,
        "eval_strategy": "steps" if cfg.eval_every else "no",
        "eval_steps": cfg.eval_every * per_step or None,
        "per_device_eval_batch_size": cfg.eval_batch_size,
        "report_to": [s for s in ("tensorboard", "wandb") if getattr(cfg, s)] or "none",
    }
    if cfg.algo.num_minibatches > 1:
        fields["steps_per_generation"] = cfg.algo.num_minibatches
    return GRPOConfig(output_dir=cfg.out_dir, **fields)


@dataclass
class TrainerInputs:
    """GRPOTrainer's arguments in cohort's terms, whichever form they came in."""

    config: TrainConfig
    reward_funcs: list[Any] | None
    train_rows: list[dict[str, Any]] | None
    eval_rows: list[dict[str, Any]] | None
    model: Any  # a model object, or None: the config names the model to load
    tokenizer: Any
    trl_form: bool  # built as TRL's GRPOTrainer(model=..., args=...): callbacks get `args`, resume waits for train()


def trainer_inputs(
    config: Any,
    reward_funcs: Any,
    args: Any,
    train_dataset: Any,
    eval_dataset: Any,
    processing_class: Any,
    optimizers: Any,
    peft_config: Any,
    *,
    train_rows: Any,
    eval_rows: Any,
    model: Any,
    tokenizer: Any,
    environment_factory: Any,
) -> TrainerInputs:
    """Returns GRPOTrainer's arguments translated: TRL's keyword forms (a positional model, one reward function,
    args=, train_dataset=, peft_config=) onto the config, datasets as rows, a model path into the config."""
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
    trl_form = config is None
    if config is None:
        with errors_in_trl_terms():
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
    return TrainerInputs(config, reward_funcs, train_rows, eval_rows, model, tokenizer, trl_form)
