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


def test_the_code_task_runs_get_the_code_recipe_and_the_demo_keeps_its_own(tmp_path):
    """--task code writes each run from examples/code_task.py's grpo_config plus COMMON and the variant;
    the default task is the demo's, and the 2026 group holds otb."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.ablation.run import GROUPS, harness_command, parse_args, write_run_config
    from cohort.config import load_config

    assert "otb" in GROUPS["2026"]
    args = parse_args(["--out", str(tmp_path), "--task", "code", "--steps", "6", "--eval-every", "3"])
    args.variants, args.threads = ["otb"], 1
    cfg = load_config(write_run_config(tmp_path, tmp_path / "warm", "otb", 1, args))
    assert (cfg.data.task, cfg.rewards, cfg.rollout.max_completion_length) == ("code", ["code"], 40)
    assert (cfg.rollout.group_size, cfg.rollout.batch_size, cfg.algo.loss_type) == (8, 64, "dapo")
    assert (cfg.algo.num_minibatches, cfg.algo.advantage) == (4, "optimal_token_baseline")
    assert (cfg.steps, cfg.eval_every, cfg.seed, cfg.optim.lr) == (6, 3, 1, 2e-4)
    assert "--task code" in harness_command(args)
    demo = parse_args(["--out", str(tmp_path / "demo"), "--variants", "grpo", "--threads", "1"])
    assert demo.task == "demo" and "--task" not in harness_command(demo)
    cfg = load_config(write_run_config(tmp_path / "demo", tmp_path / "warm", "grpo", 0, demo))
    assert (cfg.data.task, cfg.algo.loss_type, cfg.algo.num_minibatches) == ("addition", "grpo", 4)


def test_the_page_names_the_code_task(tmp_path):
    """A results.json whose settings say task code gives a page about the code task (no runs yet)."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.ablation.page import write_page

    out = tmp_path / "out"
    out.mkdir()
    settings = {"task": "code", "steps": 6, "eval_every": 3, "seeds": [0], "variants": ["otb"]}
    (out / "results.json").write_text(json.dumps({"settings": settings, "warm_start": {}, "runs": []}))
    write_page(tmp_path / "page.md", out)
    page = (tmp_path / "page.md").read_text()
    assert page.startswith("# Ablation: the GRPO family on the code task")
    assert "the code task's GRPO recipe" in page and "pass rate" in page and "DEMO_GRPO" not in page
    assert "--task code" in page
    assert "Not run (or not finished) yet: otb (seed 0)" in page
