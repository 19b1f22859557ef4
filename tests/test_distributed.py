"""Two processes under torchrun (gloo, CPU) make the same update as one process on both batches."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

REWARD = str(Path(__file__).parent / "digit_reward.py") + ":digit_fraction"
PARITY = str(Path(__file__).parent / "digit_reward.py") + ":first_char_parity"


def _torchrun(model_dir: Path, out: Path, port: int, *overrides: str) -> list[dict]:
    """Returns metrics.jsonl's rows after `cohort train` on two processes (a small run on the tiny model)."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(port),
        "-m",
        "cohort.cli",
        "train",
        f"model.name_or_path={model_dir}",
        "data.task=addition",
        "data.n_train=64",
        "data.n_eval=8",
        "rollout.group_size=4",
        "rollout.batch_size=8",
        "rollout.max_completion_length=5",
        "optim.lr=1e-3",
        "save_every=0",
        "progress=false",
        "eval_at_ends=false",
        "threads=1",
        f"out_dir={out}",
        *overrides,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_torchrun_two_processes(tiny_model_dir, tmp_path):
    out = tmp_path / "ddp"
    rows = _torchrun(tiny_model_dir, out, 29533, f"rewards=['{REWARD}']", "steps=3")
    assert [r["step"] for r in rows] == [1, 2, 3]  # only rank 0 writes
    # num_tokens counts both processes' tokens
    assert rows[0]["num_tokens"] > 0
    final = load_file(str(out / "final" / "model.safetensors"))
    start = load_file(str(Path(tiny_model_dir) / "model.safetensors"))
    assert any(not (final[k] == start[k]).all() for k in final)


@pytest.mark.slow
def test_bnpo_and_dapo_take_the_same_step_over_two_processes_with_equal_lengths(tiny_model_dir, tmp_path):
    # The random tiny model never emits EOS: every completion has 5 tokens, so the per-process token mean
    # (bnpo) and the global one (dapo) are the same loss, and must give the same gradient. Summing the
    # per-process means used to give bnpo twice dapo's gradient norm with two processes.
    norms = {}
    for loss_type, port in (("bnpo", 29541), ("dapo", 29542)):
        overrides = (f"rewards=['{PARITY}']", f"algo.loss_type={loss_type}", "steps=1")
        row = _torchrun(tiny_model_dir, tmp_path / loss_type, port, *overrides)[0]
        assert row["completions/min_length"] == row["completions/max_length"] == 5
        norms[loss_type] = row["grad_norm"]
    assert norms["bnpo"] > 0
    assert norms["bnpo"] == pytest.approx(norms["dapo"], rel=1e-5), norms
