"""A KV cache that writes each decode step in place instead of concatenating.

transformers' DynamicLayer grows its keys and values with `torch.cat` at every step, so a rollout of T
tokens copies the whole cache T times (quadratic in length: a fifth of decode time on a 14 M model at
250 positions) and churns the allocator with blocks of every size. `PreallocatedLayer` keeps one buffer
per layer sized for prompt + max_completion_length and hands attention a view of its filled part.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


class PreallocatedLayer(DynamicLayer):
    """DynamicLayer whose keys/values are views into a buffer of `capacity` positions, written in place."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = int(capacity)
        self._k: torch.Tensor | None = None  # [B, H, capacity, D]
        self._v: torch.Tensor | None = None
        self._len = 0

    def _set_views(self) -> None:
        assert self._k is not None and self._v is not None
        self.keys = self._k[..., : self._len, :]
        self.values = self._v[..., : self._len, :]

    def _new_buffers(
        self, like_k: torch.Tensor, like_v: torch.Tensor, rows: int, capacity: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        k = like_k.new_empty(rows, like_k.shape[1], capacity, like_k.shape[-1])
        v = like_v.new_empty(rows, like_v.shape[1], capacity, like_v.shape[-1])
        return k, v

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Returns (keys, values) [B, H, length, D] after writing the new states at the end of the buffer."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        if self._k is None or self._len == 0:
            rows = key_states.shape[0]
            self._k, self._v = self._new_buffers(key_states, value_states, rows, max(self.capacity, n))
        elif self._len + n > self._k.shape[-2]:
            # Only if a caller decodes past the length it announced: grow geometrically.
            self._rebuild(lambda t: t, capacity=max(self._len + n, 2 * self._len))
        assert self._k is not None and self._v is not None
        self._k[..., self._len : self._len + n, :] = key_states
        self._v[..., self._len : self._len + n, :] = value_states
        self._len += n
        self._set_views()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        """Returns the number of cached positions."""
        return self._len

    def reset(self) -> None:
        """Drops the buffers."""
        self._k = self._v = None
        self._len = 0
        super().reset()

    def crop(self, tokens_to_remove: int) -> None:
        """Forgets the last `-tokens_to_remove` positions (transformers' convention: a negative count)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of positions to remove, got {tokens_to_remove}")
        if tokens_to_remove and self._k is not None:
            self._len = max(0, self._len + tokens_to_remove)
            self._set_views()

    def _rebuild(self, take, capacity: int | None = None) -> None:
        """Moves the filled part into fresh buffers (of `capacity` positions, default the current one)
        whose rows are take(old filled part)."""
        if self._k is None or self._v is None or self._len == 0:
            return
        k_old, v_old = self._k[..., : self._len, :], self._v[..., : self._len, :]
        k_rows, v_rows = take(k_old), take(v_old)
        cap = capacity or self._k.shape[-2]
        self._k, self._v = self._new_buffers(k_old, v_old, k_rows.shape[0], cap)
        self._k[..., : self._len, :] = k_rows
        self._v[..., : self._len, :] = v_rows
        self._set_views()

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeats every row `repeats` times (the G samples of a prompt share its prefill)."""
        self._rebuild(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keeps only the rows in `indices` (drops ended sequences)."""
        self._rebuild(lambda t: t.index_select(0, indices.to(t.device)))


def preallocated_cache(config, capacity: int) -> DynamicCache:
    """Returns a DynamicCache whose full-attention layers are PreallocatedLayer(capacity).

    Other layer kinds (sliding-window, linear attention) keep transformers' own implementation.
    """
    cache = DynamicCache(config=config) if config is not None else DynamicCache()
    if cache.layers:
        cache.layers = [PreallocatedLayer(capacity) if type(x) is DynamicLayer else x for x in cache.layers]
    elif getattr(cache, "layer_class_to_replicate", None) is DynamicLayer:
        # Typed as a class, but transformers only calls it to make each new layer: a factory works.
        cache.layer_class_to_replicate = lambda: PreallocatedLayer(capacity)  # type: ignore[assignment]
    return cache


class StepLayer(DynamicLayer):
    """A layer of a static decode step's cache: fixed buffers of every own position [N, Hkv, T, D], zero-filled
    (a masked score times a zero value is 0, where uninitialised memory could hold NaN), written at the device
    index `step`; attention always reads the whole buffers (cohort.fastpath.attention.StepPlan masks the rest)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, step: torch.Tensor) -> None:
        super().__init__()
        self.keys, self.values, self.step = keys, values, step
        self.device = keys.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Returns the whole (keys, values) buffers after writing the new [N, Hkv, 1, D] states at column `step`."""
        assert self.keys is not None and self.values is not None
        column = self.step.view(1)
        self.keys.index_copy_(2, column, key_states.to(self.keys.dtype))
        self.values.index_copy_(2, column, value_states.to(self.values.dtype))
        return self.keys, self.values


def step_cache(
    config, rows: int, capacity: int, like: list[tuple[torch.Tensor, torch.Tensor]], step
) -> DynamicCache:
    """Returns a DynamicCache of StepLayers, one per layer of `like` (each layer's prefilled prompt keys and
    values, whose heads, head size, dtype and device the buffers take), `rows` rows of `capacity` positions."""
    cache = DynamicCache(config=config) if config is not None else DynamicCache()
    layers: list = []
    for k, v in like:
        keys = k.new_zeros(rows, k.shape[1], capacity, k.shape[-1])
        values = v.new_zeros(rows, v.shape[1], capacity, v.shape[-1])
        layers.append(StepLayer(keys, values, step))
    cache.layers = layers
    return cache
