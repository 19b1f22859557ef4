"""Two processes under torchrun (gloo, CPU) make the same update as one process on both batches."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

REWARD = str(Path(__file__).parent / "digit_reward.py") + ":digit_fraction"


@pytest.mark.slow
def test_torchrun_two_processes(tiny_model_dir, tmp_path):
    out = tmp_path / "ddp"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        "29533",
        "-m",
        "cohort.cli",
        "train",
        f"model.name_or_path={tiny_model_dir}",
        "data.task=addition",
        "data.n_train=64",
        "data.n_eval=8",
        "rollout.group_size=4",
        "rollout.batch_size=8",
        "rollout.max_completion_length=5",
        f"rewards=['{REWARD}']",
        "optim.lr=1e-3",
        "steps=3",
        "save_every=0",
        "progress=false",
        "eval_at_ends=false",
        "threads=1",
        f"out_dir={out}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]  # only rank 0 writes
    # num_tokens counts both processes' tokens
    assert rows[0]["num_tokens"] > 0
    final = load_file(str(out / "final" / "model.safetensors"))
    start = load_file(str(Path(tiny_model_dir) / "model.safetensors"))
    assert any(not (final[k] == start[k]).all() for k in final)
