"""Copies from the host to a CUDA device that do not make the host wait for the device.

A plain copy of a CPU tensor to a CUDA device waits for everything already queued on the stream (torch copies from
pageable memory, then synchronises the stream): in the update's micro-batch loop, the copies of the next
micro-batch's token ids and indices each waited for the previous micro-batch's backward, so the host could not
queue work while the device ran. Copied from pinned (page-locked) memory with non_blocking, a copy is queued behind
that work instead and the host goes on; torch keeps the pinned block until the copy has run. On any other device
(a CPU, MPS) a tensor moves exactly as `.to(device)` moves it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def to_device(tensor: torch.Tensor, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Returns `tensor` in `dtype` (None: its own) on `device`; from the CPU to a CUDA device the copy is queued
    without waiting."""
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device, dtype)
    if dtype is not None:
        tensor = tensor.to(dtype)
    return tensor.pin_memory().to(device, non_blocking=True)


def long_tensors(values: Sequence[Any], device: torch.device) -> list[torch.Tensor]:
    """Returns each of `values` (an int, or nested lists of ints, as torch.tensor takes) as an int64 tensor on
    `device`; on a CUDA device all of them travel in one queued copy (views of one buffer)."""
    host = [torch.tensor(v, dtype=torch.long) for v in values]
    if device.type != "cuda":
        return [t.to(device) for t in host]
    return unpack(to_device(pack(host), device), host)


def pack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Returns `tensors` (one dtype) flattened and joined into one 1-D tensor."""
    return torch.cat([t.reshape(-1) for t in tensors])


def unpack(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Returns views of `flat` shaped as `like`, in order (pack's inverse)."""
    parts = flat.split([t.numel() for t in like])
    return [part.view(t.shape) for part, t in zip(parts, like)]
