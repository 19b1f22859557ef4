"""Supervised fine-tuning on prompt / completion pairs: the R1 pipeline's cold start before GRPO.

The loss is the mean negative log-likelihood of completion tokens (prompt tokens are context only). It
goes through the same chunked log-prob path as GRPO, so the full [B, T, V] logits never materialise.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from cohort.config.schema import OptimConfig, optim_aliases
from cohort.logprobs import completion_logprobs
from cohort.models import text_config
from cohort.runtime.optim import make_adamw, make_scheduler


@optim_aliases("lr", "warmup_steps", "weight_decay", "max_grad_norm")
@dataclass
class SFTConfig:
    """A supervised fine-tuning run.

    The optimizer settings are the `optim` section (an OptimConfig, as GRPO's); the older flat keywords and
    attributes `lr`, `warmup_steps`, `weight_decay` and `max_grad_norm` are aliases of its fields, so
    ``SFTConfig(lr=3e-3)`` changes only the learning rate of SFT's defaults."""

    steps: int = 200
    """Optimizer steps."""
    batch_size: int = 32
    """Examples per optimizer step."""
    optim: OptimConfig = field(
        default_factory=lambda: OptimConfig(lr=1e-3, warmup_steps=10, schedule="cosine", adam_beta2=0.999)
    )
    """AdamW and the schedule: peak lr 1e-3, 10 linear warm-up steps then cosine decay over `steps`, betas
    0.9 / 0.999, no weight decay, the gradient norm clipped at 1."""
    seed: int = 0
    """Seed for the example order."""
    log_every: int = 10
    """Report the loss every this many steps."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Free-form notes saved with the run."""


def encode_pairs(
    tokenizer: Any, prompt_ids: list[list[int]], completions: list[str]
) -> list[tuple[list[int], list[int]]]:
    """Return (prompt ids, completion ids + EOS) pairs ready for :func:`sft_train`."""
    eos = tokenizer.eos_token_id
    pairs = []
    for p, c in zip(prompt_ids, completions):
        ids = tokenizer(c, add_special_tokens=False)["input_ids"]
        pairs.append((list(p), list(ids) + [eos]))
    return pairs


def check_output_folder(
    out: str | os.PathLike,
    model: str | os.PathLike,
    *,
    flag: str = "--out",
    made: str = "the fine-tuned model",
    read: str = "model folder",
) -> None:
    """Returns None; raises ValueError, before anything loads, when the folder `out` is the local folder `model` a
    command reads (SFT's model, `cohort merge`'s adapter), or a folder holding it: saving there would write `made`
    over what it was made from."""
    source = Path(os.fspath(model)).expanduser()
    if not source.is_dir():  # a Hub name: nothing local to overwrite
        return
    source, target = source.resolve(), Path(os.fspath(out)).expanduser().resolve()
    if target == source or target in source.parents:
        raise ValueError(
            f"{flag} {os.fspath(out)} would write {made} over the {read} {os.fspath(model)} it is read from; "
            "choose another folder"
        )


def check_context(model: torch.nn.Module, pairs: list[tuple[list[int], list[int]]]) -> None:
    """Returns None; raises ValueError when a prompt + completion pair is longer than the model's context.

    Positions past ``max_position_embeddings`` were never trained: `cohort train` refuses prompts that leave
    no room for their completions there, and SFT refuses pairs that run past it the same way."""
    context = getattr(text_config(model), "max_position_embeddings", None)
    if not isinstance(context, int) or context <= 0:
        return
    long = [i for i, (p, c) in enumerate(pairs) if len(p) + len(c) > context]
    if long:
        longest = max(len(pairs[i][0]) + len(pairs[i][1]) for i in long)
        raise ValueError(
            f"{len(long)} of {len(pairs)} SFT pairs (row {long[0]} first, the longest {longest} tokens of prompt, "
            f"completion and EOS) do not fit within the model's context of {context} tokens "
            "(max_position_embeddings): shorten them, or leave them out of the data"
        )


def sft_train(
    model: torch.nn.Module,
    pairs: list[tuple[list[int], list[int]]],
    cfg: SFTConfig,
    *,
    log: Callable[[dict[str, float]], None] | None = None,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    stop: Callable[[int], bool] | None = None,
    check_every: int = 25,
) -> list[dict[str, float]]:
    """Return the logged losses after `cfg.steps` optimizer steps of completion-only cross-entropy.

    `stop(step)`, when given, is asked every `check_every` steps and ends training early when it
    returns True (the demo stops its warm start once a validation accuracy is reached).
    """
    if not pairs:
        raise ValueError("SFT needs at least one prompt/completion pair; the dataset is empty")
    if any(len(c) == 0 for _, c in pairs):
        raise ValueError("an SFT example has an empty completion; every row needs completion text")
    check_context(model, pairs)
    params = [p for p in model.parameters() if p.requires_grad]
    o = cfg.optim
    # torch's default (unfused) AdamW: the demo's warm start and its printed accuracies depend on it
    opt = make_adamw(
        params,
        lr=o.lr,
        betas=(o.adam_beta1, o.adam_beta2),
        eps=o.adam_eps,
        weight_decay=o.weight_decay,
        fused=False,
    )
    sched = make_scheduler(opt, o.schedule, o.warmup_steps, cfg.steps)
    g = torch.Generator().manual_seed(cfg.seed)
    order: list[int] = []
    history = []
    model.eval()  # no dropout: SFT here is a warm start, and eval-mode keeps runs reproducible
    t0 = time.perf_counter()
    for step in range(1, cfg.steps + 1):
        idx: list[int] = []
        while len(idx) < cfg.batch_size:
            if not order:
                order = torch.randperm(len(pairs), generator=g).tolist()
            idx.append(order.pop())
        prompts = [pairs[i][0] for i in idx]
        comps = [pairs[i][1] for i in idx]
        with autocast():
            lp = completion_logprobs(model, prompts, comps, 1)
        loss = -(lp.logp * lp.mask).sum() / lp.mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if o.max_grad_norm:
            torch.nn.utils.clip_grad_norm_(params, o.max_grad_norm)
        opt.step()
        sched.step()
        stopping = stop is not None and step % check_every == 0 and stop(step)
        if step % cfg.log_every == 0 or step == cfg.steps or stopping:
            row = {"step": step, "loss": float(loss.detach()), "seconds": time.perf_counter() - t0}
            history.append(row)
            if log:
                log(row)
        if stopping:
            break
    return history
