"""cohort.report: plain progress lines, evaluation lines, the transformers bar switch, the TensorBoard and W&B
sample sinks, summary.json and its place in report.html."""

from __future__ import annotations

import json
import re
import sys
import types

import pytest

from cohort.report import (
    MetricsLogger,
    Progress,
    eval_line,
    quiet_hf_progress,
    samples_markdown,
    write_report,
    write_summary,
)
from cohort.update import UpdateStats

LINE = re.compile(
    r"^step (\d+)/(\d+) \| reward \S+( \| kl \S+)?( \| length \S+)? \| \S+ s/step \| ETA \d+:\d\d:\d\d$"
)


def _metrics(step: int, kl: float | None = 0.01) -> dict:
    return {"step": step, "reward": 0.5, "kl": kl, "completions/mean_length": 7.0, "step_time": 0.1}


def test_plain_lines_every_logging_steps_and_at_the_last_step(capsys):
    progress = Progress(5, logging_steps=2, interactive=False)
    for step in range(1, 6):
        progress.update(step, _metrics(step))
    progress.close()
    lines = capsys.readouterr().out.splitlines()
    assert [LINE.match(x).group(1) for x in lines] == ["2", "4", "5"], lines  # type: ignore[union-attr]
    assert "kl 0.01" in lines[0] and "length 7" in lines[0] and "reward 0.5" in lines[0]


def test_plain_line_leaves_kl_out_at_beta_zero(capsys):
    progress = Progress(2, logging_steps=1, interactive=False)
    progress.update(1, _metrics(1, kl=None))
    line = capsys.readouterr().out.strip()
    assert LINE.match(line) and "kl" not in line


def test_resumed_progress_counts_from_its_start(capsys):
    progress = Progress(10, start=6, logging_steps=4, interactive=False)
    for step in range(7, 11):
        progress.update(step, _metrics(step))
    assert [x.split()[1] for x in capsys.readouterr().out.splitlines()] == ["8/10", "10/10"]


def test_disabled_progress_prints_nothing(capsys):
    for interactive in (False, True):
        progress = Progress(3, logging_steps=1, enabled=False, interactive=interactive)
        progress.update(1, _metrics(1))
        progress.evaluated(1, {"accuracy": 0.5, "n": 4.0})
        progress.close()
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("interactive", [False, True])
def test_evaluations_are_printed_in_both_modes(capsys, interactive):
    progress = Progress(4, logging_steps=10, interactive=interactive)
    progress.evaluated(0, {"accuracy": 0.25, "n": 8.0, "mean_length": 3.0})
    progress.update(2, _metrics(2))
    progress.evaluated(2, {"accuracy": 0.5, "pass@4": 0.75, "maj@4": 0.625, "n": 8.0})
    progress.close()
    out = capsys.readouterr().out
    assert "eval step 0 | accuracy 25.0% | 8 prompts" in out
    assert "eval step 2 | accuracy 50.0% | pass@4 75.0% | maj@4 62.5% | 8 prompts" in out


def test_eval_line_without_a_count():
    assert eval_line(3, {"accuracy": None}) == "eval step 3 | accuracy -"


def test_quiet_hf_progress_switches_bars_off_and_restores_them():
    from transformers.utils import logging as hf_logging

    before = hf_logging.is_progress_bar_enabled()
    try:
        hf_logging.enable_progress_bar()
        with quiet_hf_progress():
            assert not hf_logging.is_progress_bar_enabled()
            with quiet_hf_progress():  # nested: the inner one restores "off"
                pass
            assert not hf_logging.is_progress_bar_enabled()
        assert hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()
        with quiet_hf_progress():
            pass
        assert not hf_logging.is_progress_bar_enabled()  # a user's "off" stays off
    finally:
        (hf_logging.enable_progress_bar if before else hf_logging.disable_progress_bar)()


SAMPLES = [
    {"prompt": "1+1=", "completion": "2 | done\nok", "reward": 1.0, "digits": 1},
    {"prompt": "2+2=", "completion": "5", "reward": 0.0},
]


