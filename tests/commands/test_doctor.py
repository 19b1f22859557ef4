"""`cohort doctor`: finds, on purpose-made broken configs, each problem it claims to find, and passes a sound one."""

from __future__ import annotations

import subprocess
import sys

import pytest
from test_trainer import DIGITS, _cfg

from cohort.commands.doctor import rehearse


def _none(completions, **kwargs):
    return [None] * len(completions)


def _raises(completions, **kwargs):
    raise RuntimeError("the grader's server is down")


def test_a_sound_config_is_ready_and_shows_one_prompts_update(tiny_model_dir, tmp_path):
    rep = rehearse(_cfg(tiny_model_dir, tmp_path / "never-written", **{"algo.beta": 0.04}), groups=2)
    text = "\n".join(rep.lines)
    assert rep.blocking == [], text
    assert "4 prompts per step x G=4 = 16 completions" in text
    assert "digit_fraction: mean" in text and "one prompt's update" in text
    assert text.count("\n    ") >= 5  # a header and G=4 completion rows
    assert "s per step" in text and "MiB resident" in text
    assert not (tmp_path / "never-written").exists()  # nothing is written to out_dir


def test_dppo_topk_rehearses_its_update_with_the_samplers_top_k(tiny_model_dir, tmp_path):
    over = {"algo.loss_type": "dppo_tv", "algo.dppo_topk": 4, "algo.trust_region_anchor": "sampler"}
    rep = rehearse(_cfg(tiny_model_dir, tmp_path / "never-written", **over), groups=1)
    assert rep.blocking == [] and "one prompt's update" in "\n".join(rep.lines), "\n".join(rep.lines)


def test_a_reward_returning_nothing_or_raising_blocks(tiny_model_dir, tmp_path):
    rep = rehearse(_cfg(tiny_model_dir, tmp_path / "n"), groups=2, reward_funcs=[_none])
    assert any("returned None for every completion" in b for b in rep.blocking)
    rep = rehearse(_cfg(tiny_model_dir, tmp_path / "r"), groups=2, reward_funcs=[_raises])
    assert any("the grader's server is down" in b for b in rep.blocking)


def test_truncation_and_zero_variance_are_reported(tiny_model_dir, tmp_path):
    # The random tiny model never emits EOS within 6 tokens, and no completion is a correct sum.
    rep = rehearse(_cfg(tiny_model_dir, tmp_path / "t", rewards=["accuracy"]), groups=2)
    assert any("EOS never ends a completion" in w for w in rep.warnings)
    assert any("all-equal rewards" in w for w in rep.warnings)


def test_the_cli_explains_a_config_error_in_full_and_exits_1(tiny_model_dir, tmp_path):
    args = [
        f"model.name_or_path={tiny_model_dir}",
        "data.task=addition",
        "rollout.group_size=4",
        "rollout.batch_size=10",
        f"rewards=[{DIGITS}]",
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "cohort.cli", "doctor", *args], capture_output=True, text=True
    )
    assert proc.returncode == 1, proc.stderr
    assert "PROBLEM: rollout.batch_size=10 is not a positive multiple of rollout.group_size=4" in proc.stdout
    assert "set rollout.batch_size to e.g. 8 or 12" in proc.stdout
    fixed = [*args[:-2], "rollout.batch_size=8", f"rewards=[{DIGITS}]"]
    # The tiny model's 256-token context leaves no room for the default 256-token completions: found on loading.
    short = subprocess.run(
        [sys.executable, "-m", "cohort.cli", "doctor", *fixed], capture_output=True, text=True
    )
    assert (
        short.returncode == 1
        and "PROBLEM: TrainingError:" in short.stdout
        and "lower rollout.max_completion_length to" in short.stdout
    )
    # a key the loading refuses: reported as the doctor reports (it was the command line's error, exit code 2)
    typo = subprocess.run(
        [sys.executable, "-m", "cohort.cli", "doctor", *fixed, "algo.btea=0.1"],
        capture_output=True,
        text=True,
    )
    assert (
        typo.returncode == 1
        and "PROBLEM: unknown config key 'algo.btea'; did you mean 'algo.beta'?" in typo.stdout
    )
    ok = subprocess.run(
        [sys.executable, "-m", "cohort.cli", "doctor", *fixed, "rollout.max_completion_length=6"],
        capture_output=True,
        text=True,
    )
    assert ok.returncode == 0 and "ready to train" in ok.stdout, ok.stdout + ok.stderr


def test_the_demos_config_passes(tmp_path):
    from cohort.commands.demo import DEMO_MODEL, demo_config
    from cohort.models import build_tiny_model

    model = build_tiny_model(tmp_path / "demo-model", seed=0, **DEMO_MODEL)
    rep = rehearse(demo_config(tmp_path / "run", model, steps=None, seed=0), groups=2)
    assert rep.blocking == [], rep.lines
    assert "16 prompts per step x G=8 = 128 completions" in "\n".join(rep.lines)


def _complement(completions, **kwargs):
    return [1.0 - float(i % 2) for i in range(len(completions))]  # _position + this = 1 everywhere


def _position(completions, **kwargs):
    return [float(i % 2) for i in range(len(completions))]  # differs inside every group


def test_all_equal_groups_are_judged_per_reward_under_gdpo(tiny_model_dir, tmp_path):
    # The weighted sum is 1 everywhere, but under decoupled (GDPO) normalisation each varying reward column
    # gives the group an advantage: training judges groups per column, and so does the doctor.
    cfg = _cfg(tiny_model_dir, tmp_path / "g", **{"algo.reward_mode": "decoupled"})
    rep = rehearse(cfg, groups=2, reward_funcs=[_position, _complement])
    text = "\n".join(rep.lines)
    assert "0% with all-equal rewards" in text, text


def test_the_step_estimate_times_a_small_step_whole_and_extrapolates_a_large_one_along_a_line(monkeypatch):
    """A step costs a fixed part plus a part per group; scaling 4 groups' time by prompts_per_step multiplied the
    fixed part too (24 s estimated for a 1.2 s step of 128 groups on the tiny model)."""
    from types import SimpleNamespace

    from cohort.commands import doctor

    clock, drawn = [0.0], []

    def draw(n, step):
        drawn.append(n)
        clock[0] += 0.5 + 0.01 * n  # 0.5 s a step whatever its size, 10 ms a group
        return SimpleNamespace(per_func=None, reward=None, rollout=None)

    monkeypatch.setattr(doctor.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(doctor, "outcome_advantages", lambda *a: None)
    monkeypatch.setattr(doctor, "_policy_batch", lambda *a: None)
    trainer = SimpleNamespace(
        train_rows=[{}] * 1000,
        drawer=SimpleNamespace(draw=draw),
        updater=SimpleNamespace(update=lambda *a: None),
        shuffle_generator=None,
        reward_weights=None,
    )
    seconds, how = doctor._time_steps(trainer, 4, 12, algo=None)
    assert drawn == [12] and seconds == pytest.approx(0.62) and "measured" in how
    drawn.clear()
    seconds, how = doctor._time_steps(trainer, 4, 128, algo=None)
    assert drawn == [4, 16] and seconds == pytest.approx(0.5 + 0.01 * 128) and "extrapolated" in how
    trainer.train_rows = [{}] * 4  # nothing larger to time: scaled from what was
    drawn.clear()
    seconds, how = doctor._time_steps(trainer, 4, 128, algo=None)
    assert drawn == [4] and seconds == pytest.approx(0.54 * 32) and "scaled" in how
