"""Where a step's completions come from: the generation-source interface and the in-process source.

The step asks a `GenerationSource` for G completions of each prompt (with the sampler's log-probs and
whether each row was truncated) and does not know who produced them. `LocalGeneration` samples the policy
being trained with an engine in this process; `cohort.episodes.EpisodeGeneration` rolls out multi-turn
episodes with tools and environments; a remote worker, or a source that is a step behind, stands behind the
same call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Protocol

import torch

from cohort.errors import NonFiniteError, NonFiniteSamplingError
from cohort.rollout import RolloutBatch, SamplingParams
from cohort.rollout.base import RolloutEngine
from cohort.rollout.sampler_copy import SamplerCopy
from cohort.runtime.sharding import gathered


class GenerationSource(Protocol):
    """Produces rollouts of the current policy for a list of prompts."""

    def generate(
        self,
        prompt_ids: list[list[int]],
        group_size: int,
        params: SamplingParams,
        generator: torch.Generator | None,
        rows: list[dict] | None = None,
        on_finished: Callable[[int, list[int]], None] | None = None,
    ) -> RolloutBatch:
        """Returns G completions of each prompt (group-contiguous), sampled with `params` on `generator`;
        `rows` are the prompts' dataset rows (a multi-turn source resets its environments from them);
        `on_finished(row, completion_ids)`, where a source supports it, hears of each completion ending with EOS
        while the others are generated (a source may ignore it: the rewards then start after generation)."""
        ...


class LocalGeneration:
    """Samples the policy in this process with an engine (from its low-precision copy when one is set)."""

    def __init__(
        self,
        engine: RolloutEngine,
        model: torch.nn.Module,
        *,
        sampler_copy: SamplerCopy | None = None,
        autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    ):
        self.engine, self.model, self.sampler_copy, self.autocast = engine, model, sampler_copy, autocast

    def generate(
        self,
        prompt_ids: list[list[int]],
        group_size: int,
        params: SamplingParams,
        generator: torch.Generator | None,
        rows: list[dict] | None = None,
        on_finished: Callable[[int, list[int]], None] | None = None,
    ) -> RolloutBatch:
        """Returns the engine's rollout of the current weights (gathered first when the model is sharded)."""
        with self.autocast(), gathered(self.model):
            model = self.model if self.sampler_copy is None else self.sampler_copy.sync(self.model)
            try:
                return self.engine.generate(
                    model, prompt_ids, group_size, params, generator, on_finished=on_finished
                )
            except NonFiniteSamplingError as e:
                raise NonFiniteError(
                    f"the policy produced non-finite logits while sampling ({e}); usually half-precision "
                    "overflow (try model.dtype=float32 or bfloat16)"
                ) from None
