"""Iterative GRPO: reference reset, the reward model retrained on fresh labelled policy samples with replay,
its state in checkpoints (a resumed run continues exactly), and bad settings refused before training."""

from __future__ import annotations

import json

import pytest
import torch
from test_trainer import DIGITS, _cfg

from cohort.errors import ConfigError
from cohort.trainer import GRPOTrainer

PARITY = DIGITS.replace("digit_fraction", "first_char_parity")


def _it_cfg(model_dir, rm, out, **over):
    base = {
        "rewards": [str(rm)],
        "algo.beta": 0.01,
        "iterative.every": 2,
        "iterative.labeler": PARITY,
        "iterative.label_threshold": 0.5,
        "iterative.prompts": 4,
        "iterative.rm_steps": 3,
        "iterative.rm_batch_size": 4,
        "steps": 4,
        "save_every": 2,
    }
    base.update(over)
    return _cfg(model_dir, out, **base)


def test_iterations_reset_the_reference_and_retrain_the_reward_model(tiny_model_dir, rm_dir, tmp_path):
    t = GRPOTrainer(_it_cfg(tiny_model_dir, rm_dir, tmp_path / "a"))
    rm_before = {k: v.clone() for k, v in t.iterative.trainer.model.state_dict().items()}
    t.train()
    rows = [json.loads(x) for x in (t.run_dir / "metrics.jsonl").read_text().splitlines()]
    done = [r for r in rows if "iterative/retrainings" in r]
    assert [r["step"] for r in done] == [2, 4] and [r["iterative/retrainings"] for r in done] == [1.0, 2.0]
    assert all(r["iterative/fresh_pairs"] > 0 for r in done)
    assert all(
        0 <= r["iterative/rm_accuracy_before"] <= 1 and 0 <= r["iterative/rm_accuracy_after"] <= 1
        for r in done
    )
    assert done[1]["iterative/replay_pairs"] > 0  # the second retraining replays the first one's pairs
    assert t.reference.syncs == 2
    moved = any(not torch.equal(rm_before[k], v) for k, v in t.iterative.trainer.model.state_dict().items())
    assert moved  # the reward function itself was retrained in place
    assert (t.run_dir / "checkpoints" / "step-4" / "iterative.pt").is_file()


def test_a_resumed_run_continues_exactly(tiny_model_dir, rm_dir, tmp_path):
    a = GRPOTrainer(_it_cfg(tiny_model_dir, rm_dir, tmp_path / "a"))
    a.train()
    b = GRPOTrainer(_it_cfg(tiny_model_dir, rm_dir, tmp_path / "b", steps=2))
    b.train()
    b = GRPOTrainer(_it_cfg(tiny_model_dir, rm_dir, tmp_path / "b", steps=4, resume="auto"))  # from step 2
    assert b.step_idx == 2 and len(b.iterative.buffer) == len(a.iterative.buffer) - a_fresh_last(a)
    b.train()
    for name, value in a.model.state_dict().items():
        assert torch.equal(value, b.model.state_dict()[name]), name
    for name, value in a.iterative.trainer.model.state_dict().items():
        assert torch.equal(value, b.iterative.trainer.model.state_dict()[name]), name
    assert len(a.iterative.buffer) == len(b.iterative.buffer)


def a_fresh_last(trainer) -> int:
    rows = [json.loads(x) for x in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    return int([r for r in rows if "iterative/fresh_pairs" in r][-1]["iterative/fresh_pairs"])


@pytest.mark.parametrize(
    "over, fragment",
    [
        ({"rewards": [DIGITS]}, "add a reward model folder"),
        ({"iterative.replay": 1.0}, r"iterative.replay=1.0 must be in \[0, 1\)"),
        ({"iterative.rm_steps": 0}, "iterative.rm_steps=0 must be >= 1"),
        ({"iterative.every": -1}, "iterative.every=-1 must be >= 0"),
        ({"iterative.initial_data": "/no/such/pairs.jsonl"}, "does not exist"),
        ({"iterative.labeler": ""}, "source of labels"),
    ],
)
def test_bad_iterative_settings(tiny_model_dir, rm_dir, tmp_path, over, fragment):
    with pytest.raises(ConfigError, match=fragment):
        GRPOTrainer(_it_cfg(tiny_model_dir, rm_dir, tmp_path / "x", **over))


def test_a_reward_model_with_another_models_tokenizer_is_refused(tiny_model_dir, rm_dir):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from cohort.rewards import RewardModel

    model = AutoModelForSequenceClassification.from_pretrained(rm_dir)
    tok = AutoTokenizer.from_pretrained(rm_dir)
    tok.add_tokens([f"<extra{i}>" for i in range(200)])
    with pytest.raises(ValueError, match="not this model's tokenizer"):
        RewardModel(model, tok)


def test_two_reward_models_need_a_name(tiny_model_dir, rm_dir, tmp_path):
    with pytest.raises(ConfigError, match="set iterative.reward"):
        GRPOTrainer(_it_cfg(tiny_model_dir, rm_dir, tmp_path / "x", rewards=[str(rm_dir), str(rm_dir)]))


def test_a_reward_name_that_is_no_reward_model_is_named(tiny_model_dir, rm_dir, tmp_path):
    with pytest.raises(
        ConfigError, match=r"iterative.reward='foo' names no reward model of this run; its reward"
    ):
        GRPOTrainer(_it_cfg(tiny_model_dir, rm_dir, tmp_path / "x", **{"iterative.reward": "foo"}))


def test_an_unknown_labeler_is_refused_before_the_policy_loads(tiny_model_dir, rm_dir, tmp_path):
    cfg = _it_cfg(tiny_model_dir, rm_dir, tmp_path / "x", **{"iterative.labeler": "no_such_reward"})
    cfg.model.name_or_path = "no_model_here"  # a Hub-like name: loading it would fail with another error
    with pytest.raises(ValueError, match="no_such_reward"):
        GRPOTrainer(cfg)
