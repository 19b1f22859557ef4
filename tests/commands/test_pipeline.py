"""`cohort pipeline`: the R1 stages from one file, end to end on the built-in task; a killed stage resumes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import yaml

from cohort.commands.pipeline import load_pipeline
from cohort.errors import ConfigError, TrainingError

pytestmark = pytest.mark.slow

GRPO = {
    "data.task": "addition",
    "data.n_train": 64,
    "data.n_eval": 8,
    "rollout.group_size": 4,
    "rollout.batch_size": 8,
    "rollout.max_completion_length": 6,
    "optim.lr": 1e-3,
    "progress": False,
    "eval_at_ends": False,
    "threads": 1,
}


def _write(tmp_path, model, *, last_steps=3, **extra_stage):
    spec = {
        "out_dir": str(tmp_path / "run"),
        "model": str(model),
        "stages": [
            {
                "name": "cold_start",
                "command": "sft",
                "args": {"task": "addition", "steps": 10, "lr": 3e-3, "n": 64},
            },
            {"name": "grpo", "command": "train", "args": {**GRPO, "steps": 2}},
            {
                "name": "reject",
                "command": "sample",
                "args": {"task": "addition", "k": 4, "threshold": 0.0, "n": 16, "max_completion_length": 6},
            },
            {"name": "sft_again", "command": "sft", "args": {"data": "@reject", "steps": 5, "lr": 1e-3}},
            {
                "name": "grpo_again",
                "command": "train",
                "args": {**GRPO, "steps": last_steps, "save_every": 1},
            },
            *([extra_stage] if extra_stage else []),
        ],
    }
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def _stand_in(pipeline, *, sample: str, ran: list[str] | None = None):
    """Returns a stand-in for running a stage's command: it writes the stage's output (a model folder, or a sample
    file holding `sample`) and trains nothing; `pipeline()` gives the pipeline as it is now."""

    def run(argv: list[str]) -> int:
        out = argv[argv.index("--out") + 1] if "--out" in argv else None
        stage = next(s for s in pipeline().stages if str(s.output) == out or f"out_dir={s.folder}" in argv)
        if ran is not None:
            ran.append(stage.name)
        stage.output.parent.mkdir(parents=True, exist_ok=True)
        if stage.command == "sample":
            stage.output.write_text(sample)
        else:
            stage.output.mkdir(exist_ok=True)
        return 0

    return run


def _run(path) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "cohort.cli", "pipeline", str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def test_five_stages_run_end_to_end_and_a_killed_stage_resumes(tiny_model_dir, tmp_path):
    path = _write(tmp_path, tiny_model_dir, last_steps=30)
    run = tmp_path / "run"
    proc = _run(path)
    deadline = time.time() + 240
    checkpoints = run / "4-grpo_again" / "checkpoints"
    # Kill as soon as the last stage has saved a checkpoint (older ones are pruned: look for any).
    while time.time() < deadline and not (checkpoints.is_dir() and any(checkpoints.glob("step-*"))):
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)  # in the middle of the last stage
    proc.communicate()
    assert not (run / "4-grpo_again" / "done.json").exists()
    again = _run(path)
    out, err = again.communicate(timeout=240)
    assert again.returncode == 0, err[-3000:]
    for name in ("cold_start", "grpo", "reject", "sft_again"):
        assert f"{name}: done earlier, skipped" in out
    steps = [json.loads(x)["step"] for x in (run / "4-grpo_again" / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 31))  # resumed, each step once
    summary = json.loads((run / "summary.json").read_text())
    assert summary["reject"]["accepted"] == 16 and summary["grpo_again"]["steps"] == 30
    assert (run / "3-sft_again" / "model" / "config.json").is_file()
    page = (run / "pipeline.html").read_text()
    assert "<h2>Stages</h2>" in page and "grpo_again" in page and "<img " in page


def test_a_missing_base_model_is_refused_before_anything_runs(tmp_path):
    with pytest.raises(ConfigError, match="pipeline model: .*nope' does not exist"):
        load_pipeline(_write(tmp_path, tmp_path / "nope"))


@pytest.mark.parametrize(
    ("stage", "fragment"),
    [
        ({"name": "x", "command": "deploy", "args": {}}, "command 'deploy' is not one of sft, train, sample"),
        ({"name": "x", "command": "sft", "args": {"data": "@later"}}, "'@later' names no earlier stage"),
        (
            {"name": "x", "command": "sft", "args": {"task": "addition", "stepz": 3}},
            "unrecognized arguments: --stepz",
        ),
        ({"name": "x", "command": "train", "args": {"algo.betta": 0.1}}, "unknown config key 'algo.betta'"),
        (
            {"name": "x", "command": "train", "args": {"out_dir": "elsewhere"}},
            "out_dir is set by the pipeline",
        ),
        ({"name": "grpo", "command": "sft", "args": {"task": "addition"}}, "two stages are called 'grpo'"),
        (
            {"name": "x", "command": "sample", "args": {"k": 2}},
            "give args task (addition, multistep, code, multiply) or data",
        ),
    ],
)
def test_every_stage_is_checked_before_anything_runs(tiny_model_dir, tmp_path, stage, fragment):
    path = _write(tmp_path, tiny_model_dir, **stage)
    with pytest.raises(ConfigError) as e:
        load_pipeline(path)
    assert fragment in str(e.value), str(e.value)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        (
            "out_dir: !!python/object/apply:os.system ['touch {marker}']\n",
            "could not determine a constructor",
        ),
        ("out_dir: run\nout_dir: again\n", "key 'out_dir' is given twice (first on line 1)"),
        ("stages: [1\n", "is not valid YAML: while parsing a flow sequence"),
    ],
)
def test_a_pipeline_file_is_data_and_its_problems_are_one_line(tmp_path, text, fragment, capsys):
    from cohort.cli import main

    marker = tmp_path / "pwned"
    path = tmp_path / "p.yaml"
    path.write_text(text.format(marker=marker))
    assert main(["pipeline", str(path)]) != 0
    err = capsys.readouterr().err.strip()
    assert "pipeline file" in err and fragment in err and "\n" not in err and "Traceback" not in err, err
    assert not marker.exists()
    # The same file given to `cohort train` fails the same way, in one line.
    assert main(["train", str(path)]) != 0
    assert fragment in capsys.readouterr().err


def test_a_second_pipeline_on_the_same_folder_stops_before_any_stage(tiny_model_dir, tmp_path, capsys):
    from cohort.cli import main
    from cohort.runtime.rundir import RunLock

    path = _write(tmp_path, tiny_model_dir)
    holder = RunLock(tmp_path / "run").acquire()  # the first pipeline, still running
    try:
        assert main(["pipeline", str(path)]) == 1
    finally:
        holder.release()
    assert "is in use by another cohort run" in capsys.readouterr().err
    assert not any(p.is_dir() for p in (tmp_path / "run").iterdir())  # no stage started


def test_a_sample_stage_that_accepts_nothing_stops_the_pipeline_and_runs_again(tiny_model_dir, tmp_path):
    """Marked done, an empty sample would fail the stage that reads it at every run, with the sample skipped; so
    the pipeline stops at the sample, and the next run takes it again."""
    from cohort.commands import pipeline

    pipe = load_pipeline(_write(tmp_path, tiny_model_dir))
    ran: list[str] = []
    run = _stand_in(lambda: pipe, sample="", ran=ran)  # an empty sample

    with pytest.raises(
        TrainingError, match=r"stage 'reject' accepted no completion .*stage 'sft_again' trains on"
    ):
        pipeline.run_pipeline(pipe, run=run, write=lambda line: None)
    assert ran == ["cold_start", "grpo", "reject"] and not (pipe.stages[2].folder / "done.json").exists()
    ran.clear()
    with pytest.raises(TrainingError):
        pipeline.run_pipeline(pipe, run=run, write=lambda line: None)
    assert ran == ["reject"]  # the stages before it are done; this one runs again


def test_a_failed_stage_is_a_training_error_naming_it(tiny_model_dir, tmp_path):
    """A TrainingError, which the command prints as one line (exit code 1), where a RuntimeError's traceback was."""
    from cohort.commands import pipeline

    pipe = load_pipeline(_write(tmp_path, tiny_model_dir))
    with pytest.raises(
        TrainingError,
        match=r"stage 'cold_start' failed \(exit code 2, its error above\); .*finished stages are skipped",
    ):
        pipeline.run_pipeline(pipe, run=lambda argv: 2, write=lambda line: None)


