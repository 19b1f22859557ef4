"""The update's decoder forward through `torch.compile` (`fast.compile_update`).

On an H200 the update of a Qwen2.5-0.5B-shaped model waited on the host: 21,279 kernel launches in a step, each
op dispatched from Python, for well under half a second of GPU work (docs/performance.md). torch.compile traces
the decoder once, fuses its elementwise work (norms, rotary embeddings, activations, residual adds) into fewer
kernels and launches them from generated code, for the forward and, through AOTAutograd, the backward.

It is taken for padded rows without a mask (`fast.unmasked_padding`) only: the decoder's inputs are then ids and
positions alone, so one trace with dynamic sizes serves every micro-batch, however many rows and tokens. A new
grad mode, train / eval mode or autocast setting traces once more; a model is trusted only after the compiled
forward reproduced the eager one (probe "compile_update"). A forward that fails to compile falls back to the
eager forward for that model, with a warning once.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from typing import Any

import torch

from cohort.errors import first_line
from cohort.fastpath.switches import say_once

BACKEND: Any = "inductor"
"""torch.compile's backend (the tests swap in cheaper ones: a CPU's inductor compiles C++ for tens of seconds)."""

RECOMPILE_LIMIT = 64
"""Traces kept per compiled function (torch's default of 8 is shared by every model of a process: a policy and its
reference, each with and without gradients, in train and eval mode, under autocast or not, already make 8)."""

_COMPILED: dict[Any, Callable] = {}  # backend -> the compiled function
_FAILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # decoder -> why its compile failed


def _hidden_states(
    decoder: torch.nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor
) -> torch.Tensor:
    out = decoder(input_ids=input_ids, attention_mask=None, position_ids=position_ids, use_cache=False)
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]


def _compiled() -> Callable:
    fn = _COMPILED.get(BACKEND)
    if fn is None:
        # dynamic: the rows and the padded length change every micro-batch; one trace serves them all.
        fn = _COMPILED[BACKEND] = torch.compile(_hidden_states, dynamic=True, backend=BACKEND)
    return fn


def _limit() -> contextlib.AbstractContextManager:
    config = getattr(getattr(torch, "_dynamo", None), "config", None)
    if config is None or not hasattr(config, "recompile_limit"):
        return contextlib.nullcontext()
    return config.patch(recompile_limit=max(config.recompile_limit, RECOMPILE_LIMIT))


def _reason(exc: BaseException) -> str:
    """Returns what a compile failure says: its own type and, for a wrapped error (torch's BackendCompilerFailed),
    the first line of the error at its root."""
    root = exc
    for _ in range(8):  # a short chain: the compiler's wrapper, perhaps one more
        inner = getattr(root, "inner_exception", None) or root.__cause__
        if not isinstance(inner, BaseException) or inner is root:
            break
        root = inner
    text = first_line(root) if str(root).strip() else ""
    wrapped = f"{type(exc).__name__} from " if root is not exc else ""
    return f"{wrapped}{type(root).__name__}: {text}".rstrip(": ")


def failed(decoder: torch.nn.Module) -> str | None:
    """Returns why compiling `decoder`'s forward failed in this process (None: it has not failed)."""
    return _FAILED.get(decoder)


def hidden_states(
    decoder: torch.nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor, *, model: Any = None
) -> torch.Tensor:
    """Returns the decoder's last hidden states [R, L, H] of unmasked rows `input_ids` [R, L] at `position_ids`
    [R, L], through the compiled forward (the eager one once compiling it failed for this decoder; `model` names
    it in the warning)."""
    if decoder not in _FAILED:
        try:
            with _limit():
                return _compiled()(decoder, input_ids, position_ids)
        except torch.OutOfMemoryError:
            raise  # the eager forward needs the memory too: say so, as it would
        except Exception as exc:  # noqa: BLE001 - any compiler failure leaves the eager forward, which is exact
            _FAILED[decoder] = reason = _reason(exc)
            name = type(model if model is not None else decoder).__name__
            say_once(
                model,
                "compile_update",
                f"compiling the update's forward of {name} failed ({reason}); "
                "using the eager forward (fast.compile_update=off says so up front)",
            )
    return _hidden_states(decoder, input_ids, position_ids)
