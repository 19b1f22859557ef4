"""cohort.evaluate: the rewards of held-out completions are scored outside the caller's autocast (the trainer
samples its held-out rollouts under bf16 autocast on a GPU), so a learned reward model scores them in its own dtype,
as it scores training rollouts."""

from __future__ import annotations

import torch
from _tiny import make_test_engine, tiny_model

from cohort.commands.evaluation import evaluate
from cohort.fastpath import FastConfig
from cohort.models import build_tiny_tokenizer


def test_rewards_are_scored_outside_the_callers_autocast():
    seen: list[bool] = []

    def reward(prompts, completions, **kwargs):
        seen.append(torch.is_autocast_enabled("cpu"))
        return [1.0] * len(completions)

    model = tiny_model(seed=1)
    rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"}]
    engine = make_test_engine("builtin", fast=FastConfig(shared_prefix="on"))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = evaluate(
            model, build_tiny_tokenizer(), rows, reward, prompt_ids=[[3, 4, 5], [6, 7]], engine=engine, max_completion_length=3,
            k=2, generator=torch.Generator().manual_seed(0),
        )  # fmt: skip
    assert seen and not any(seen) and out["n"] == 2.0
