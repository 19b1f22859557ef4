"""benchmarks/ablation/run.py end to end on a tiny setting: two variants, one seed, 4 steps from the tests' tiny
model as the warm start; the page, its figures and results.json are written, and a re-issued command skips the
finished runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ["grpo", "dapo (the demo)"]


def ablation(tmp_path: Path, model: Path) -> subprocess.CompletedProcess:
    """Returns the finished harness process run on the tiny setting into tmp_path."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "ablation" / "run.py"), "--out", str(tmp_path / "out")]
    cmd += ["--steps", "4", "--eval-every", "2", "--seeds", "0", "--variants", *VARIANTS]
    cmd += ["--warm-start", str(model), "--threads", "1", "--page", str(tmp_path / "docs" / "ablation.md")]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_the_ablation_harness_writes_results_page_and_figures_and_resumes(tmp_path, tiny_model_dir):
    import matplotlib.image

    proc = ablation(tmp_path, tiny_model_dir)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    runs = results["runs"]
    assert sorted(r["variant"] for r in runs) == sorted(VARIANTS)
    for r in runs:
        assert "failed" not in r, r
        assert [p["step"] for p in r["curve"]] == [0, 2, 4]
        accuracies = [p["accuracy"] for p in r["curve"]] + [r["final"], r["best"]]
        assert all(0.0 <= a <= 1.0 for a in accuracies), r
        seconds = [p["seconds"] for p in r["curve"]]
        assert seconds[0] == 0.0 and seconds == sorted(seconds) and seconds[-1] > 0
        assert r["s_per_step"] > 0
    page = (tmp_path / "docs" / "ablation.md").read_text()
    assert "| grpo |" in page and "| dapo (the demo) |" in page
    figures = sorted((tmp_path / "docs" / "img").glob("ablation_*.png"))
    assert figures and all(f"img/{f.name}" in page for f in figures)
    for f in figures:
        image = matplotlib.image.imread(f)
        assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
    # Hand-written prose below the marker survives a redraw; the finished runs are not trained again.
    (tmp_path / "docs" / "ablation.md").write_text(page + "\nprose by hand\n")
    again = ablation(tmp_path, tiny_model_dir)
    assert again.returncode == 0, again.stdout + again.stderr
    assert again.stdout.count("already finished, skipped") == 2, again.stdout
    assert (tmp_path / "docs" / "ablation.md").read_text().endswith("\nprose by hand\n")
