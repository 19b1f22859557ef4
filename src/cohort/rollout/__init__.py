"""Rollout engines: G completions per prompt behind one interface (`make_engine`)."""

from __future__ import annotations

from collections.abc import Sequence

from cohort import choices
from cohort.rollout.base import EpisodeRecord, RolloutBatch, RolloutEngine, SamplingParams, select_groups
from cohort.rollout.builtin import BuiltinEngine
from cohort.rollout.hf import HFEngine
from cohort.rollout.sampling import draw, filter_logits, sample_next

ENGINES: dict[str, type[RolloutEngine]] = {"builtin": BuiltinEngine, "hf": HFEngine}
if tuple(ENGINES) != choices.ENGINES:  # the config validates rollout.engine against the light list
    raise ImportError(
        f"cohort.choices.ENGINES {choices.ENGINES} must name the registered engines {tuple(ENGINES)}"
    )


def make_engine(name: str, *, eos_token_ids: Sequence[int], pad_token_id: int, **options) -> RolloutEngine:
    """Returns the rollout engine called `name` ("builtin" or "hf")."""
    if name in choices.WORKER_ENGINES:
        raise ValueError(
            f"the rollout engine {name!r} runs in rollout workers only (cohort serve --engine {name}; "
            "docs/vllm.md): list them in rollout.workers, or use 'builtin' in this process"
        )
    if name not in ENGINES:
        raise ValueError(
            f"unknown rollout engine {name!r}; valid names: {sorted(ENGINES)}. "
            "Use 'builtin' (fast KV-cache sampler) or 'hf' (transformers generate)"
        )
    return ENGINES[name](eos_token_ids=eos_token_ids, pad_token_id=pad_token_id, **options)


__all__ = [
    "ENGINES",
    "BuiltinEngine",
    "EpisodeRecord",
    "HFEngine",
    "RolloutBatch",
    "select_groups",
    "RolloutEngine",
    "SamplingParams",
    "draw",
    "filter_logits",
    "make_engine",
    "sample_next",
]
