"""TRL's `GRPOConfig` / `GRPOTrainer(model=, reward_funcs=, args=, train_dataset=, ...)` mapped onto cohort.

A TRL GRPO script runs on cohort with only its import changed: `GRPOConfig` (`cohort.compat.trl_config`) takes
TRL's field names and its `to_train_config` turns them into cohort's config tree (`TRL_FIELDS` is the mapping;
docs/trl.md is generated from it); this module translates the trainer's other arguments (model, datasets,
processing class, peft config) and states errors in TRL's terms.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from cohort.compat.fields import ANY_VALUE
from cohort.compat.fields import TRL_FIELDS as TRL_FIELDS  # re-exported: the table lives in a leaf module
from cohort.compat.fields import Field as Field
from cohort.compat.trl_config import GRPOConfig as GRPOConfig
from cohort.config import TrainConfig
from cohort.errors import ConfigError, TrainingError
from cohort.models import load_tokenizer


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
    if isinstance(dataset, dict) and what == "eval_dataset":
        raise ConfigError(
            f"eval_dataset={{{', '.join(repr(k) for k in list(dataset)[:3])}: ...}}: a dict of evaluation datasets "
            "(TRL evaluates each under its name) is not implemented by cohort; pass one dataset (concatenate them, "
            "e.g. datasets.concatenate_datasets) or evaluate each with its own trainer.evaluate() run"
        )
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
    """Returns the markdown tables of TRL_FIELDS and ANY_VALUE (docs/trl.md embeds them; a test keeps the two
    equal)."""
    lines = ["| TRL `GRPOConfig` field | TRL default | cohort | how / nearest option |", "|---|---|---|---|"]
    for name, spec in TRL_FIELDS.items():
        if spec.cohort:
            target = f"`{spec.cohort}`"
        elif spec.any_value:
            target = "not implemented (accepted at any value)"
        else:
            target = "not implemented (accepted at TRL's default only)"
        lines.append(f"| `{name}` | `{spec.default!r}` | {target} | {spec.note} |")
    lines += [
        "",
        "transformers' `TrainingArguments` fields not above are fields of `GRPOConfig` too, accepted at their "
        "default only (`optim` also at `'adamw_torch'`, `gradient_checkpointing_kwargs` at "
        "`{'use_reentrant': False}`: what cohort does), except these, accepted at any value:",
        "",
        "| `TrainingArguments` field | why |",
        "|---|---|",
    ]
    lines += [f"| `{name}` | {why} |" for name, why in ANY_VALUE.items()]
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
    datasets: tuple[Any, Any] = (
        None,
        None,
    )  # the training and evaluation data as given (trainer.train_dataset ...)


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
    rollout_func: Any = None,
) -> TrainerInputs:
    """Returns GRPOTrainer's arguments translated: TRL's keyword forms (a positional model, one reward function,
    args=, train_dataset=, peft_config=) onto the config, datasets as rows, a model path into the config."""
    if rollout_func is not None:
        raise ConfigError(
            "GRPOTrainer(rollout_func=...) is not implemented by cohort: it generates with its own engine. "
            "Multi-turn rollouts take tools=[...] or environment_factory=... (docs/agents.md); an external "
            "generator serves as a rollout worker (rollout.workers, docs/serving.md)"
        )
    datasets = (
        train_dataset if train_dataset is not None else train_rows,
        eval_dataset if eval_dataset is not None else eval_rows,
    )
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
    return TrainerInputs(config, reward_funcs, train_rows, eval_rows, model, tokenizer, trl_form, datasets)
