"""Once-per-model equivalence checks: a fast path is trusted on a model only after it reproduced the plain one.

Every check goes through `probe(model, name, fast, plain)`: both computations run on a small made-up
input, outside any autocast the caller runs under, without gradients, in eval mode; the fast one must
match the plain one within `tolerance(model)`; any exception counts as a failure. The verdict is cached
per model (weakly, so it goes with the model) and per check name, and `results(model)` shows every
verdict so far. Checks are about structure, not rounding: the tolerance follows the weights' precision.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from typing import Any

import torch

from cohort.errors import first_line
from cohort.models import eval_mode, float_dtype, input_device

_VERDICTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {check name: bool}
_GLOBAL: dict[str, bool] = {}  # checks of the torch build itself (model=None)
_RAISED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {check name: what it raised}
_RAISED_GLOBAL: dict[str, str] = {}


def tolerance(model: torch.nn.Module, compute: torch.dtype | None = None) -> float:
    """Returns the absolute log-prob tolerance of a path check: 1e-3 in float32 or wider, 5e-2 below; `compute`:
    the precision the check computes in where it is below the weights' (a check run under bf16 autocast).

    Two computations of the same log-probs differ only by rounding: float32 keeps them within 1e-5,
    bfloat16 (8 bits of mantissa, summed over a layer stack) within a few hundredths; a structural error
    (a wrong mask, a dropped window) moves them by much more than either.
    """
    dtype = float_dtype(model)
    if compute is not None and compute.itemsize < dtype.itemsize:
        dtype = compute
    return 1e-3 if dtype.itemsize >= 4 else 5e-2


def scaled_close(fast: Any, plain: Any, tol: float) -> bool:
    """Returns whether tensors (or equal-length tuples of them) agree within `tol` times the larger of 1 and the
    plain value's largest magnitude: for gradients, whose scale is the model's, not a log-prob's."""
    if isinstance(fast, torch.Tensor):
        scale = max(1.0, float(plain.float().abs().max())) if plain.numel() else 1.0
        return allclose(fast, plain, tol * scale)
    return len(fast) == len(plain) and all(scaled_close(a, b, tol) for a, b in zip(fast, plain))


def allclose(fast: Any, plain: Any, tol: float) -> bool:
    """Returns whether two tensors (or equal-length tuples of tensors) agree to absolute tolerance `tol`."""
    if isinstance(fast, torch.Tensor):
        return fast.shape == plain.shape and bool(
            torch.allclose(fast.float(), plain.float(), rtol=0, atol=tol)
        )
    return len(fast) == len(plain) and all(allclose(a, b, tol) for a, b in zip(fast, plain))


def probe(
    model: torch.nn.Module | None,
    name: str,
    fast: Callable[[], Any],
    plain: Callable[[], Any],
    *,
    agree: Callable[[Any, Any, float], bool] = allclose,
    compute: torch.dtype | None = None,
) -> bool:
    """Returns whether fast() reproduces plain() on `model` (computed once per model and check name).

    model=None checks the torch build itself (once per process). agree(fast_out, plain_out, tol) decides
    (default: allclose at `tolerance(model, compute)`; `compute`: the autocast dtype a check re-enters).
    """
    cache = _GLOBAL if model is None else _VERDICTS.setdefault(model, {})
    if name in cache:
        return cache[name]
    try:
        if model is None:
            # a verdict on the torch build, cached for the process: the caller's autocast must not enter it
            with torch.no_grad(), contextlib.ExitStack() as scope:
                for device_type in ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",):
                    scope.enter_context(torch.autocast(device_type, enabled=False))
                ok = bool(agree(fast(), plain(), 1e-4))
        else:
            device_type = input_device(model).type
            with torch.no_grad(), torch.autocast(device_type, enabled=False), eval_mode(model):
                ok = bool(agree(fast(), plain(), tolerance(model, compute)))
    except Exception as exc:  # noqa: BLE001 - any failure means the fast path is unusable here
        # A library that changed under us (a renamed argument, a warning turned into an error) shows up
        # here: keep what was raised so the fallback message names it instead of blaming the numbers.
        raised = _RAISED_GLOBAL if model is None else _RAISED.setdefault(model, {})
        raised[name] = f"{type(exc).__name__}: {first_line(exc) if str(exc).strip() else ''}"
        ok = False
    cache[name] = ok
    return ok


def failure(model: torch.nn.Module | None, name: str, mismatch: str) -> str:
    """Returns why check `name` failed on `model`: what it raised, else `mismatch` (the results differed)."""
    raised = (_RAISED_GLOBAL if model is None else _RAISED.get(model, {})).get(name)
    return (
        f"{mismatch} (checked once per model; the check raised {raised})"
        if raised
        else (f"{mismatch} (checked once per model)")
    )


def results(model: torch.nn.Module | None) -> dict[str, bool]:
    """Returns a copy of the verdicts reached so far for `model` ({check name: passed}); None: the torch build."""
    if model is None:
        return dict(_GLOBAL)
    return dict(_VERDICTS.get(model, {}))
