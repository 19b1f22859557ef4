"""Weights and inputs cast to autocast's dtype once, where autocast would cast them inside every product.

The engines sample under `torch.inference_mode`, where autocast keeps no cast between calls: every Linear's
weight is cast anew at every decode step (169 casts a step at Qwen2.5-0.5B's shape: about 1,000 MiB of float32
read and 500 MiB of bfloat16 written, and 169 kernel launches, a step). Casting each weight once per rollout
and handing the copies to the forward (`torch.func.functional_call` in the captured step, `CastForward` in the
eager decodes) gives bitwise what autocast computes (autocast rounds the same way, and leaves a tensor already in
its dtype alone), for the memory of one copy of the Linear weights in autocast's dtype during the rollout (what a
training forward's autocast cache holds).

- `cast_linears`: the copies, for the captured step (`cohort.rollout.graph`) and the eager decodes;
- `cast_once`: the eager decodes' forward (`fast.cast_once`: the builtin engine's eager steps, multi-turn
  episodes);
- `shared_input_casts`: the captured step's input casts shared by the Linears that read one tensor.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.nn.utils import parametrize

from cohort.fastpath.switches import FastConfig, choose
from cohort.runtime.sharding import fsdp_managed


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    """Returns the dtype autocast computes products in on `device`'s type (None when it is off)."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return None


@contextlib.contextmanager
def shared_input_casts(model: torch.nn.Module, dtype: torch.dtype) -> Iterator[Callable[[], None]]:
    """Yields a function that forgets the casts made so far; inside the block, under autocast, each Linear of
    `model` gets its input already cast to `dtype`, cast once per input tensor: the projections that read one
    tensor (query, key and value; gate and up) share one cast, where autocast would make one each with the same
    rounding. A tensor changed in place since its cast is cast anew, where torch counts its changes (an inference
    tensor, made under torch.inference_mode as the engines sample, has no such count: models change no projection's
    input in place between the projections that read it)."""
    last: list[Any] = []  # [input, its version, its cast]

    def hook(module: torch.nn.Module, args: tuple) -> tuple | None:
        x = args[0] if args else None
        if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dtype.itemsize <= dtype.itemsize:
            return None
        if x.dtype == torch.float64:
            return None  # autocast leaves float64 alone
        if not torch.is_autocast_enabled(x.device.type):
            return None  # a Linear run outside autocast computes in its own dtype
        version = None if x.is_inference() else x._version
        if not (last and last[0] is x and last[1] == version):
            last[:] = [x, version, x.to(dtype)]
        return (last[2], *args[1:])

    handles = [m.register_forward_pre_hook(hook) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    try:
        yield last.clear
    finally:
        for handle in handles:
            handle.remove()
        last.clear()


@contextlib.contextmanager
def cast_linears(model: torch.nn.Module, device_type: str) -> Iterator[dict[str, torch.Tensor]]:
    """Yields {name: tensor} of every Linear's weight and bias cast to the autocast dtype when autocast is on
    for `device_type` and would cast it (a floating tensor of another dtype, not float64), empty otherwise: hand it
    to functional_call."""
    swapped: dict[str, torch.Tensor] = {}
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        for name, module in model.named_modules():
            if not isinstance(module, torch.nn.Linear):
                continue
            for part in ("weight", "bias"):
                if parametrize.is_parametrized(module, part):
                    continue  # computed at each access (weight norm, a LoRA written as one): autocast casts it
                t = getattr(module, part, None)
                # autocast leaves float64 alone (its `is_eligible`): a double model computes in double
                if (
                    isinstance(t, torch.Tensor)
                    and t.is_floating_point()
                    and t.dtype not in (dtype, torch.float64)
                ):
                    swapped[f"{name}.{part}" if name else part] = t.detach().to(dtype)
    try:
        yield swapped
    finally:
        swapped.clear()


def cast_once_unavailable(model: torch.nn.Module, device: torch.device) -> str | None:
    """Returns why the eager decode of `model` on `device` cannot cast its Linear weights once (None: it can)."""
    if not torch.is_autocast_enabled(device.type):
        return (
            f"autocast is off on {device.type}, so nothing is cast (it casts under model.bf16_autocast on a CUDA "
            "GPU with float32 weights)"
        )
    if fsdp_managed(model):
        return (
            "its weights are sharded (distributed.strategy=fsdp), and FSDP sets them in place at each forward"
        )
    return None


@contextlib.contextmanager
def cast_once(
    model: torch.nn.Module, device: torch.device, fast: FastConfig | None, taken: dict[str, Any] | None = None
) -> Iterator[Callable[..., Any]]:
    """Yields the function an eager decode calls `model` through (keyword arguments, as `model` takes them):
    under autocast and `fast.cast_once`, `model`'s forward with every Linear's weight and bias cast to autocast's
    dtype once for the block; else `model` itself. `taken`, when given, gets "cast_once": whether copies were
    made (False also where autocast had nothing to cast)."""
    setting = (fast or FastConfig()).cast_once
    use = choose(
        setting,
        "cast_once",
        model,
        worth=torch.is_autocast_enabled(device.type),
        unavailable=lambda: cast_once_unavailable(model, device),
    )
    casts: contextlib.AbstractContextManager[dict[str, torch.Tensor]] = (
        cast_linears(model, device.type) if use else contextlib.nullcontext({})
    )
    with casts as weights:
        if taken is not None:
            taken["cast_once"] = bool(weights)
        yield CastForward(model, weights) if weights else model


class CastForward:
    """Calls `model` with each cast tensor in its module's parameter slot for the length of the call, as
    `torch.func.functional_call` swaps them, but with the slots found once: functional_call resolves every dotted
    name at every call (0.5 ms a call for Qwen2.5-0.5B's 169 Linear weights on this project's CPU, about what the
    casts it saves cost the host there). A cast tensor held elsewhere than its module's parameters sends every call
    through functional_call."""

    def __init__(self, model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
        self.model, self.weights = model, weights
        self.slots: list[tuple[dict[str, Any], str, torch.Tensor]] | None = []
        for name, cast in weights.items():
            prefix, _, attr = name.rpartition(".")
            params = model.get_submodule(prefix)._parameters
            if attr not in params:
                self.slots = None
                break
            self.slots.append((params, attr, cast))

    def __call__(self, **inputs: Any) -> Any:
        """Returns `model(**inputs)` computed with the cast weights (the model's own weights back in place after)."""
        if self.slots is None:
            return torch.func.functional_call(
                self.model, self.weights, (), inputs, strict=False, tie_weights=False
            )
        held: list[tuple[dict[str, Any], str, Any]] = []
        try:
            for params, attr, cast in self.slots:
                held.append((params, attr, params[attr]))
                params[attr] = cast
            return self.model(**inputs)
        finally:
            for params, attr, original in held:
                params[attr] = original
