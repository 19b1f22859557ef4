"""`cohort demo` end to end, shortened: the pipeline runs, GRPO improves on the warm start, no health check
fires on this healthy run, and the report is written."""

from __future__ import annotations

import json
import warnings

import pytest

from cohort.demo import run_demo

pytestmark = pytest.mark.slow


def test_the_demo_runs_end_to_end_and_is_healthy(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        summary = run_demo(tmp_path / "demo", steps=300, seed=0, progress=False)
    fired = [str(w.message) for w in caught if "health check" in str(w.message)]
    assert fired == []
    assert summary["accuracy_before"] is not None and summary["accuracy_after"] is not None
    assert summary["accuracy_after"] > summary["accuracy_before"], summary
    assert (tmp_path / "demo" / "health.jsonl").read_text() == ""
    page = (tmp_path / "demo" / "report.html").read_text()
    assert "No health check fired" in page and "<h2>Samples</h2>" in page
    saved = json.loads((tmp_path / "demo" / "summary.json").read_text())
    assert saved["grpo_steps"] == 300 and saved["sft_steps"] > 0
