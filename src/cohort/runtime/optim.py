"""The optimizer and learning-rate schedule shared by GRPO (`cohort.trainer`) and SFT (`cohort.commands.sft`)."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from cohort.choices import SCHEDULES

__all__ = ["SCHEDULES", "applied_lr", "make_adamw", "make_scheduler"]


def make_adamw(
    params: Iterable[torch.nn.Parameter],
    *,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    fused: bool = True,
) -> torch.optim.AdamW:
    """Returns AdamW over `params`, with the fused kernel when `fused` and every parameter supports it.

    The fused kernel updates all parameters in one call (CPU and CUDA); the per-tensor loop costs more
    than the arithmetic on small models. `fused=False` leaves the choice to torch's default.
    """
    params = list(params)
    use_fused = fused and all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)
    return torch.optim.AdamW(
        params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=use_fused or None
    )


def make_scheduler(
    optimizer: torch.optim.Optimizer, schedule: str, warmup: int, total: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """Returns a LambdaLR implementing linear warm-up then constant / linear / cosine decay over `total` steps.

    Not `transformers.get_scheduler` ("constant_with_warmup", "linear", "cosine"), which matches it after
    the warm-up but not during it: there step k gets (k + 1) / warmup of the peak here and k / warmup there
    (a first step at learning rate 0); and past `total` its cosine rises again where this one stays at 0.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is not valid; choose one of: {', '.join(SCHEDULES)}")

    def factor(step: int) -> float:
        if warmup > 0 and step < warmup:
            return (step + 1) / warmup
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        if schedule == "linear":
            return max(0.0, 1.0 - progress)
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def applied_lr(
    optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler | None
) -> float:
    """Returns the learning rate the last optimizer step used (the current one before any step): what TRL logs as
    `learning_rate`, where the optimizer's own holds the next step's once the schedule has stepped."""
    lambdas = getattr(scheduler, "lr_lambdas", None)
    if scheduler is None or not lambdas or scheduler.last_epoch < 1:
        return float(optimizer.param_groups[0]["lr"])
    return float(scheduler.base_lrs[0] * lambdas[0](scheduler.last_epoch - 1))
