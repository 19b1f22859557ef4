"""What a run shows: plain log lines when stdout is not a terminal, evaluation lines, no transformers bars,
summary.json, and the terminated-length / clip-extreme metrics."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cohort.compat.drop_in import GRPOConfig
from cohort.config import load_config
from cohort.errors import ConfigError
from cohort.rollout import RolloutBatch
from cohort.train.metrics import step_metrics
from cohort.train.update import UpdateStats
from cohort.trainer import GRPOTrainer

DIGITS = str(Path(__file__).parent / "digit_reward.py") + ":digit_fraction"


def _train(model_dir: Path, out: Path) -> subprocess.CompletedProcess:
    overrides = {
        "model.name_or_path": str(model_dir),
        "data.task": "addition",
        "data.n_train": 32,
        "data.n_eval": 4,
        "rollout.group_size": 4,
        "rollout.batch_size": 8,
        "rollout.max_completion_length": 8,
        "optim.lr": 3e-2,
        "algo.beta": 0.02,
        "algo.num_iterations": 2,  # the second pass sees a moved policy: ratios != 1, clipping possible
        "algo.eps_low": 0.02,
        "algo.eps_high": 0.02,
        "rewards": f"[accuracy, '{DIGITS}']",  # a dense reward: non-zero advantages
        "steps": 4,
        "save_every": 2,
        "eval_every": 2,
        "eval_limit": 4,
        "logging_steps": 2,
        "threads": 1,
        "out_dir": str(out),
    }
    cmd = [sys.executable, "-m", "cohort.cli", "train", *[f"{k}={v}" for k, v in overrides.items()]]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)


def test_train_with_stdout_to_a_pipe_logs_plain_lines_and_a_summary(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    proc = _train(tiny_model_dir, out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    steps = [x for x in lines if x.startswith("step ")]
    assert [x.split()[1] for x in steps] == ["2/4", "4/4"], proc.stdout
    for line in steps:
        assert re.search(r"reward \S+ \| kl \S+ \| length \S+ \| \S+ s/step \| ETA \d+:\d\d:\d\d$", line), (
            line
        )
    evals = [x for x in lines if x.startswith("eval step ")]
    assert [x.split()[2] for x in evals] == ["0", "2", "4"], proc.stdout
    assert all("| accuracy " in x and x.endswith("4 prompts") for x in evals)
    both = proc.stdout + proc.stderr
    assert "Writing model shards" not in both and "Loading weights" not in both
    assert "━" not in proc.stdout  # no rich bar when stdout is not a terminal

    summary = json.loads((out / "summary.json").read_text())
    expected = {"start_step", "steps", "total_steps", "seconds_train", "seconds_per_step", "interrupted"}
    assert expected | {"checkpoint", "accuracy_before", "accuracy_after", "final_metrics"} <= set(summary)
    assert summary["start_step"] == 0 and summary["steps"] == 4 and summary["interrupted"] is False
    assert Path(summary["checkpoint"]).name == "step-4"
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert summary["final_metrics"]["reward"] == rows[-1]["reward"]
    assert {"loss", "kl", "completions/mean_length"} <= set(summary["final_metrics"])
    assert "<h2>Summary</h2>" in (out / "report.html").read_text()
    assert any(r["clip_ratio/high_max"] > 0 for r in rows)  # the check below is not only 0 <= 0 <= 0
    for r in rows:
        t = [r[f"completions/{k}_terminated_length"] for k in ("min", "mean", "max")]
        assert t[0] <= t[1] <= t[2] <= r["completions/max_length"], r
        assert r["clip_ratio/low_min"] <= r["clip_ratio/low_mean"] + 1e-9, r
        assert r["clip_ratio/high_mean"] <= r["clip_ratio/high_max"] + 1e-9, r


def _fake_rollout(lengths: list[int], truncated: list[bool]) -> RolloutBatch:
    return RolloutBatch(
        [[5, 6]] * (len(lengths) // 2), [[7] * n for n in lengths], torch.tensor(truncated), 2
    )


def _metrics_of(rollout: RolloutBatch) -> dict:
    n = rollout.num_completions
    reward = torch.arange(n, dtype=torch.float32)
    zero_std = torch.zeros(n, dtype=torch.bool)
    return step_metrics(1, rollout, reward[:, None], reward, zero_std, UpdateStats(), ["r"], 0)


def test_terminated_lengths_cover_only_completions_that_ended_with_eos():
    m = _metrics_of(_fake_rollout([3, 8, 5, 8], [False, True, False, True]))
    assert m["completions/mean_terminated_length"] == 4.0
    assert m["completions/min_terminated_length"] == 3.0
    assert m["completions/max_terminated_length"] == 5.0
    assert m["completions/mean_length"] == 6.0


def test_terminated_lengths_are_zero_when_every_completion_was_cut():
    m = _metrics_of(_fake_rollout([8, 8], [True, True]))
    for k in ("mean", "min", "max"):
        assert m[f"completions/{k}_terminated_length"] == 0.0


def test_logging_steps_key_range_and_trl_mapping():
    assert load_config(None, ["logging_steps=3"]).logging_steps == 3
    with pytest.raises(ConfigError, match="logging_steps"):
        load_config(None, ["logging_steps=0"]).validate(need_model=False, need_data=False)
    assert GRPOConfig(output_dir="x", max_steps=40).to_train_config("m", 8).logging_steps == 10
    assert (
        GRPOConfig(output_dir="x", max_steps=40, logging_steps=4).to_train_config("m", 8).logging_steps == 4
    )
    ratio = GRPOConfig(output_dir="x", max_steps=40, logging_steps=0.25).to_train_config("m", 8)
    assert ratio.logging_steps == 10


def test_samples_are_whole_groups_with_each_functions_reward_and_the_advantage(tiny_model_dir, tmp_path):
    from test_trainer import _cfg

    from cohort.algo import group_advantages

    cfg = _cfg(tiny_model_dir, tmp_path / "s", steps=2, num_samples_logged=5, rewards=[DIGITS, "format"])
    GRPOTrainer(cfg).train()
    rows = [json.loads(x) for x in (tmp_path / "s" / "samples.jsonl").read_text().splitlines()]
    G = cfg.rollout.group_size
    assert len(rows) == 2 * 2 * G  # ceil(5 / G) = 2 whole groups per step
    for step in (1, 2):
        for g in {r["group"] for r in rows if r["step"] == step}:
            group = [r for r in rows if r["step"] == step and r["group"] == g]
            assert len(group) == G and len({r["prompt"] for r in group}) == 1
            for r in group:
                assert r["reward"] == pytest.approx(r["rewards/digit_fraction"] + r["rewards/format_reward"])
                assert isinstance(r["in_loss"], bool) and 1 <= r["length"] <= 6
            expected = group_advantages(torch.tensor([r["reward"] for r in group]), G)
            assert [r["advantage"] for r in group] == pytest.approx(expected.tolist(), abs=1e-5)
    none = _cfg(tiny_model_dir, tmp_path / "n", steps=1, num_samples_logged=0)
    GRPOTrainer(none).train()
    assert (tmp_path / "n" / "samples.jsonl").read_text() == ""
