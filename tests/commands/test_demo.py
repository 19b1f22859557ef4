"""`cohort demo` end to end, shortened: the pipeline runs, no health check fires on this healthy run, its numbers
are reported and the report is written.

What 300 GRPO steps do to held-out accuracy is not asserted: on 200 problems it moved 0.34 -> 0.32 on an AVX2-only
CPU and rose on others (float kernels differ, so the sampled completions do), which is noise at that length. The
demo's learning is measured at its full length (README, docs/usage.md); the suite's learning checks use tasks
that learn with a margin on any CPU (tests/test_cli_e2e.py::test_train_cli_learns_an_easy_reward)."""

from __future__ import annotations

import json
import warnings

import pytest

from cohort.commands.demo import run_demo

pytestmark = pytest.mark.slow


def test_the_demo_runs_end_to_end_and_is_healthy(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        summary = run_demo(tmp_path / "demo", steps=300, seed=0, progress=False)
    fired = [str(w.message) for w in caught if "health check" in str(w.message)]
    assert fired == []
    for key in ("accuracy_before", "accuracy_after"):
        assert 0.0 <= summary[key] <= 1.0, summary  # measured and reported, whatever the CPU made of it
    assert (tmp_path / "demo" / "health.jsonl").read_text() == ""
    page = (tmp_path / "demo" / "report.html").read_text()
    assert "No health check fired" in page and "<h2>Samples</h2>" in page
    saved = json.loads((tmp_path / "demo" / "summary.json").read_text())
    assert saved["grpo_steps"] == 300 and saved["sft_steps"] > 0
    assert saved["accuracy_before"] == summary["accuracy_before"]
    assert saved["accuracy_after"] == summary["accuracy_after"]
