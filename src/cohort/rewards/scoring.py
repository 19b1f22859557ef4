"""Call reward functions and collect their outputs into one [N, R] tensor, rejecting bad outputs loudly.

A reward function that raises, returns the wrong number of values, or returns something that is not
a finite real number (bools included) stops the step with :class:`RewardFunctionError`; nothing is
broadcast, cast or zeroed silently. ``None`` is allowed and becomes NaN ("not applicable").
"""

from __future__ import annotations

import copy
import functools
import math
import numbers
import reprlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from cohort.data.loading import RESERVED_COLUMNS

__all__ = ["RewardFunctionError", "reward_name", "reward_weights", "score"]

_repr = reprlib.Repr()
_repr.maxlist = _repr.maxtuple = 6
_repr.maxstring = _repr.maxother = 60


class RewardFunctionError(ValueError):
    """A reward function raised or returned something other than N finite numbers / Nones."""

    def __init__(self, func_name: str, message: str):
        super().__init__(f"reward function {func_name!r} {message}")
        self.func_name = func_name


def reward_name(func: Callable) -> str:
    """Returns the name a reward function is reported under (its ``__name__``; partials unwrapped)."""
    while isinstance(func, functools.partial):
        func = func.func
    return getattr(func, "__name__", type(func).__name__)


def reward_weights(weights: Sequence[float] | None, funcs: Sequence[Callable | str]) -> torch.Tensor:
    """Returns the weights of the reward functions `funcs` as a float32 tensor [R] (1.0 each when `weights`
    is None), after checking that there is one finite number per function.

    `funcs` are the functions a run actually scores with (or their specs, e.g. a config's `rewards`); only
    their number and names are used, so the weights can be checked before anything is loaded.
    """
    names = [f if isinstance(f, str) else reward_name(f) for f in funcs]
    if weights is None:
        return torch.ones(len(names), dtype=torch.float32)
    if isinstance(weights, (str, bytes)) or not isinstance(weights, (Sequence, np.ndarray, torch.Tensor)):
        raise ValueError(
            f"reward_weights={weights!r} must be a list of numbers, one per reward function {names}"
        )
    values = list(weights.tolist() if isinstance(weights, (np.ndarray, torch.Tensor)) else weights)
    if len(values) != len(names):
        raise ValueError(
            f"reward_weights has {len(values)} values but there are {len(names)} reward functions {names}: "
            "give one weight per function"
        )
    for i, (w, name) in enumerate(zip(values, names)):
        if isinstance(w, (bool, np.bool_)) or not isinstance(w, numbers.Real):
            raise ValueError(
                f"reward_weights[{i}]={w!r} (for {name!r}) is not a number; give one float per function"
            )
        if not math.isfinite(w):
            raise ValueError(
                f"reward_weights[{i}]={float(w)} (for {name!r}) is not finite; every weight must be a finite "
                "number (use 0 to switch a reward off)"
            )
    return torch.tensor([float(w) for w in values], dtype=torch.float32)


def _as_list(name: str, out: Any) -> list[Any]:
    """Returns a reward function's output as a list, or raises if it is not a 1-D sequence."""
    if isinstance(out, (np.ndarray, torch.Tensor)):
        if out.ndim != 1:
            raise RewardFunctionError(
                name, f"returned an array of shape {tuple(out.shape)}; return one value per completion (1-D)"
            )
        return out.tolist()
    if not isinstance(out, (list, tuple)):
        raise RewardFunctionError(
            name,
            f"returned {type(out).__name__} {_repr.repr(out)}; it must return a list with one float or None per completion",
        )
    return list(out)


def _to_float(name: str, index: int, value: Any, out: list[Any]) -> float:
    """Returns one reward as a float (NaN for None), or raises naming the offending entry."""
    if value is None:
        return math.nan
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise RewardFunctionError(
            name,
            f"returned a {type(value).__name__} ({_repr.repr(value)}) at index {index}: {_repr.repr(out)}; "
            "rewards must be int, float or None (convert bools with float(x))",
        )
    x = float(value)
    if not math.isfinite(x):
        raise RewardFunctionError(
            name,
            f"returned {x} at index {index}: {_repr.repr(out)}; rewards must be finite, use None for "
            "'not applicable'",
        )
    return x


def score(
    funcs: Sequence[Callable],
    *,
    prompts: Sequence[Any],
    completions: Sequence[Any],
    completion_ids: Sequence[Sequence[int]] | None = None,
    columns: Mapping[str, Sequence[Any]] | None = None,
) -> torch.Tensor:
    """Returns the rewards [N, R] float32 of N completions under R functions, NaN where a function gave None.

    Every function is called as ``f(prompts=, completions=, completion_ids=, **columns)`` with all
    sequences of length N (group-contiguous, the prompt and columns repeated per completion). Weights
    are not applied here: see :func:`reward_weights` and ``cohort.algo.combine_rewards``.
    """
    funcs = list(funcs)
    columns = dict(columns or {})
    n = len(completions)
    if not funcs:
        raise ValueError(
            "score() needs at least one reward function, e.g. resolve_reward_funcs(['accuracy'])"
        )
    if len(prompts) != n:
        raise ValueError(
            f"score(): {len(prompts)} prompts for {n} completions; repeat each prompt once per completion"
        )
    if completion_ids is not None and len(completion_ids) != n:
        raise ValueError(f"score(): {len(completion_ids)} completion_ids rows for {n} completions")
    clash = sorted(RESERVED_COLUMNS & set(columns))
    if clash:
        raise ValueError(
            f"score(): dataset column(s) {clash} clash with reward-function arguments; rename them"
        )
    for key, values in columns.items():
        if len(values) != n:
            raise ValueError(
                f"score(): column {key!r} has {len(values)} values for {n} completions; repeat each row's "
                "value once per completion"
            )

    out = torch.empty(n, len(funcs), dtype=torch.float32)  # [N, R]
    for j, func in enumerate(funcs):
        name = reward_name(func)
        # Deep copies per call (message dicts included): a function that edits what it receives cannot
        # change what the next function, the logs or a later step see.
        kwargs = {key: copy.deepcopy(list(values)) for key, values in columns.items()}
        try:
            result = func(
                prompts=copy.deepcopy(list(prompts)),
                completions=copy.deepcopy(list(completions)),
                completion_ids=None if completion_ids is None else [list(ids) for ids in completion_ids],
                **kwargs,
            )
        except Exception as exc:
            raise RewardFunctionError(name, f"raised {type(exc).__name__}: {exc}") from exc
        values = _as_list(name, result)
        if len(values) != n:
            raise RewardFunctionError(
                name,
                f"returned {len(values)} values for {n} completions: {_repr.repr(values)}; return exactly one per completion",
            )
        out[:, j] = torch.tensor([_to_float(name, i, v, values) for i, v in enumerate(values)])
    return out
