"""The GRPO family after DAPO through the trainer: every loss type, advantage estimator, token control and
preset reachable from YAML; user losses and estimators from their own modules; bad input at config load."""

from __future__ import annotations

import json
import math
import textwrap

import pytest
import torch
from test_trainer import _cfg, _params

from cohort import cli
from cohort.algo import LOSS_TYPES
from cohort.algo.estimators import ADVANTAGE_TYPES
from cohort.config import load_config
from cohort.config.presets import PRESETS
from cohort.errors import ConfigError
from cohort.runtime.plugins import check_user_objective
from cohort.trainer import GRPOTrainer


def _train(cfg):
    t = GRPOTrainer(cfg)
    before = _params(t.model)
    t.train()
    rows = [json.loads(line) for line in (t.run_dir / "metrics.jsonl").read_text().splitlines()]
    moved = any(not torch.equal(before[k], v) for k, v in t.model.state_dict().items())
    return t, rows, moved


@pytest.mark.parametrize("loss_type", [t for t in LOSS_TYPES if t not in ("grpo", "bnpo", "dapo", "dr_grpo")])
def test_each_new_loss_type_trains_from_yaml(tiny_model_dir, tmp_path, loss_type):
    over = (
        {"algo.kl_tau": 1e-3, "algo.num_iterations": 2} if loss_type == "dro" else {}
    )  # dro needs its penalty
    if loss_type == "luspo":
        over = {"algo.importance": "sequence"}
    cfg = _cfg(tiny_model_dir, tmp_path, **{"algo.loss_type": loss_type, "steps": 2, **over})
    _, rows, moved = _train(cfg)
    assert moved and len(rows) == 2 and all(math.isfinite(r["loss"]) for r in rows)


@pytest.mark.parametrize("advantage", [a for a in ADVANTAGE_TYPES if a != "grpo"])
def test_each_advantage_estimator_trains_from_yaml(tiny_model_dir, tmp_path, advantage):
    _, rows, moved = _train(_cfg(tiny_model_dir, tmp_path, **{"algo.advantage": advantage, "steps": 2}))
    assert moved and all(math.isfinite(r["loss"]) for r in rows)


@pytest.mark.parametrize(
    "over, metric",
    [
        ({"algo.top_entropy_quantile": 0.5}, "entropy_mask/kept_frac"),
        (
            {"algo.cov_method": "clip_cov", "algo.cov_ratio": 0.1, "algo.clip_cov_bounds": [-100.0, 100.0]},
            "cov/selected_frac",
        ),
        (
            {"algo.cov_method": "kl_cov", "algo.cov_ratio": 0.1, "algo.num_minibatches": 2},
            "cov/selected_frac",
        ),
        ({"algo.sampler_correction": "token_tis"}, "sampler/is_ratio_mean"),
        (
            {"algo.off_policy_mask_threshold": 0.0, "rollout.sampler_dtype": "bfloat16"},
            "off_policy_mask/dropped_frac",
        ),
        (
            {
                "algo.loss_type": "vespo",
                "algo.sampler_correction": "token_tis",
                "rollout.sampler_dtype": "bfloat16",
            },
            "vespo/phi_seq_mean",
        ),
        ({"algo.kl_tau": 1e-3, "algo.num_iterations": 2}, "kl_tau/penalty_mean"),
        (
            {"preset": "prime_rl", "rollout.sampler_dtype": "bfloat16", "algo.num_iterations": 2},
            "clip_ratio/region_mean",
        ),
        (
            {"algo.sampler_correction": "sequence_mis", "rollout.sampler_dtype": "bfloat16"},
            "sampler/is_ratio_max",
        ),
    ],
)
def test_token_controls_train_and_report(tiny_model_dir, tmp_path, over, metric):
    _, rows, moved = _train(_cfg(tiny_model_dir, tmp_path, steps=2, **over))
    assert moved
    values = [r[metric] for r in rows if metric in r]
    assert len(values) == 2 and all(math.isfinite(v) for v in values)
    if metric in ("entropy_mask/kept_frac", "cov/selected_frac"):
        assert all(0 < v < 1 for v in values), values


def test_bfloat16_sampling_shows_the_gap_and_tis_bounds_the_weights(tiny_model_dir, tmp_path):
    # The sampler's bfloat16 log-probs differ from the float32 trainer's: the health metric sees the gap, and
    # truncated importance weights never exceed sampler_is_max.
    over = {
        "rollout.sampler_dtype": "bfloat16",
        "algo.sampler_correction": "token_tis",
        "algo.sampler_is_max": 1.0001,
    }
    _, rows, _ = _train(_cfg(tiny_model_dir, tmp_path / "bf16", steps=2, **over))
    _, plain, _ = _train(_cfg(tiny_model_dir, tmp_path / "fp32", steps=2))
    assert min(r["sampler/logprob_gap"] for r in rows) > 10 * max(r["sampler/logprob_gap"] for r in plain)
    assert all(r["sampler/is_ratio_max"] != 1.0 or r["sampler/is_ratio_min"] != 1.0 for r in rows)
    for r in rows:  # a weight was truncated exactly when a raw ratio exceeded the bound
        assert (r["sampler/is_ratio_corrected_frac"] > 0) == (r["sampler/is_ratio_max"] > 1.0001), r


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_validates(tmp_path, name):
    cfg = load_config(None, {"model": {"name_or_path": "m"}, "data": {"task": "addition"}, "preset": name})
    assert cfg.validate().preset == name


