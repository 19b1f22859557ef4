"""Functions run through `torch.compile` with a fallback: the update's decoder forward (`fast.compile_update`) and
the static decode step (`fast.compile_decode`).

On an H200 the update of a Qwen2.5-0.5B-shaped model waited on the host: 21,279 kernel launches in a step, each
op dispatched from Python, for well under half a second of GPU work (docs/performance.md). torch.compile traces
the decoder once, fuses its elementwise work (norms, rotary embeddings, activations, residual adds) into fewer
kernels and launches them from generated code, for the forward and, through AOTAutograd, the backward.

The update's forward is taken for padded rows without a mask (`fast.unmasked_padding`) only: the decoder's inputs
are then ids and positions alone, so one trace with dynamic sizes serves every micro-batch, however many rows and
tokens. A new grad mode, train / eval mode or autocast setting traces once more; a model is trusted only after the
compiled forward reproduced the eager one (probe "compile_update") and, with gradients on and under the update's
autocast, its backward the eager gradients (probe "compile_update_backward": AOTAutograd may compile the backward
only at the first backward, where a failure would have no fallback). A forward that fails to compile falls back to
the eager forward for that model, with a warning once.

The decode step (cohort.rollout.graph) is captured as a CUDA graph, so its host work is gone already; what is left
is the GPU's time in ~50 small kernels a layer, which fusing cuts.
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


class Compiled:
    """`fn` compiled (one compiled function per backend), called through `call`: for an owner
    (a model) whose compile failed, `fn` itself from then on."""

    def __init__(self, fn: Callable, switch: str, what: str, *, dynamic: bool | None = True) -> None:
        self.fn, self.switch, self.what = fn, switch, what
        self.dynamic = dynamic  # torch.compile's: True every size, None those marked (maybe_mark_dynamic)
        self._by_backend: dict[Any, Callable] = {}
        self._failed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # owner -> why it failed

    def compiled(self) -> Callable:
        """Returns `fn` compiled with the current BACKEND (made on first use)."""
        fn = self._by_backend.get(BACKEND)
        if fn is None:
            fn = self._by_backend[BACKEND] = torch.compile(self.fn, dynamic=self.dynamic, backend=BACKEND)
        return fn

    def failed(self, owner: Any) -> str | None:
        """Returns why compiling for `owner` failed in this process (None: it has not failed)."""
        return self._failed.get(owner)

    def unavailable(self, owner: Any, probe: Callable[[], str | None]) -> str | None:
        """Returns why `fn` compiled cannot serve `owner` (None: it can): a compile for it that failed before, else
        what `probe()` (the once-per-model check) found, else a compile that failed during the probe, which then
        checked the eager function it fell back to and so proved nothing."""
        why = self.failed(owner)
        if why is not None:
            return f"compiling {self.what} failed ({why})"
        reason = probe()
        why = self.failed(owner)
        return reason if why is None else f"compiling {self.what} failed ({why}; checked once per model)"

    def call(self, owner: Any, *args: Any, model: Any = None, recompile: bool = True) -> Any:
        """Returns fn(*args) through the compiled function (through `fn` itself once compiling for `owner` failed;
        `model` names it in the warning). recompile=False: a call that would trace anew fails over to `fn`
        instead (inside a CUDA graph capture, where compiling cannot run), and any other error is raised."""
        if owner not in self._failed:
            try:
                with _limit(), _no_recompile(not recompile):
                    return self.compiled()(*args)
            except torch.OutOfMemoryError:
                raise  # the eager function needs the memory too: say so, as it would
            except Exception as exc:  # noqa: BLE001 - any compiler failure leaves the eager function, which is exact
                if not recompile and not isinstance(exc, _recompile_errors()):
                    # Inside a capture: the compiled step may have launched kernels before failing, and the
                    # capture is then invalid. Running `fn` there would record its in-place updates a second time
                    # and hide this error behind the capture's own; the capture is abandoned with this one.
                    raise
                self._failed[owner] = reason = _reason(exc)
                name = type(model if model is not None else owner).__name__
                say_once(
                    model if model is not None else owner,
                    self.switch,
                    f"compiling {self.what} of {name} failed ({reason}); "
                    f"using the eager one (fast.{self.switch}=off says so up front)",
                )
        return self.fn(*args)


def _hidden_states(
    decoder: torch.nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: Any = None
) -> torch.Tensor:
    out = decoder(input_ids=input_ids, attention_mask=mask, position_ids=position_ids, use_cache=False)
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]


def _limit() -> contextlib.AbstractContextManager:
    config = getattr(getattr(torch, "_dynamo", None), "config", None)
    if config is None or not hasattr(config, "recompile_limit"):
        return contextlib.nullcontext()
    return config.patch(recompile_limit=max(config.recompile_limit, RECOMPILE_LIMIT))


def _no_recompile(on: bool) -> contextlib.AbstractContextManager:
    config = getattr(getattr(torch, "_dynamo", None), "config", None)
    if not on or config is None or not hasattr(config, "error_on_recompile"):
        return contextlib.nullcontext()
    return config.patch(error_on_recompile=True)


def _recompile_errors() -> tuple[type[BaseException], ...]:
    """Returns the errors torch raises, under error_on_recompile, where a call would trace anew: raised by the
    guard check before the compiled code runs, so nothing was launched and `fn` may run in its place."""
    exc = getattr(getattr(torch, "_dynamo", None), "exc", None)
    error = getattr(exc, "RecompileError", None)
    return (error,) if isinstance(error, type) else ()


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


# dynamic: the rows and the padded length change every micro-batch; one trace serves them all.
UPDATE_FORWARD = Compiled(_hidden_states, "compile_update", "the update's forward")


def failed(decoder: torch.nn.Module) -> str | None:
    """Returns why compiling `decoder`'s forward failed in this process (None: it has not failed)."""
    return UPDATE_FORWARD.failed(decoder)


def hidden_states(
    decoder: torch.nn.Module,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    mask: Any = None,
    *,
    model: Any = None,
) -> torch.Tensor:
    """Returns the decoder's last hidden states [R, L, H] of unmasked rows `input_ids` [R, L] at `position_ids`
    [R, L] (`mask`: the attention_mask argument, None or cohort.fastpath.no_mask's), through the compiled forward
    (the eager one once compiling it failed for this decoder; `model` names it in the warning)."""
    return UPDATE_FORWARD.call(decoder, decoder, input_ids, position_ids, mask, model=model)
