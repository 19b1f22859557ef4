"""Supervised fine-tuning on prompt / completion pairs: the R1 pipeline's cold start before GRPO.

The loss is the mean negative log-likelihood of completion tokens (prompt tokens are context only). It
goes through the same chunked log-prob path as GRPO, so the full [B, T, V] logits never materialise.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from cohort.logprobs import completion_logprobs
from cohort.optim import make_adamw, make_scheduler


@dataclass
class SFTConfig:
    """A supervised fine-tuning run."""

    steps: int = 200
    """Optimizer steps."""
    batch_size: int = 32
    """Examples per optimizer step."""
    lr: float = 1e-3
    """Peak learning rate (AdamW, linear warm-up then cosine decay)."""
    warmup_steps: int = 10
    """Linear warm-up steps."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    max_grad_norm: float = 1.0
    """Gradient-norm clip (0 disables)."""
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
    params = [p for p in model.parameters() if p.requires_grad]
    # torch's default (unfused) AdamW: the demo's warm start and its printed accuracies depend on it
    opt = make_adamw(params, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=False)
    sched = make_scheduler(opt, "cosine", cfg.warmup_steps, cfg.steps)
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
        if cfg.max_grad_norm:
            torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
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
