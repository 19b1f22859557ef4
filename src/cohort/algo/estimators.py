"""Advantage estimators by name: the registry `algo.advantage` chooses from, user estimators included.

Built-in (formulas and sources in advantages.py and docs/algorithms.md):
- "grpo": the group z-score (DeepSeekMath), with `algo.scale` / `algo.std` / `algo.adv_eps`;
- "rloo": REINFORCE leave-one-out, r_i minus the mean of the other G - 1 rewards of its group;
- "reinforce_pp": REINFORCE++, the raw reward whitened over the batch;
- "reinforce_pp_baseline": REINFORCE++-baseline, group-mean subtracted, then whitened over the batch;
- "max_rl": MaxRL, (r - mean_g) / mean_g, 0 where the group's mean reward is <= 0;
- "optimal_token_baseline": the Optimal Token Baseline is per token and needs the policy's pi_old and
  sum_v pi^2 (cohort.algo.optimal_token_baseline, which the trainer calls after its pi_old pass); this [N]
  entry gives its row-level summary r - mean_g (OTB's value where every completion's variance proxy is the
  same), which the trainer logs and health-checks, never trains on.
The REINFORCE++ statistics weigh each completion by its token count, as a whitening over the batch's tokens
does (OpenRLHF's); pass lengths=None to weigh completions equally.

A user estimator: `my_adv(rewards: Tensor [N], group_size: int, **advantage_kwargs) -> Tensor [N]`, with the
rewards group-contiguous (prompt j's G completions are rows j*G .. j*G+G-1) in float64, NaN where no reward
function applied; registered under its spec (`algo.advantage: my_pkg.adv:my_adv`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence

import torch

from ._checks import check_group_size
from .advantages import group_advantages, max_rl_advantages, reinforce_pp_advantages, rloo_advantages
from .options import ADVANTAGE_NAMES, ADVANTAGE_TYPES, ESTIMATOR_FIELDS

#: (rewards [N], group_size, lengths [N] or None, **kwargs) -> advantages [N]
Estimator = Callable[..., torch.Tensor]


def _grpo(rewards, group_size, lengths, *, scale="group", std="sample", eps=1e-4):
    return group_advantages(rewards, group_size, scale=scale, std=std, eps=eps)


def _rloo(rewards, group_size, lengths):
    return rloo_advantages(rewards, group_size)


def _reinforce_pp(rewards, group_size, lengths, *, std="sample", eps=1e-4):
    return reinforce_pp_advantages(rewards, group_size, baseline=False, std=std, eps=eps, weights=lengths)


def _reinforce_pp_baseline(rewards, group_size, lengths, *, std="sample", eps=1e-4):
    return reinforce_pp_advantages(rewards, group_size, baseline=True, std=std, eps=eps, weights=lengths)


def _max_rl(rewards, group_size, lengths):
    return max_rl_advantages(rewards, group_size)


def _otb_rows(rewards, group_size, lengths):
    return group_advantages(rewards, group_size, scale="none")


ADVANTAGE_ESTIMATORS: dict[str, Estimator] = {}
"""Every advantage estimator by name: the built-in ones and those registered from user modules."""


def _builtin(name: str, fn: Estimator) -> None:
    """Registers a built-in estimator after checking that it takes exactly the keywords cohort.algo.options
    declares it reads (ESTIMATOR_FIELDS[name]: keyword -> algo field)."""
    keywords = {
        p.name for p in inspect.signature(fn).parameters.values() if p.kind is inspect.Parameter.KEYWORD_ONLY
    }
    reads = ESTIMATOR_FIELDS[name]
    if keywords != set(reads):  # the declaration is the function's keywords, neither more nor fewer
        raise TypeError(f"estimator {name!r} takes {sorted(keywords)} but declares {sorted(reads)}")
    ADVANTAGE_ESTIMATORS[name] = fn


_builtin("grpo", _grpo)
_builtin("rloo", _rloo)
_builtin("reinforce_pp", _reinforce_pp)
_builtin("reinforce_pp_baseline", _reinforce_pp_baseline)
_builtin("max_rl", _max_rl)
_builtin("optimal_token_baseline", _otb_rows)
if tuple(ADVANTAGE_ESTIMATORS) != ADVANTAGE_TYPES:
    raise ImportError(
        f"cohort.algo.options.ADVANTAGE_TYPES {ADVANTAGE_TYPES} != {tuple(ADVANTAGE_ESTIMATORS)}"
    )

_USER: dict[str, Callable[..., torch.Tensor]] = {}


def register_advantage(name: str, fn: Callable[..., torch.Tensor]) -> None:
    """Returns None after registering a user estimator fn(rewards [N], group_size, **kwargs) -> [N] as `name`."""
    if not callable(fn):
        raise TypeError(f"advantage estimator {name!r} must be a function (rewards, group_size, **kwargs)")

    def call(rewards, group_size, lengths, **kwargs):
        return fn(rewards.to(torch.float64), group_size, **kwargs)

    ADVANTAGE_ESTIMATORS[name] = call
    ADVANTAGE_NAMES.add(name)
    ESTIMATOR_FIELDS.pop(name, None)  # a user estimator under a built-in's name reads algo.advantage_kwargs
    _USER[name] = fn


def check_advantage_kwargs(name: str, kwargs: Mapping[str, object]) -> None:
    """Raise a ValueError when `name` is unknown or its estimator cannot take `kwargs` (naming the signature)."""
    if name not in ADVANTAGE_ESTIMATORS:
        valid = ", ".join(repr(o) for o in ADVANTAGE_ESTIMATORS)
        raise ValueError(
            f"unknown advantage estimator {name!r}; valid options: {valid}, or 'my_pkg.module:function'"
        )
    user = _USER.get(name)
    try:
        sig = inspect.signature(user or ADVANTAGE_ESTIMATORS[name])
    except ValueError:  # a builtin without an introspectable signature: checked when called
        return
    try:
        sig.bind(None, 2, **kwargs) if user else sig.bind(None, 2, None, **kwargs)
    except TypeError as exc:
        if user:
            raise ValueError(
                f"advantage estimator {name!r} cannot be called as fn(rewards, group_size, **{dict(kwargs)!r}): "
                f"{exc}. Expected signature: def my_advantages(rewards: torch.Tensor, group_size: int, "
                "**advantage_kwargs) -> torch.Tensor  (one advantage per completion, [N])"
            ) from None
        raise ValueError(f"advantage estimator {name!r} does not take {sorted(kwargs)}: {exc}") from None


def estimate_advantages(
    name: str,
    rewards: torch.Tensor,
    group_size: int,
    lengths: Sequence[int] | torch.Tensor | None = None,
    **kwargs: object,
) -> torch.Tensor:
    """Return the advantages [N] the named estimator gives for rewards [N] (float64 inside, rewards' dtype out)."""
    if name not in ADVANTAGE_ESTIMATORS:
        check_advantage_kwargs(name, kwargs)
    n = rewards.shape[0] if rewards.dim() else 0
    check_group_size(n, group_size)
    weights = (
        None if lengths is None else torch.as_tensor(lengths, dtype=torch.float64, device=rewards.device)
    )
    adv = ADVANTAGE_ESTIMATORS[name](rewards, group_size, weights, **kwargs)
    if not isinstance(adv, torch.Tensor) or adv.shape != rewards.shape:
        got = tuple(adv.shape) if isinstance(adv, torch.Tensor) else type(adv).__name__
        raise ValueError(
            f"advantage estimator {name!r} returned {got}; it must return one advantage per completion, a "
            f"tensor of shape {tuple(rewards.shape)}"
        )
    bad = ~torch.isfinite(adv)  # [N]
    if bad.any():
        rows = bad.nonzero().flatten().tolist()
        raise NonFiniteAdvantageError(
            f"advantage estimator {name!r} returned {len(rows)} non-finite advantage(s) (rows {rows[:5]}"
            f"{', ...' if len(rows) > 5 else ''}; rewards there: {rewards[rows[:5]].tolist()}); it must return a "
            "finite number for every completion (0 for a row it cannot score): fix the estimator"
        )
    return adv.to(rewards.dtype)


class NonFiniteAdvantageError(ValueError):
    """An advantage estimator returned NaN or inf: the message names the estimator, the rows and their rewards."""
