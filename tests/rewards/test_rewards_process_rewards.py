"""Process supervision through the trainer: step rewards from a reward function or a process reward model,
turned into per-token advantages (seed 000's worked example), combined with outcome rewards."""

from __future__ import annotations

import json
import math

import pytest
import torch
from test_trainer import _cfg

from cohort.rewards import StepRewards, score
from cohort.rewards.process_rewards import ProcessRewardModel, step_char_ends, step_token_ends
from cohort.rewards.scoring import RewardFunctionError
from cohort.trainer import GRPOTrainer

A = math.sqrt(3.98)  # makes the 10 step rewards below have mean 0 and population std 1 (2.04 + 2 * 3.98 = 10)
SEED_STEPS = {0: [0.5, -0.2, 0.8, 0.3], 1: [-0.5, 0.2, -0.8, -0.3], 2: [A, -A]}
SEED_ENDS = {0: [0, 1, 2, 3], 1: [0, 1, 2, 3], 2: [0, 1]}
# One group of 3 completions of 4 tokens, population std and (almost) no eps: r~ = r exactly.
ONE_GROUP = {
    "rollout.group_size": 3,
    "rollout.batch_size": 3,
    "rollout.max_completion_length": 4,
    "algo.std": "population",
    "algo.adv_eps": 1e-12,
    "num_samples_logged": 3,
    "steps": 1,
}


def seed_example(completions, **kwargs):
    """Seed 000's normalised step rewards r~ = [0.5, -0.2, 0.8, 0.3] for completion 0 of each group."""
    return [{"rewards": SEED_STEPS[i % 3], "ends": SEED_ENDS[i % 3]} for i in range(len(completions))]


def _no_eos(trainer):
    # Every completion runs to max_completion_length: the step ends above need 4 tokens.
    eos = trainer.tokenizer.eos_token_id
    trainer.model.lm_head.register_forward_hook(
        lambda mod, args, out: out.index_fill(-1, torch.tensor([eos], device=out.device), -1e4)
    )


def test_the_seeds_worked_example_through_the_trainer(tiny_model_dir, tmp_path):
    t = GRPOTrainer(_cfg(tiny_model_dir, tmp_path, **ONE_GROUP), reward_funcs=[seed_example])
    _no_eos(t)
    result = t.step()
    got = {i: s["token_advantages"] for i, s in enumerate(result.samples)}
    assert [len(v) for v in got.values()] == [4, 4, 4]
    # Return-to-go of r~ = [0.5, -0.2, 0.8, 0.3]: [1.4, 0.9, 1.1, 0.3] (seed 000's figure).
    assert got[0] == pytest.approx([1.4, 0.9, 1.1, 0.3], abs=1e-6)
    assert got[1] == pytest.approx([-1.4, -0.9, -1.1, -0.3], abs=1e-6)
    assert got[2] == pytest.approx([0.0, -A, 0.0, 0.0], abs=1e-6)  # tokens after the last step get 0
    m = result.metrics
    assert m["process/steps_per_completion"] == pytest.approx(10 / 3)
    assert m["process/step_reward_mean"] == pytest.approx(0.0, abs=1e-9)
    assert m["process/step_reward_std"] == pytest.approx(1.0)


def test_outcome_and_process_rewards_add(tiny_model_dir, tmp_path):
    def outcome(completions, **kwargs):
        return [float(i % 3 == 0) for i in range(len(completions))]  # group z-score: [2/sqrt(2)... ] below

    over = {**ONE_GROUP, "reward_weights": [1.0, 0.5]}
    t = GRPOTrainer(_cfg(tiny_model_dir, tmp_path, **over), reward_funcs=[outcome, seed_example])
    _no_eos(t)
    got = [s["token_advantages"] for s in t.step().samples]
    # Outcome [1, 0, 0]: mean 1/3, population std sqrt(2)/3 -> z = [sqrt(2), -1/sqrt(2), -1/sqrt(2)].
    z = [math.sqrt(2), -1 / math.sqrt(2), -1 / math.sqrt(2)]
    assert got[0] == pytest.approx([z[0] + 0.5 * v for v in (1.4, 0.9, 1.1, 0.3)], abs=1e-6)
    assert got[2] == pytest.approx([z[2], z[2] - 0.5 * A, z[2], z[2]], abs=1e-6)


