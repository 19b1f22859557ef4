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
from cohort.train.update import UpdateStats

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
    assert "<h2>Summary</h2>" in page
    assert "<th>last step: loss</th><td class='num'>0.25</td>" in page


def test_update_stats_emit_the_clip_extremes():
    stats = UpdateStats(clip_ratio={"low_mean": 0.1, "high_mean": 0.2, "low_min": 0.05, "high_max": 0.4})
    m = stats.metrics()
    assert m["clip_ratio/low_min"] == 0.05 and m["clip_ratio/high_max"] == 0.4
    assert UpdateStats().metrics()["clip_ratio/low_min"] == 0.0


# ------------------------------------------------------------------ report.html: curves, samples, comparison


def test_ema_is_bias_corrected_and_span_one_is_the_identity():
    from cohort.report.plots import ema, smoothing_span

    assert ema([1.0, 2.0, 3.0], 1) == [1.0, 2.0, 3.0]
    # span 3: decay 0.5. acc: 0.5, 1.25 / norm: 0.5, 0.75 -> 1.0, 1.25 / 0.75 = 5/3
    assert ema([1.0, 2.0], 3) == pytest.approx([1.0, 5 / 3])
    assert ema([4.0] * 50, 9) == pytest.approx([4.0] * 50)  # a constant stays put from the first point
    assert smoothing_span(10) == 1 and smoothing_span(400) == 10 and smoothing_span(3000) == 75


def _rows(steps, **cols):
    return [{"step": s, **{k: (v(s) if callable(v) else v) for k, v in cols.items()}} for s in steps]