def test_samples_markdown_escapes_cells():
    text = samples_markdown(SAMPLES, ["prompt", "completion", "reward", "digits"])
    lines = text.splitlines()
    assert lines[0] == "| prompt | completion | reward | digits |"
    assert lines[2] == "| 1+1= | 2 \\| done<br>ok | 1 | 1 |"
    assert lines[3] == "| 2+2= | 5 | 0 | - |"


def test_tensorboard_gets_the_samples_as_text(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = MetricsLogger(tmp_path, tensorboard=True)
    logger.log({"step": 1, "reward": 0.5})
    logger.log_samples(1, SAMPLES)
    logger.log_samples(2, SAMPLES[1:])
    logger.log_samples(3, [])  # nothing to show: no entry
    logger.close()
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"tensors": 0})
    acc.Reload()
    tag = next(t for t in acc.Tags()["tensors"] if t.startswith("completions"))
    events = acc.Tensors(tag)
    assert [e.step for e in events] == [1, 2]
    first = events[0].tensor_proto.string_val[0].decode()
    assert (
        "1+1=" in first and "2+2=" in first and first.startswith("| prompt | completion | reward | digits |")
    )
    assert len(read_lines(tmp_path / "samples.jsonl")) == 3


def read_lines(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


class _FakeWandb(types.ModuleType):
    """The part of wandb's public API the logger uses: init() → run with log() / finish(), and Table."""

    def __init__(self) -> None:
        super().__init__("wandb")
        self.inits: list[dict] = []
        self.logged: list[tuple[dict, int]] = []
        self.finished = False
        fake = self

        class Table:
            def __init__(self, columns, data):
                self.columns, self.data = columns, data

        class Run:
            def log(self, values, step=None):
                fake.logged.append((values, step))

            def finish(self):
                fake.finished = True

        self.Table = Table
        self._run = Run()

    def init(self, **kwargs):
        self.inits.append(kwargs)
        return self._run


def test_wandb_run_is_named_after_the_out_dir_and_gets_a_completions_table(tmp_path, monkeypatch):
    fake = _FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    run_dir = tmp_path / "my-run"
    logger = MetricsLogger(run_dir, wandb=True, wandb_project="proj", config={"seed": 3})
    logger.log({"step": 1, "reward": 0.5, "kl": None})
    logger.log_samples(1, SAMPLES)
    logger.log_eval(1, {"accuracy": 0.5})
    logger.close()
    assert fake.inits == [{"project": "proj", "name": "my-run", "dir": str(run_dir), "config": {"seed": 3}}]
    tables = [(v["completions"], step) for v, step in fake.logged if "completions" in v]
    assert len(tables) == 1 and tables[0][1] == 1
    table = tables[0][0]
    assert table.columns == ["prompt", "completion", "reward", "digits"]
    assert table.data == [["1+1=", "2 | done\nok", 1.0, 1], ["2+2=", "5", 0.0, None]]
    assert ({"reward": 0.5, "kl": None}, 1) in fake.logged and ({"eval/accuracy": 0.5}, 1) in fake.logged
    assert fake.finished


def test_summary_json_is_json_safe_and_shown_in_the_report(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward": 0.5}) + "\n")
    summary = {
        "start_step": 0,
        "steps": 1,
        "accuracy_after": float("nan"),
        "final_metrics": {"reward": 0.5, "loss": 0.25},
        "path": tmp_path,
    }
    path = write_summary(tmp_path, summary)
    saved = json.loads(path.read_text())
    assert saved == {
        "start_step": 0,
        "steps": 1,
        "accuracy_after": None,
        "final_metrics": {"reward": 0.5, "loss": 0.25},
        "path": str(tmp_path),
    }
    page = write_report(tmp_path).read_text()
    assert "<h2>Summary</h2>" in page and "reward 0.5, loss 0.25" in page


def test_update_stats_emit_the_clip_extremes():
    stats = UpdateStats(clip_ratio={"low_mean": 0.1, "high_mean": 0.2, "low_min": 0.05, "high_max": 0.4})
    m = stats.metrics()
    assert m["clip_ratio/low_min"] == 0.05 and m["clip_ratio/high_max"] == 0.4
    assert UpdateStats().metrics()["clip_ratio/low_min"] == 0.0