def test_steps_found_by_the_separator_train_the_policy(tiny_model_dir, tmp_path):
    def per_line(completions, **kwargs):
        # One reward per line of the completion: 1 for a line holding a digit.
        return [[float(any(c.isdigit() for c in line)) for line in _steps(c)] for c in completions]

    t = GRPOTrainer(
        _cfg(tiny_model_dir, tmp_path, **{"process.step_separator": "1", "steps": 2}), reward_funcs=[per_line]
    )
    before = {k: v.clone() for k, v in t.model.state_dict().items()}
    t.train()
    rows = [json.loads(x) for x in (t.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all("process/steps_per_completion" in r for r in rows)
    assert any(not torch.equal(before[k], v) for k, v in t.model.state_dict().items())


def _steps(text: str) -> list[str]:
    ends = step_char_ends(text, "1")
    out, start = [], 0
    for e in ends:
        out.append(text[start : e + 1])
        start = e + 1
    return out


def test_step_boundaries_by_hand():
    assert step_char_ends("a\nbc\nd", "\n") == [1, 4, 5]
    assert step_char_ends("a\nbc\n", "\n") == [1, 4]  # a final separator closes the last step
    assert step_char_ends("abc", "\n") == [2]
    assert step_char_ends("", "\n") == []
    # Tokens "ab", "\nc", "d\n": step 1 ends at char 2 (token 1), step 2 at char 5 (token 2).
    assert step_token_ends(["ab", "\nc", "d\n"], "\n") == [1, 2]
    # A blank line is no step: "a", "\n\nb" -> 2 steps, as the docs' per-line function counts them.
    assert step_char_ends("a\n\n\nb\n", "\n") == [1, 5]
    assert step_char_ends("\n\na", "\n") == [2]


def test_the_docs_process_reward_example_counts_the_steps_the_separator_finds():
    def per_step(completions, **kwargs):  # docs/usage.md, "Process rewards", with a stand-in scorer
        return [[float(len(line)) for line in c.split("\n") if line.strip()] for c in completions]

    for text in ("x = 1\n\ny = 2\n", "\n  \nonly\n", "a\nb", "a\n\n\n\nb\n\n"):
        assert len(per_step([text])[0]) == len(step_char_ends(text, "\n")), text


def test_a_step_count_that_does_not_match_the_text_is_named(tiny_model_dir, tmp_path):
    def wrong(completions, **kwargs):
        return [[1.0] * 50 for _ in completions]

    t = GRPOTrainer(_cfg(tiny_model_dir, tmp_path), reward_funcs=[wrong])
    with pytest.raises(RewardFunctionError, match="step rewards"):
        t.step()


def test_step_rewards_are_refused_outside_training():
    with pytest.raises(RewardFunctionError, match="list .* at index 0: several numbers.*only training uses"):
        score([lambda completions, **k: [[1.0, 2.0]] * len(completions)], prompts=["p"], completions=["c"])
    steps: dict = {}
    out = score(
        [lambda completions, **k: [StepRewards([1.0, 3.0], [0, 1])]],
        prompts=["p"],
        completions=["ab"],
        steps=steps,
    )
    assert out[0, 0].item() == 2.0 and steps[0][0].rewards == [1.0, 3.0]
    with pytest.raises(RewardFunctionError, match="one end per step"):
        score(
            [lambda completions, **k: [{"rewards": [1.0], "ends": [0, 1]}]],
            prompts=["p"],
            completions=["ab"],
            steps={},
        )


def test_a_process_reward_model_by_path_scores_each_step(tiny_model_dir, tmp_path):
    from transformers import AutoConfig, AutoModelForTokenClassification, AutoTokenizer

    config = AutoConfig.from_pretrained(tiny_model_dir, num_labels=2)
    torch.manual_seed(0)
    prm = AutoModelForTokenClassification.from_config(config)
    folder = tmp_path / "prm"
    prm.save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(folder)
    model = ProcessRewardModel(folder, separator="\n")
    out = model(["1+1=", "2+2="], ["2\n3\n4", "5"])
    assert [len(s.rewards) for s in out] == [3, 1]
    assert all(0.0 < r < 1.0 for s in out for r in s.rewards)  # probabilities of label 1
    # First among the rewards with evaluation on: refused (evaluation needs one number per completion).
    from cohort.errors import ConfigError

    with pytest.raises(ConfigError, match="is a process reward model"):
        GRPOTrainer(_cfg(tiny_model_dir, tmp_path / "e", **{"rewards": [str(folder)], "eval_at_ends": True}))
    # gmpo needs one advantage per completion: refused before the policy loads (the path does not exist).
    with pytest.raises(
        ConfigError, match="loss_type='gmpo' needs one advantage per completion.*process reward"
    ):
        GRPOTrainer(
            _cfg(
                tiny_model_dir,
                tmp_path / "g",
                **{
                    "rewards": [str(folder)],
                    "algo.loss_type": "gmpo",
                    "model.name_or_path": "not-loaded",  # a Hub-like name, never loaded
                },
            )
        )
    # Through the trainer, by path, as any reward model.
    t = GRPOTrainer(_cfg(tiny_model_dir, tmp_path / "run", **{"rewards": [str(folder)], "steps": 1}))
    assert type(t.reward_funcs[0]).__name__ == "ProcessRewardModel"
    t.train()
    rows = [json.loads(x) for x in (t.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["process/steps_per_completion"] >= 1.0


def test_a_function_returning_step_rewards_under_gmpo_is_one_clear_error(tiny_model_dir, tmp_path):
    from cohort.errors import TrainingError

    def steps(completions, **kwargs):
        return [[1.0, float(len(c) % 2)] for c in completions]

    t = GRPOTrainer(
        _cfg(tiny_model_dir, tmp_path, **{"algo.loss_type": "gmpo", "steps": 1}), reward_funcs=[steps]
    )
    with pytest.raises(
        TrainingError, match="'steps' returned step rewards.*needs one advantage per completion"
    ):
        t.train()
