"""Call reward functions and collect their outputs into one [N, R] tensor, rejecting bad outputs loudly.

The contract is TRL's. Every function is called with keyword arguments: ``prompts``, ``completions``,
``completion_ids``, one list per dataset column, and the three extras ``trainer_state`` (the trainer's
``state``: ``global_step``, ``max_steps``, ``epoch``, ...), ``log_metric(name, value)`` and
``log_extra(column, values)`` (see :class:`RewardLogs`). A function that takes ``**kwargs`` receives all
of them; one without ``**kwargs`` receives only the arguments it names, so ``def f(completions, answer)``
works too. The signature is read once per function (:func:`reward_signature`).

A function returns one value per completion: float, int, bool, a numpy scalar or a 0-d array / tensor,
or None ("not applicable", NaN in the tensor); a list, a tuple, or a whole 1-D numpy array / torch
tensor. ``async def`` functions are allowed: the step's coroutines are awaited together (see
:func:`run_awaitables`). A function that raises, returns the wrong number of values, or returns something
that is not a finite real number stops the step with :class:`RewardFunctionError`; nothing is broadcast
or zeroed silently.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import copy
import functools
import inspect
import math
import numbers
import os
import reprlib
import threading
import weakref
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Any

import numpy as np
import torch

from cohort.config.validation import check_reward_weights
from cohort.data.sources import RESERVED_COLUMNS

__all__ = [
    "EXTRA_ARGUMENTS",
    "REWARD_ARGUMENTS",
    "RewardFunctionError",
    "RewardLogs",
    "RewardSignature",
    "StepRewards",
    "check_reward_columns",
    "reward_name",
    "reward_signature",
    "reward_weights",
    "run_awaitables",
    "score",
]

EXTRA_ARGUMENTS = frozenset({"trainer_state", "log_metric", "log_extra"})
"""The keyword arguments TRL adds to the data: passed to functions that take ``**kwargs`` or name them."""

EPISODE_ARGUMENTS = frozenset({"environments", "episodes"})
"""The keyword arguments of a multi-turn run, passed as they are (not copied): ``environments``, each rollout's
environment instance (TRL's), and ``episodes``, each rollout's ``cohort.rollout.EpisodeRecord`` (cohort's)."""

REWARD_ARGUMENTS = RESERVED_COLUMNS | EXTRA_ARGUMENTS | EPISODE_ARGUMENTS
"""Every argument name cohort fills itself; a dataset column may not use one."""

SAMPLE_FIELDS = frozenset(
    {"step", "group", "prompt", "completion", "reward", "advantage", "in_loss", "length", "truncated"}
)
"""The fields of a logged sample, which ``log_extra`` columns may not replace."""

METRIC_STATS = frozenset({"mean", "std"})
"""The per-function statistics cohort logs itself as ``rewards/<func>/<stat>``."""

_repr = reprlib.Repr()
_repr.maxlist = _repr.maxtuple = 6
_repr.maxstring = _repr.maxother = 60


class RewardFunctionError(ValueError):
    """A reward function raised or returned something other than N finite numbers / Nones."""

    def __init__(self, func_name: str, message: str):
        super().__init__(f"reward function {func_name!r} {message}")
        self.func_name = func_name


class RewardSignatureError(RewardFunctionError, TypeError):
    """A reward function's signature cannot take the keyword arguments it is called with. A TypeError for
    the Python API, and a ValueError so that the command line reports it in one line, as a user error."""


def reward_name(func: Callable) -> str:
    """Returns the name a reward function is reported under (its ``__name__``; partials unwrapped; a model's
    folder or hub name)."""
    while isinstance(func, functools.partial):
        func = func.func
    if isinstance(func, torch.nn.Module):  # a model not wrapped yet (specs checked before resolution)
        path = str(getattr(getattr(func, "config", None), "_name_or_path", "") or "")
        return PurePath(path.rstrip("/\\")).name or type(func).__name__
    return getattr(func, "__name__", type(func).__name__)


def _as_specs(funcs: Any) -> list[Any]:
    """Returns `funcs` as a list: one spec (string, path, callable, model) becomes a list of one."""
    if isinstance(funcs, (str, os.PathLike)) or callable(funcs):
        return [funcs]
    return list(funcs)


def reward_weights(
    weights: Sequence[float] | None, funcs: Sequence[Callable | str] | Callable | str
) -> torch.Tensor:
    """Returns the weights of the reward functions `funcs` as a float32 tensor [R] (1.0 each when `weights`
    is None), after checking that there is one finite number per function.

    `funcs` are the functions a run actually scores with (or their specs, e.g. a config's `rewards`; one
    spec alone counts as a list of one); only their number and names are used, so the weights can be
    checked before anything is loaded.
    """
    names = [f if isinstance(f, str) else reward_name(f) for f in _as_specs(funcs)]
    if isinstance(weights, (np.ndarray, torch.Tensor)):
        weights = weights.tolist()
    return torch.tensor(check_reward_weights(weights, names), dtype=torch.float32)


# ---------------------------------------------------------------------------------------------- signatures
@dataclass(frozen=True)
class RewardSignature:
    """The keyword arguments a reward function accepts, read once from its signature."""

    params: frozenset[str]
    """Arguments it names (keyword-capable ones)."""
    required: tuple[str, ...]
    """Named arguments without a default."""
    var_keyword: bool
    """Whether it takes ``**kwargs`` (then it receives every argument)."""

    def accepts(self, name: str) -> bool:
        """Returns whether the function can be passed the keyword argument `name`."""
        return self.var_keyword or name in self.params


_SIGNATURES: weakref.WeakKeyDictionary[Any, RewardSignature] = weakref.WeakKeyDictionary()


def _read_signature(func: Callable) -> RewardSignature:
    """Returns the RewardSignature of `func`, refusing required positional-only parameters."""
    try:
        sig = inspect.signature(func)
    except (TypeError, ValueError):  # a C callable without a signature: assume TRL's f(**kwargs)
        return RewardSignature(frozenset(), (), True)
    params: set[str] = set()
    required: list[str] = []
    var_keyword = False
    for p in sig.parameters.values():
        if p.kind is p.VAR_KEYWORD:
            var_keyword = True
        elif p.kind is p.POSITIONAL_ONLY and p.default is p.empty:
            raise RewardSignatureError(
                reward_name(func),
                f"takes {p.name!r} as a positional-only argument; reward functions are called with keyword "
                "arguments (prompts=, completions=, ...): remove the '/'",
            )
        elif p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            params.add(p.name)
            if p.default is p.empty:
                required.append(p.name)
    return RewardSignature(frozenset(params), tuple(required), var_keyword)


def reward_signature(func: Callable) -> RewardSignature:
    """Returns the keyword arguments `func` accepts (read from its signature once, then cached)."""
    try:
        return _SIGNATURES[func]
    except (KeyError, TypeError):  # not seen yet, or not weak-referenceable / hashable
        pass
    sig = _read_signature(func)
    try:
        _SIGNATURES[func] = sig
    except TypeError:
        pass
    return sig


def check_reward_columns(
    funcs: Sequence[Callable] | Callable, columns: Iterable[str], *, where: str = "the training data"
) -> None:
    """Returns None when every required argument of every reward function is a dataset column or an
    argument cohort passes itself; raises ValueError naming the function, the argument and the columns.

    `columns` are the columns that reach the functions (the dataset's, less the prompt column, which
    arrives as ``prompts``).
    """
    available = list(columns)
    clash = sorted(EXTRA_ARGUMENTS & set(available))
    if clash:
        raise ValueError(
            f"{where} has column(s) {clash}, which clash with the arguments cohort passes every reward "
            f"function ({sorted(REWARD_ARGUMENTS)}); rename them"
        )
    for func in _as_specs(funcs):
        missing = [
            a for a in reward_signature(func).required if a not in REWARD_ARGUMENTS and a not in available
        ]
        if missing:
            raise ValueError(
                f"reward function {reward_name(func)!r} requires the argument {missing[0]!r}"
                f"{f' (and {missing[1:]})' if missing[1:] else ''}, which is not a column of {where}; "
                f"{_columns_listing(available)}. Add the column, rename the argument to match one, or give it a "
                "default"
            )
        # Functions that take their reference from any one of several columns say so (the built-in accuracy
        # reward reads `answer`, or TRL's `solution`).
        one_of = getattr(func, "needs_one_of_columns", ())
        if one_of and not set(one_of) & set(available):
            raise ValueError(
                f"reward function {reward_name(func)!r} needs one of the columns {list(one_of)} in {where}; "
                f"{_columns_listing(available)}. Add one (the reference answer of each row)"
            )


def _columns_listing(available: Sequence[str]) -> str:
    """Returns the columns a reward function can read, for an error message (the prompt's is separate)."""
    if not available:
        return "the data has no column besides the prompt (which arrives as `prompts`)"
    return f"columns besides the prompt (which arrives as `prompts`): {sorted(available)}"


# ---------------------------------------------------------------------------------------------- logging
def _real(value: Any) -> float | None:
    """Returns `value` as a float when it is a real number (bools, numpy and 0-d scalars included), else None."""
    if isinstance(value, torch.Tensor) and value.ndim == 0:
        value = value.detach().item()
    elif isinstance(value, np.ndarray) and value.ndim == 0:
        value = value.item()
    if isinstance(value, (bool, np.bool_)):
        return float(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return None


def _json_value(value: Any) -> Any:
    """Returns `value` in a form json.dumps accepts (scalars unwrapped, containers converted, others as str)."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
    if isinstance(value, (np.ndarray, torch.Tensor)):
        value = value.tolist() if value.ndim else value.item()
    elif isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN / inf
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Mapping):
        return {str(k): _json_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    return str(value)


@dataclass
class RewardLogs:
    """What reward functions logged through ``log_metric`` and ``log_extra`` during scoring.

    ``log_metric(name, value)`` called by function ``f`` adds ``value`` to the metric
    ``rewards/<f's name>/<name>``; the step reports the mean of the values logged under one name.
    ``log_extra(column, values)`` stores one value per completion under ``column``; the trainer adds
    them to the step's logged samples (``samples.jsonl``), next to ``prompt``, ``completion``, ``reward``.
    """

    metrics: dict[str, list[float]] = field(default_factory=dict)
    extras: dict[str, list[Any]] = field(default_factory=dict)

    def metric_means(self) -> dict[str, float]:
        """Returns each logged metric's mean over the values logged for it."""
        return {k: sum(v) / len(v) for k, v in self.metrics.items() if v}

    def extras_at(self, index: int) -> dict[str, Any]:
        """Returns the extra columns' values of completion `index` (JSON-safe)."""
        return {column: values[index] for column, values in self.extras.items()}

    @staticmethod
    def merged(parts: Sequence[tuple[RewardLogs, Sequence[int]]]) -> RewardLogs:
        """Returns the logs of several scoring rounds as one: every metric value logged, and the extras of the
        selected completions (`rows` of each part, in order; None where a part lacks a column)."""
        out = RewardLogs()
        columns = list(dict.fromkeys(c for logs, _ in parts for c in logs.extras))
        for logs, rows in parts:
            for name, values in logs.metrics.items():
                out.metrics.setdefault(name, []).extend(values)
            for c in columns:
                extra = logs.extras.get(c)
                out.extras.setdefault(c, []).extend(extra[r] if extra is not None else None for r in rows)
        return out

    def metric_logger(self, func_name: str) -> Callable[[str, Any], None]:
        """Returns the ``log_metric(name, value)`` callable given to the reward function `func_name`."""

        def log_metric(name: str, value: float) -> None:
            """Returns None; records `value` under ``rewards/<function>/<name>`` for this step."""
            if not isinstance(name, str) or not name:
                raise ValueError(f"log_metric: the name must be a non-empty string, got {name!r}")
            if name in METRIC_STATS:
                raise ValueError(
                    f"log_metric({name!r}, ...): 'rewards/{func_name}/{name}' is logged by cohort itself; "
                    "choose another name"
                )
            x = _real(value)
            if x is None:
                raise ValueError(
                    f"log_metric({name!r}, {_repr.repr(value)}): the value must be a real number"
                )
            self.metrics.setdefault(f"rewards/{func_name}/{name}", []).append(x)

        return log_metric

    def extra_logger(self, func_name: str, n: int) -> Callable[[str, Sequence[Any]], None]:
        """Returns the ``log_extra(column, values)`` callable given to the reward function `func_name`."""

        def log_extra(column: str, values: Sequence[Any]) -> None:
            """Returns None; records one value per completion under `column` in this step's samples."""
            if not isinstance(column, str) or not column:
                raise ValueError(f"log_extra: the column must be a non-empty string, got {column!r}")
            if column in SAMPLE_FIELDS or column.startswith("rewards/"):
                raise ValueError(
                    f"log_extra({column!r}, ...): {sorted(SAMPLE_FIELDS)} and rewards/* are the sample's own fields; choose "
                    "another column name"
                )
            if column in self.extras:
                raise ValueError(f"log_extra({column!r}, ...): the column was already logged in this step")
            if isinstance(values, (str, bytes)) or not isinstance(
                values, (Sequence, np.ndarray, torch.Tensor)
            ):
                raise ValueError(
                    f"log_extra({column!r}, {_repr.repr(values)}): give a list with one value per completion"
                )
            if len(values) != n:
                raise ValueError(
                    f"log_extra({column!r}, ...): {len(values)} values for {n} completions; give one per completion"
                )
            self.extras[column] = [_json_value(v) for v in values]

        return log_extra


# ---------------------------------------------------------------------------------------------- async
_loop: asyncio.AbstractEventLoop | None = None
_loop_pid: int | None = None
_loop_lock = threading.Lock()


def _close_loop() -> None:
    """Closes the reward functions' event loop (at interpreter exit)."""
    if _loop is not None and not _loop.is_closed() and not _loop.is_running():
        _loop.close()


def _reward_loop() -> asyncio.AbstractEventLoop:
    """Returns the event loop async reward functions run on: one per process, kept between steps."""
    global _loop, _loop_pid
    if _loop is None or _loop.is_closed() or _loop_pid != os.getpid():
        if _loop_pid is None:
            atexit.register(_close_loop)
        _loop, _loop_pid = asyncio.new_event_loop(), os.getpid()
    return _loop


def run_awaitables(awaitables: Sequence[Awaitable[Any]]) -> list[Any]:
    """Returns the results of `awaitables` awaited concurrently (an exception raised by one is returned in
    its place).

    They run on cohort's own event loop, which is kept between calls (so a client that a reward function
    opens once can be reused in later steps). The calling thread blocks until all are done: when no event
    loop runs in it (the normal case) the loop runs right there; when one does (a notebook, an async
    application), the loop runs in a helper thread while the caller waits.
    """

    async def gather() -> list[Any]:
        return await asyncio.gather(*awaitables, return_exceptions=True)

    def run() -> list[Any]:
        with _loop_lock:
            return _reward_loop().run_until_complete(gather())

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return run()
    with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="cohort-rewards") as pool:
        return pool.submit(run).result()


# ---------------------------------------------------------------------------------------------- scoring
def _as_list(name: str, out: Any) -> list[Any]:
    """Returns a reward function's output as a list, or raises if it is not a 1-D sequence."""
    if isinstance(out, (np.ndarray, torch.Tensor)):
        if out.ndim != 1:
            raise RewardFunctionError(
                name, f"returned an array of shape {tuple(out.shape)}; return one value per completion (1-D)"
            )
        return out.detach().cpu().tolist() if isinstance(out, torch.Tensor) else out.tolist()
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
    x = _real(value)
    if x is None:
        raise RewardFunctionError(
            name,
            f"returned a {type(value).__name__} ({_repr.repr(value)}) at index {index}: {_repr.repr(out)}; "
            "rewards must be numbers (int, float, bool, numpy scalars) or None",
        )
    if not math.isfinite(x):
        raise RewardFunctionError(
            name,
            f"returned {x} at index {index}: {_repr.repr(out)}; rewards must be finite, use None for "
            "'not applicable'",
        )
    if abs(x) > _FLOAT32_MAX:  # stored as float32: it would become inf and the loss NaN
        raise RewardFunctionError(
            name,
            f"returned {x:g} at index {index}, beyond float32's range (|reward| <= {_FLOAT32_MAX:.3g}); "
            "rewards are stored as float32: scale the reward down",
        )
    return x


_FLOAT32_MAX = float(torch.finfo(torch.float32).max)


@dataclass
class StepRewards:
    """One completion's process reward: a reward per reasoning step and, optionally, where each step ends.

    `ends` are 0-based indices, in the completion's tokens, of each step's last token (strictly increasing);
    None lets the trainer find them by `process.step_separator` in the completion's text.
    """

    rewards: list[float]
    ends: list[int] | None = None


def _is_step_entry(value: Any) -> bool:
    """Returns whether one entry of a reward function's output is a process reward (several numbers)."""
    if isinstance(value, (StepRewards, Mapping, list, tuple)):
        return True
    return isinstance(value, (np.ndarray, torch.Tensor)) and value.ndim == 1


def _step_entry(name: str, index: int, value: Any, out: list[Any]) -> StepRewards | None:
    """Returns one completion's step rewards as StepRewards (None for None), or raises naming the entry."""
    if value is None:
        return None
    ends = None
    if isinstance(value, StepRewards):
        rewards, ends = value.rewards, value.ends
    elif isinstance(value, Mapping):
        unknown = sorted(set(value) - {"rewards", "ends"})
        if "rewards" not in value or unknown:
            raise RewardFunctionError(
                name,
                f"returned the mapping {_repr.repr(value)} at index {index}; a process reward is "
                "{'rewards': [one per step], 'ends': [token index of each step's last token] (optional)}",
            )
        rewards, ends = value["rewards"], value.get("ends")
    elif _is_step_entry(value):
        rewards = value
    else:
        raise RewardFunctionError(
            name,
            f"returned {type(value).__name__} {_repr.repr(value)} at index {index} among step rewards: "
            f"{_repr.repr(out)}; every entry must be a list of step rewards (or None)",
        )
    steps = [_to_float(name, index, v, out) for v in _as_list(name, rewards)]
    if any(math.isnan(v) for v in steps):
        raise RewardFunctionError(name, f"returned None among the step rewards of completion {index}")
    if ends is not None:
        ends = [int(e) for e in _as_list(name, ends)]
        if len(ends) != len(steps):
            raise RewardFunctionError(
                name,
                f"completion {index}: {len(steps)} step rewards but {len(ends)} step ends; give one end per step",
            )
    return StepRewards(steps, ends)


def _column(
    name: str, result: Any, n: int, steps: dict[int, list[StepRewards | None]] | None = None, j: int = 0
) -> torch.Tensor:
    """Returns one function's output as a float32 tensor [N] (NaN for None), or raises naming what is wrong.

    A process reward (each entry a list of step rewards) is stored in steps[j] and its column holds each
    completion's mean step reward; without `steps` it is refused."""
    values = _as_list(name, result)
    if len(values) != n:
        raise RewardFunctionError(
            name,
            f"returned {len(values)} values for {n} completions: {_repr.repr(values)}; return exactly one per completion",
        )
    kinds = [_is_step_entry(v) for v in values if v is not None]
    if kinds and all(
        kinds
    ):  # every entry a list of step rewards (a mixed list fails below, naming the entry)
        if steps is None:
            at = next(i for i, v in enumerate(values) if v is not None)
            raise RewardFunctionError(
                name,
                f"returned a {type(values[at]).__name__} {_repr.repr(values[at])} at index {at}: several numbers per "
                "completion read as step rewards (process supervision), which only training uses; here every "
                "function must return one number per completion",
            )
        parsed = [_step_entry(name, i, v, values) for i, v in enumerate(values)]
        steps[j] = parsed
        return torch.tensor(
            [math.nan if p is None or not p.rewards else sum(p.rewards) / len(p.rewards) for p in parsed],
            dtype=torch.float32,
        )
    return torch.tensor([_to_float(name, i, v, values) for i, v in enumerate(values)], dtype=torch.float32)


def score(
    funcs: Sequence[Callable],
    *,
    prompts: Sequence[Any],
    completions: Sequence[Any],
    completion_ids: Sequence[Sequence[int]] | None = None,
    columns: Mapping[str, Sequence[Any]] | None = None,
    trainer_state: Any = None,
    logs: RewardLogs | None = None,
    steps: dict[int, list[StepRewards | None]] | None = None,
    live: Mapping[str, Sequence[Any]] | None = None,
) -> torch.Tensor:
    """Returns the rewards [N, R] float32 of N completions under R functions, NaN where a function gave None.

    Every function is called as ``f(prompts=, completions=, completion_ids=, **columns, trainer_state=,
    log_metric=, log_extra=)`` (only the arguments it accepts: see the module docstring), all sequences
    of length N (group-contiguous, the prompt and columns repeated per completion). Sync functions run
    one after the other; the coroutines of async ones are then awaited together (:func:`run_awaitables`).
    What the functions log goes to `logs` (discarded when None); `trainer_state` is passed as is: the
    trainer gives its ``state`` (``global_step``, ``max_steps``, ``epoch``, ...), None outside training. Weights are not applied here: see :func:`reward_weights` and
    ``cohort.algo.combine_rewards``.
    A function may return step rewards instead (process supervision: per completion a list of step rewards,
    a {"rewards", "ends"} mapping or a StepRewards) when `steps` is given: they are stored in steps[j] (j the
    function's position) and its column holds the mean step reward of each completion.
    `live`: arguments passed uncopied, one entry per completion (EPISODE_ARGUMENTS: environments, episodes).
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
    clash = sorted(REWARD_ARGUMENTS & set(columns))
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
    logs = RewardLogs() if logs is None else logs
    out = torch.empty(n, len(funcs), dtype=torch.float32)  # [N, R]
    pending: dict[int, Awaitable[Any]] = {}
    try:
        for j, func in enumerate(funcs):
            name = reward_name(func)
            makers: dict[str, Callable[[], Any]] = {
                # Deep copies per call (message dicts included): a function that edits what it receives
                # cannot change what the next function, the logs or a later step see.
                "prompts": functools.partial(copy.deepcopy, list(prompts)),
                "completions": functools.partial(copy.deepcopy, list(completions)),
                "completion_ids": lambda: (
                    None if completion_ids is None else [list(i) for i in completion_ids]
                ),
                **{key: functools.partial(copy.deepcopy, list(values)) for key, values in columns.items()},
                **{key: functools.partial(list, values) for key, values in (live or {}).items()},
                "trainer_state": lambda: trainer_state,
                "log_metric": functools.partial(logs.metric_logger, name),
                "log_extra": functools.partial(logs.extra_logger, name, n),
            }
            sig = reward_signature(func)
            try:
                result = func(**{key: make() for key, make in makers.items() if sig.accepts(key)})
            except Exception as exc:
                raise RewardFunctionError(name, f"raised {type(exc).__name__}: {exc}") from exc
            if inspect.isawaitable(result):
                pending[j] = result
            else:
                out[:, j] = _column(name, result, n, steps, j)
        if pending:
            for j, result in zip(pending, run_awaitables(list(pending.values()))):
                name = reward_name(funcs[j])
                if isinstance(result, Exception):
                    raise RewardFunctionError(name, f"raised {type(result).__name__}: {result}") from result
                if isinstance(result, BaseException):
                    raise result
                out[:, j] = _column(name, result, n, steps, j)
    finally:
        for awaitable in pending.values():  # not started when an earlier function failed: closed quietly
            if inspect.iscoroutine(awaitable):
                awaitable.close()
    return out
