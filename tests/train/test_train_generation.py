"""train/generation.py: the in-process generation source."""

from __future__ import annotations

import pytest
import torch
from _tiny import make_test_engine, tiny_model

from cohort.errors import NonFiniteError
from cohort.fastpath import FastConfig
from cohort.rollout import SamplingParams
from cohort.train.generation import LocalGeneration


def test_local_generation_samples_the_policy():
    source = LocalGeneration(make_test_engine("builtin"), tiny_model(seed=1))
    batch = source.generate([[5, 6], [7]], 2, SamplingParams(max_completion_length=3), torch.Generator())
    assert batch.num_completions == 4 and batch.group_size == 2


@pytest.mark.parametrize("name", ["hf", "builtin"])
def test_non_finite_logits_while_sampling_stop_the_run_with_a_non_finite_error(name, monkeypatch):
    from cohort.rollout import sampling

    # the builtin engine's accelerator branch (torch.multinomial) on this CPU machine
    monkeypatch.setattr(sampling, "draw", lambda probs, generator: torch.multinomial(probs, 1).squeeze(-1))
    model = tiny_model(seed=4)
    with torch.no_grad():
        model.lm_head.weight[2] = float("nan")
    source = LocalGeneration(make_test_engine(name, fast=FastConfig.all("off")), model)
    with pytest.raises(NonFiniteError, match=r"^the policy produced non-finite logits while sampling \(prob"):
        source.generate([[5, 6]], 2, SamplingParams(max_completion_length=3), None)