def test_a_user_loss_and_estimator_train_through_the_cli(tiny_model_dir, tmp_path):
    code = tmp_path / "my_algo.py"
    code.write_text(
        textwrap.dedent(
            """
            import torch

            CALLS = {"loss": 0, "adv": 0}

            def reinforce(inputs, scale=1.0):
                CALLS["loss"] += 1
                return -scale * inputs.advantages * inputs.policy_gradient_term()

            def centred(rewards, group_size, shift=0.0):
                CALLS["adv"] += 1
                g = rewards.view(-1, group_size)
                return (g - g.nanmean(-1, keepdim=True)).nan_to_num(0.0).reshape(-1) + shift
            """
        )
    )
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        textwrap.dedent(
            f"""
            model: {{name_or_path: {tiny_model_dir}}}
            data: {{task: addition, n_train: 32, n_eval: 8}}
            rollout: {{group_size: 4, batch_size: 16, max_completion_length: 6}}
            algo:
              loss_type: {code}:reinforce
              loss_kwargs: {{scale: 2.0}}
              aggregation: grpo
              advantage: {code}:centred
            optim: {{lr: 0.005}}
            steps: 2
            out_dir: {tmp_path / "run"}
            eval_at_ends: false
            save_every: 0
            progress: false
            """
        )
    )
    assert cli.main(["train", str(cfg)]) == 0
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(math.isfinite(r["loss"]) for r in rows)


@pytest.mark.parametrize(
    "over, fragment",
    [
        ({"algo.loss_type": "cispoo"}, "is not a loss type"),
        ({"algo.loss_type": "no_such_module_xyz:fn"}, "cannot import module 'no_such_module_xyz'"),
        ({"algo.loss_type": "cispo", "algo.loss_kwargs": {"max_ratio": 0.5}}, "max_ratio must be > 1"),
        ({"algo.loss_type": "sapo", "algo.loss_kwargs": {"tau": 1.0}}, "no parameter 'tau'"),
        ({"algo.loss_type": "cispo", "algo.eps_high": 0.28}, "belongs to PPO's clip loss"),
        ({"algo.loss_type": "gmpo", "algo.importance": "sequence"}, "token-level ratios"),
        ({"algo.aggregation": "mean"}, "algo.aggregation"),
        ({"algo.advantage": "ppo"}, "is not an advantage estimator"),
        ({"algo.advantage": "rloo", "algo.scale": "batch"}, "applies to the grpo estimator"),
        ({"algo.advantage": "rloo", "algo.advantage_kwargs": {"x": 1}}, "is for your own estimator"),
        ({"algo.advantage": "rloo", "algo.reward_mode": "decoupled"}, "GDPO"),
        ({"algo.top_entropy_quantile": 0.0}, r"must be in \(0, 1\]"),
        ({"algo.cov_method": "cov"}, "algo.cov_method"),
        ({"algo.cov_method": "kl_cov"}, "num_minibatches or algo.num_iterations above 1"),
        ({"algo.cov": {"kind": "clip_cov", "ratio": 2.0}}, r"algo.cov.ratio=2.0 must be in \(0, 1\]"),
        ({"algo.cov_method": "clip_cov", "algo.clip_cov_bounds": [5.0, 1.0]}, "low < high"),
        (
            {"algo.cov": {"kind": "kl_cov", "coef": -1.0}, "algo.num_iterations": 2},
            "algo.cov.coef=-1.0 must be >= 0",
        ),
        ({"algo.adaptive_entropy": {"delta": 0.0}}, "algo.adaptive_entropy.delta=0.0 must be > 0"),
        ({"algo.sampler_correction": "tis"}, "algo.sampler_correction"),
        (
            {"algo.sampler_correction": "token_tis", "algo.sampler_is_max": 1.0},
            r"algo.sampler_is.max_ratio \(algo.sampler_is_max\)=1.0 must be a number > 1",
        ),
        (
            {"algo.sampler_correction": "token_mis", "algo.sampler_is_min": 1.5},
            r"algo.sampler_is_min\)=1.5 must be a number in \[0, 1\)",
        ),
        ({"rollout.sampler_dtype": "int8"}, "rollout.sampler_dtype"),
    ],
)
def test_bad_objective_options_fail_at_config_load(tmp_path, over, fragment):
    """Each refusal comes before the model loads: from validation, or, for user code (which validation never
    imports), from check_user_objective, the trainer's next check."""
    with pytest.raises(ConfigError, match=fragment):
        check_user_objective(_cfg("m", tmp_path, **over).validate())


def test_a_user_loss_with_the_wrong_signature_names_the_expected_one(tmp_path):
    code = tmp_path / "bad_loss.py"
    code.write_text("def two_args(a, b):\n    return a\n")
    with pytest.raises(ConfigError, match="Expected signature: def my_loss"):
        check_user_objective(_cfg("m", tmp_path, **{"algo.loss_type": f"{code}:two_args"}).validate())
    with pytest.raises(ConfigError, match="has no attribute 'nope'"):
        check_user_objective(_cfg("m", tmp_path, **{"algo.loss_type": f"{code}:nope"}).validate())
    other = tmp_path / "bad_adv.py"  # a file is imported once per process, so a new one
    other.write_text("def adv(rewards):\n    return rewards\n")
    with pytest.raises(ConfigError, match="Expected signature: def my_advantages"):
        check_user_objective(_cfg("m", tmp_path, **{"algo.advantage": f"{other}:adv"}).validate())
