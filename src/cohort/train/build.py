"""Building a run's inputs from its config: the device, the prompt rows and their token ids, the policy model."""

from __future__ import annotations

import os
from typing import Any

import torch

from cohort.config import TrainConfig
from cohort.data import encode_prompts, load_rows, make_task
from cohort.errors import ConfigError, TrainingError
from cohort.models import load_model, load_tokenizer, text_config, wrap_lora
from cohort.report import quiet_hf_progress


def resolve_device(name: str) -> torch.device:
    """Return the torch device a config's device string means ("auto" = CUDA when available)."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        return torch.device("cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"model.device={name!r}: CUDA is not available in this torch build; use cpu or auto")
    return device


def load_prompt_rows(cfg: TrainConfig) -> tuple[list[dict], list[dict]]:
    """Return (train rows, held-out rows) for the config's built-in task or dataset."""
    d = cfg.data
    if d.path:
        train = load_rows(d.path, split=d.split, prompt_column=d.prompt_column, subset=d.subset)
        eval_subset = (
            d.eval_subset if d.eval_subset is not None else (d.subset if d.eval_path == d.path else None)
        )
        held = (
            load_rows(d.eval_path, split=d.eval_split, prompt_column=d.prompt_column, subset=eval_subset)
            if d.eval_path
            else []
        )
    else:
        assert d.task is not None  # validate() requires data.path or data.task
        train, held = make_task(
            d.task, n_train=d.n_train, n_eval=d.n_eval, seed=d.task_seed, **d.task_options
        )
    return train, held[: cfg.eval_limit] if held else held


def load_policy(
    cfg: TrainConfig, model: torch.nn.Module | None, tokenizer: Any, device: torch.device
) -> tuple[torch.nn.Module, Any]:
    """Returns (the policy to train, its tokenizer): the given ones or the config's, loaded, with LoRA when
    configured, on `device`, in eval mode (no dropout) and with activation checkpointing when asked."""
    tokenizer = tokenizer or load_tokenizer(
        cfg.model.name_or_path, trust_remote_code=cfg.model.trust_remote_code
    )
    given = model is not None
    with quiet_hf_progress():  # no "Loading weights" bar
        policy = model or load_model(
            cfg.model.name_or_path,
            dtype=cfg.model.dtype,
            device=str(device),
            trust_remote_code=cfg.model.trust_remote_code,
            attn_implementation=cfg.model.attn_implementation,
            lora=cfg.model.lora if cfg.model.lora.enabled else None,
            trainable_adapter=True,  # an adapter folder given as the model continues training as LoRA
        )
    if given and cfg.model.lora.enabled and not hasattr(policy, "disable_adapter"):
        policy = wrap_lora(policy, cfg.model.lora)  # a model object given with a LoRA config
    policy.to(device)
    policy.eval()  # dropout off: π_old must equal the detached current policy at μ = 1
    if cfg.model.gradient_checkpointing:
        # Non-reentrant: no input needs requires_grad (LoRA's frozen embeddings included), and the
        # recomputation sees the same masks; the layers train only during updates (cohort.update).
        if callable(getattr(policy, "activation_checkpointing_enable", None)):  # transformers >= 5
            policy.activation_checkpointing_enable(  # type: ignore[operator]
                activation_checkpointing_kwargs={"use_reentrant": False}
            )
        elif callable(getattr(policy, "gradient_checkpointing_enable", None)):
            policy.gradient_checkpointing_enable(  # type: ignore[operator]
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        else:
            raise ConfigError(
                f"model.gradient_checkpointing=true, but {type(policy).__name__} cannot checkpoint "
                "activations (not a transformers model); set it to false"
            )
    return policy, tokenizer


def encode_rows(cfg: TrainConfig, tokenizer: Any, rows: list[dict]) -> list[list[int]]:
    """Returns the token ids of each row's prompt (through the chat template for conversations)."""
    d = cfg.data
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
        if long:
            raise TrainingError(
                f"{len(long)} {where} prompts (the longest {max(long)} tokens) do not leave room for "
                f"rollout.max_completion_length={max_completion_length} tokens within the "
                f"model's context of {context} (max_position_embeddings); set data.max_prompt_length="
                f"{max(room, 1)} to leave them out, or lower rollout.max_completion_length"
            )
