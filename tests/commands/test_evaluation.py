"""cohort.evaluate: the rewards of held-out completions are scored outside the caller's autocast (the trainer
samples its held-out rollouts under bf16 autocast on a GPU), so a learned reward model scores them in its own dtype,
as it scores training rollouts; and a prompt that fills the model's context is named by its row."""

from __future__ import annotations

import pytest
import torch
from _tiny import make_test_engine, tiny_model

from cohort.commands.evaluation import evaluate, fit_completion_length
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


def test_a_prompt_that_fills_the_context_is_named_by_its_row(capsys):
    model = tiny_model(seed=1)
    model.config.max_position_embeddings = 16
    prompts = [[3] * 4, [3] * 10, [3] * 20, [3] * 16]
    with pytest.raises(ValueError) as info:
        fit_completion_length(model, prompts, 8)
    message = str(info.value)
    assert message.startswith(
        "row 2 of the data is a prompt of 20 tokens, which fills the model's context of 16"
    )
    assert (
        "2 of 4 prompts do, the longest 20 tokens" in message
        and "--n 2 to keep the rows before it" in message
    )
    with pytest.raises(ValueError, match=r"leave them out of the data$"):  # no --n 0: it would keep no row
        fit_completion_length(model, prompts[2:], 8)
    # a prompt that leaves some room lowers the completion length, with a note
    assert fit_completion_length(model, prompts[:2], 8) == 6
    assert "lowered from 8 to 6" in capsys.readouterr().err
    assert fit_completion_length(model, prompts[:1], 8) == 8