def test_a_finished_stage_given_other_arguments_is_refused_not_skipped(tiny_model_dir, tmp_path):
    """The grpo stage's steps changed from 2 to 8 in the file: it was 'done earlier, skipped', the change ignored."""
    from cohort.commands import pipeline

    run = _stand_in(
        lambda: load_pipeline(tmp_path / "pipeline.yaml"), sample='{"prompt": "1+1=", "completion": "2"}\n'
    )
    pipeline.run_pipeline(load_pipeline(_write(tmp_path, tiny_model_dir)), run=run, write=lambda line: None)
    lines: list[str] = []
    pipeline.run_pipeline(load_pipeline(tmp_path / "pipeline.yaml"), run=run, write=lines.append)
    assert all("done earlier, skipped" in line for line in lines if "[" in line)  # unchanged: all skipped
    spec = yaml.safe_load((tmp_path / "pipeline.yaml").read_text())
    spec["stages"][1]["args"]["steps"] = 8
    (tmp_path / "pipeline.yaml").write_text(yaml.safe_dump(spec))
    with pytest.raises(
        ConfigError,
        match=r"stage 'grpo' finished earlier with other arguments \(then: steps=2; now: steps=8\)",
    ) as e:
        pipeline.run_pipeline(load_pipeline(tmp_path / "pipeline.yaml"), run=run, write=lambda line: None)
    assert "1-grpo" in str(e.value) and "4-grpo_again" in str(e.value)
