"""Linear layers with weights pre-packed for oneDNN, for decoding on a CPU.

A decode step multiplies a few rows by every weight matrix of the model. MKL's sgemm, which
`torch.nn.functional.linear` calls for float32 on a CPU, handles that shape poorly: on the 2-core
machine of docs/performance.md the linears of the 14 M benchmark model take 7.9 ms for 4 rows and
5.3 ms for one, and one 4864 x 896 matrix (Qwen2.5-0.5B's MLP width) takes 3.6 ms for 3 rows. Given
the weight reordered once into its blocked layout, oneDNN streams it at close to memory bandwidth:
3.9 ms and 0.45 ms for the same cases. The reorder is redone for every rollout (the weights change
between them) and costs one to three passes over the weights, so the sampler switches to packed
weights only in rollouts that run long enough to repay it (`FastConfig.pack_after_steps`).

`packed_linears(model)` swaps the forward of each large float32 CPU `nn.Linear` for the packed one
for the duration of a `with` block and restores it afterwards. peft's LoRA layers keep working: their
base layer is the `nn.Linear` swapped here, the adapter path is untouched. Anything that needs
autograd inside the block falls back to the plain linear.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import TypeGuard

import torch

from cohort.fastpath import probes
from cohort.fastpath.switches import FastConfig, choose


def _packing_works() -> bool:
    """Returns whether oneDNN's packed linear exists in this torch build and computes F.linear's result."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    gen = torch.Generator().manual_seed(0)
    w, b, x = (torch.randn(*s, generator=gen) for s in ((96, 64), (96,), (3, 64)))

    def packed():
        return torch.ops.mkldnn._linear_pointwise(
            x, torch.ops.mkldnn._reorder_linear_weight(w, 3), b, "none", [], ""
        )

    return probes.probe(None, "packed_linear", packed, lambda: torch.nn.functional.linear(x, w, b))


def packing_unavailable(model: torch.nn.Module) -> str | None:
    """Returns why `model` cannot decode through packed weights (None: it can)."""
    if not any(_eligible(m, 0) for m in model.modules()):
        dtypes = sorted({str(p.dtype).replace("torch.", "") for p in model.parameters()})
        devices = sorted({p.device.type for p in model.parameters()})
        return f"it has no float32 nn.Linear weight on the CPU to pack (dtypes {dtypes}, devices {devices})"
    if torch.is_autocast_enabled("cpu"):
        return "autocast is on for the CPU, and the packed weights would compute in float32 where it computes in its dtype"
    if not _packing_works():
        return "this torch build has no working oneDNN packed linear"
    return None


def packing_plan(
    fast: FastConfig, model: torch.nn.Module, device: torch.device, new_tokens: int
) -> tuple[int, int] | None:
    """Returns (the decode step from which a rollout of `new_tokens` new tokens decodes through packed weights, the
    fewest elements a packed weight has) under fast.packed_weights, None where it does not pack. `on`: from the
    first step, every float32 weight; `auto`: on a CPU, after `pack_after_steps` steps where more than
    `pack_min_remaining` tokens are left then, weights of `pack_min_elements` or more."""
    on = fast.packed_weights == "on"
    pack_at = 0 if on else fast.pack_after_steps
    if new_tokens - pack_at <= (0 if on else fast.pack_min_remaining):
        return None
    if not choose(
        fast.packed_weights,
        "packed_weights",
        model,
        worth=device.type == "cpu",  # a CPU-only lever: nothing to say about it on a GPU
        unavailable=lambda: packing_unavailable(model),
    ):
        return None
    return pack_at, 0 if on else fast.pack_min_elements


def _eligible(module: torch.nn.Module, min_elements: int) -> TypeGuard[torch.nn.Linear]:
    """Returns whether `module` is a plain nn.Linear with a float32 CPU weight of at least min_elements
    elements (subclasses may change the maths)."""
    w = getattr(module, "weight", None)
    return (
        type(module) is torch.nn.Linear
        and isinstance(w, torch.Tensor)
        and w.device.type == "cpu"
        and w.dtype == torch.float32
        and w.numel() >= min_elements
        and "forward" not in module.__dict__  # already swapped (nested block) or patched by someone else
    )


def _packed_forward(module: torch.nn.Linear, packed: torch.Tensor):
    """Returns a forward(x) computing module(x) from oneDNN's packed weight (the plain one where autograd needs it)."""
    bias = None if module.bias is None else module.bias.detach()

    def forward(x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or x.device.type != "cpu" or torch.is_grad_enabled():
            return torch.nn.functional.linear(x, module.weight, module.bias)
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")

    return forward


@contextlib.contextmanager
def packed_linears(
    model: torch.nn.Module, batch_hint: int = 8, min_elements: int | None = None
) -> Iterator[int]:
    """Yields how many nn.Linear layers of `model` run on oneDNN-packed weights inside the block (0: none).

    batch_hint: the number of rows the layers will mostly see (oneDNN picks its layout for it; every
    row count gives the same result). min_elements: smaller weights stay on MKL
    (None: FastConfig's default `pack_min_elements`, whose docstring says why).
    """
    if min_elements is None:
        min_elements = FastConfig().pack_min_elements
    swapped: list[torch.nn.Module] = []
    try:
        if any(_eligible(m, min_elements) for m in model.modules()) and _packing_works():
            try:
                with torch.no_grad():
                    for module in model.modules():
                        if _eligible(module, min_elements):
                            # An instance attribute shadowing Linear.forward until _restore deletes it:
                            module.forward = _packed_forward(  # type: ignore[method-assign]
                                module, _reorder(module.weight, batch_hint)
                            )
                            swapped.append(module)
            except (RuntimeError, MemoryError) as err:
                # Packing only speeds decoding up: if it fails (out of memory, say), decode without it.
                _restore(swapped)
                warnings.warn(
                    f"packing weights for CPU decoding failed ({err}); using plain matmuls", stacklevel=3
                )
        yield len(swapped)
    finally:
        _restore(swapped)


def _reorder(weight: torch.Tensor, batch_hint: int) -> torch.Tensor:
    """Returns `weight` reordered into oneDNN's blocked layout for about `batch_hint` rows."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), max(1, batch_hint))


def _restore(swapped: list[torch.nn.Module]) -> None:
    """Gives the modules in `swapped` back their class's forward and empties the list."""
    for module in swapped:
        del module.forward
    swapped.clear()
