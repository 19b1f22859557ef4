"""Argument checks shared by the algo modules: every error names the bad value, the valid ones and the fix.

All checks look at shapes, types and Python scalars only, never at tensor values, so none of them forces a
device synchronisation.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def check_choice(name: str, value: object, options: Iterable[str]) -> str:
    """Return `value` if it is one of `options`, else raise a ValueError listing them."""
    options = tuple(options)
    if not isinstance(value, str) or value not in options:
        valid = ", ".join(repr(o) for o in options)
        raise ValueError(f"unknown {name} {value!r}; valid options: {valid}. Fix: pass one of them.")
    return value


def check_group_size(n: int, group_size: object, what: str = "rewards") -> int:
    """Return `group_size` after checking it is a positive int that divides `n`."""
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(
            f"group_size must be a positive int (completions per prompt), got {group_size!r}. "
            "Fix: pass the number of completions sampled per prompt, e.g. group_size=8."
        )
    if n % group_size != 0:
        raise ValueError(
            f"{what} has {n} rows, which is not divisible by group_size={group_size}; rows must hold whole "
            f"groups of {group_size} consecutive completions per prompt. "
            f"Fix: pass all {group_size} completions of every prompt (N = prompts * group_size)."
        )
    return group_size


def check_tensor(name: str, value: object) -> torch.Tensor:
    """Return `value` if it is a torch.Tensor, else raise a TypeError."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(
            f"{name} must be a torch.Tensor, got {type(value).__name__}. Fix: torch.as_tensor(...)."
        )
    return value


def as_float(name: str, value: object) -> torch.Tensor:
    """Return `value` as a floating tensor (integers and bools become the default float dtype)."""
    t = value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
    if not t.is_floating_point():
        t = t.to(torch.get_default_dtype())
    return t


def check_nonneg(name: str, value: object, *, strictly: bool = False) -> float:
    """Return `value` as a float after checking it is a (strictly) non-negative real number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r} ({type(value).__name__}).")
    if value < 0 or (strictly and value == 0) or value != value:
        bound = "> 0" if strictly else ">= 0"
        raise ValueError(f"{name} must be {bound}, got {value!r}. Fix: pass a value {bound}.")
    return float(value)