def _fake_run(path, *, n=60, functions=("accuracy", "format"), kl=True, lr=1e-3, samples=True):
    path.mkdir(parents=True, exist_ok=True)
    cols = {
        "reward": lambda s: s / n,
        "reward_std": 0.3,
        "frac_reward_zero_std": lambda s: 1 - s / n,
        "completions/mean_length": 10.0,
        "completions/min_length": 4.0,
        "completions/max_length": 16.0,
        "completions/clipped_ratio": 0.1,
        "clip_ratio/region_mean": 0.0,
        "clip_ratio/low_mean": 0.0,
        "clip_ratio/high_mean": 0.0,
        "entropy": 1.0,
        "loss": 0.01,
        "grad_norm": 0.5,
        "lr": lr,
        "step_time": 0.1,
        "time/generate": 0.05,
        "time/update": 0.04,
    }
    if kl:
        cols["kl"] = 0.01
    for f in functions:
        cols[f"rewards/{f}/mean"] = 0.5
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rows(range(1, n + 1), **cols)))
    (path / "evals.jsonl").write_text(
        "".join(json.dumps({"step": s, "accuracy": s / n, "n": 16}) + "\n" for s in (0, n // 2, n))
    )
    (path / "config.yaml").write_text(f"steps: {n}\noptim:\n  lr: {lr}\nrollout:\n  group_size: 4\n")
    if samples:
        rows = []
        for s in range(1, n + 1):
            for i in range(4):
                rows.append(
                    {
                        "step": s,
                        "group": 0,
                        "prompt": f"prompt of step {s} <b>",
                        "completion": f"answer {i}",
                        "reward": float(i % 2),
                        **{f"rewards/{f}": float(i % 2) for f in functions},
                        "advantage": float(i % 2) - 0.5,
                        "in_loss": True,
                        "length": 3,
                        "truncated": i == 3,
                    }
                )
        (path / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_the_report_has_a_chart_per_metric_with_labels_and_the_samples_grouped_by_prompt(tmp_path):
    from cohort.report import build_panels, load_run

    run = _fake_run(tmp_path / "run")
    titles = [p.title for p in build_panels([load_run(run)])]
    for expected in (
        "Reward",
        "Reward: accuracy",
        "Reward: format",
        "Reward spread within groups",
        "Groups with equal rewards",
        "Held-out accuracy",
        "KL to the reference",
        "Completion length",
        "Clipped tokens",
        "Gradient norm",
        "Learning rate",
    ):
        assert expected in titles, titles
    panels = {p.title: p for p in build_panels([load_run(run)])}
    assert all(p.y_label for p in panels.values())
    length = panels["Completion length"]
    assert length.bands and length.bands[0].low[0] == 4.0 and length.bands[0].high[0] == 16.0
    assert any(s.right_axis and s.values[0] == 0.1 for s in length.series)  # the truncation rate
    assert "ratio is exactly 1" in panels["Clipped tokens"].note  # a flat 0 says why
    page = write_report(run).read_text()
    assert page.count("<img ") == len(panels)
    assert page.count("<div class='group'>") == 12  # spread over the run, latest included
    assert "<h3>step 60</h3>" in page and "<h3>step 1</h3>" in page
    assert "prompt of step 60 &lt;b&gt;" in page  # escaped
    assert "<th>accuracy</th><th>format</th><th>reward</th><th>advantage</th>" in page
    assert "class='num pos'>0.5<" in page and "6 (truncated)" not in page and "3 (truncated)" in page
    assert "<h2>Resolved config</h2>" in page and "group_size: 4" in page
    assert "exponential moving averages over about 2 steps" in page


def test_one_reward_function_has_no_separate_panel_and_beta_zero_says_so(tmp_path):
    from cohort.report import build_panels, load_run

    run = load_run(_fake_run(tmp_path / "one", functions=("accuracy",), kl=False, samples=False))
    panels = {p.title: p for p in build_panels([run])}
    assert "Reward: accuracy" not in panels
    assert not panels["KL to the reference"].series and "beta = 0" in panels["KL to the reference"].note
    page = write_report(run.path).read_text()
    assert "<b>KL to the reference</b>:&nbsp;beta = 0" in page and "<h2>Samples</h2>" not in page


def test_a_run_that_never_had_a_token_in_the_loss_says_so_where_it_said_nothing_logged_yet(tmp_path):
    from cohort.report import build_panels, load_run

    path = tmp_path / "flat"
    path.mkdir()
    # what the trainer logs when every group's rewards are equal: per-token values are null, no row computed
    rows = [
        {
            "step": s,
            "reward": 1.0,
            "frac_reward_zero_std": 1.0,
            "entropy": None,
            "kl": None,
            "rows_computed_frac": 0.0,
        }
        for s in (1, 2)
    ]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    panels = {p.title: p for p in build_panels([load_run(path)])}
    for title in ("Entropy", "KL to the reference"):
        assert not panels[title].series and "no token reached the loss" in panels[title].note, title
    assert "<b>Entropy</b>:&nbsp;not measured: at every logged step" in write_report(path).read_text()
    rows[1]["rows_computed_frac"], rows[1]["entropy"] = 0.5, 2.0  # one step trained: its entropy is drawn
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    panels = {p.title: p for p in build_panels([load_run(path)])}
    assert panels["Entropy"].series and not panels["Entropy"].note
    assert "beta = 0" in panels["KL to the reference"].note


def test_sample_groups_are_spread_over_the_run_and_old_rows_group_by_prompt():
    from cohort.report import sample_groups

    rows = [
        {"step": s, "group": g, "prompt": f"p{s}{g}"} for s in range(1, 11) for g in (0, 1) for _ in range(3)
    ]
    chosen = sample_groups(rows, 4)
    assert [(s, p) for s, p, _ in chosen] == [(1, "p10"), (4, "p40"), (7, "p71"), (10, "p101")]
    assert all(len(r) == 3 for _, _, r in chosen)
    old = [{"step": 1, "prompt": "a"}, {"step": 1, "prompt": "a"}, {"step": 1, "prompt": "b"}]
    assert [(p, len(r)) for _, p, r in sample_groups(old, 5)] == [("a", 2), ("b", 1)]
    assert sample_groups(rows, 0) == []


def test_a_comparison_overlays_the_runs_and_lists_their_config_differences(tmp_path):
    from cohort.report import write_comparison

    a = _fake_run(tmp_path / "a", lr=1e-3)
    b = _fake_run(tmp_path / "b", lr=3e-3, n=40, functions=("accuracy",))
    out = write_comparison([a, b], tmp_path / "cmp.html")
    page = out.read_text()
    assert "cohort runs: a vs b" in page
    assert "<tr><th>optim.lr</th><td>0.001</td><td>0.003</td></tr>" in page
    assert "<tr><th>steps</th><td>60</td><td>40</td></tr>" in page
    assert "group_size" not in page.split("Config differences")[1]  # the same in both: not listed
    assert page.count("<img ") >= 10
    assert write_comparison([a, b], tmp_path).name == "compare.html"  # a folder gets the default name
    with pytest.raises(ValueError, match="at least two run directories"):
        write_comparison([a], tmp_path / "x.html")


def test_the_cli_compares_runs_and_refuses_bad_report_arguments(tmp_path, monkeypatch, capsys):
    from cohort.cli import main

    a, b = _fake_run(tmp_path / "x" / "run"), _fake_run(tmp_path / "y" / "run")
    monkeypatch.chdir(tmp_path)
    assert main(["report", str(a), str(b)]) == 0
    page = (tmp_path / "compare.html").read_text()
    assert str(a) in page and str(b) in page  # two runs called "run" are told apart by their paths
    assert main(["report", str(a), "--out", "x.html"]) == 2
    assert "--out is for comparing several runs" in capsys.readouterr().err
    assert main(["report", str(a), str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err
    # a missing folder for --out is made, and said to be (the path alone stays on standard output)
    assert main(["report", str(a), str(b), "--out", str(tmp_path / "new" / "cmp.html")]) == 0
    said = capsys.readouterr()
    assert said.out.strip() == str(tmp_path / "new" / "cmp.html")
    assert f"created the folder {tmp_path / 'new'}" in said.err


def test_the_report_shows_an_episode_turn_by_turn(tmp_path):
    turns = [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"name": "multiply", "arguments": {"a": 3, "b": 4}}],
        },
        {"role": "tool", "name": "multiply", "content": "12"},
        {"role": "assistant", "content": "The answer is <12>"},
        {"role": "user", "content": "correct"},
    ]
    row = {"step": 1, "group": 0, "prompt": "3*4?", "completion": "x", "reward": 1.0, "turns": turns}
    (tmp_path / "samples.jsonl").write_text(json.dumps(row) + "\n")
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward": 1.0}) + "\n")
    page = write_report(tmp_path).read_text()
    assert "→ multiply({&quot;a&quot;: 3, &quot;b&quot;: 4})" in page
    assert "tool result · multiply" in page and "<pre>12</pre>" in page
    assert "The answer is &lt;12&gt;" in page  # escaped like any completion
    assert "<div class='who'>environment</div><pre>correct</pre>" in page
