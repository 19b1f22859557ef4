"""Rollout workers that die or never answer: kill -9 of a worker mid-run (two workers: the run goes on with the
other and samples the same batch; one worker: the run stops with WorkersLostError, its logs and checkpoints
intact), and kill -9 of the trainer leaves no worker process behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from _serve_helpers import alive, run_config
from transformers import TrainerCallback

from cohort.serve.client import WorkersLostError
from cohort.trainer import GRPOTrainer


def _pids(trainer) -> list[int]:
    return [p.pid for p in trainer.remote.local.processes]


def test_a_killed_worker_hands_its_groups_to_the_other(tiny_model_dir, tmp_path):
    # Two workers split each batch into two chunks, each sampled from its own seed: after one worker is killed
    # the other serves both chunks, and the batch is the one the two would have sampled.
    runs = []
    for kill in (False, True):
        t = GRPOTrainer(run_config(tiny_model_dir, tmp_path / f"k{kill}", **{"rollout.workers": 2}))
        try:
            first = t.step().metrics
            if kill:
                os.kill(_pids(t)[0], signal.SIGKILL)
                with pytest.warns(UserWarning, match="rollout worker at 127.0.0.1:.* is lost"):
                    second = t.step().metrics
            else:
                second = t.step().metrics
            runs.append((first, second))
        finally:
            t.remote.close()
    (a1, a2), (b1, b2) = runs
    assert b2["serve/workers"] == 1.0 and a2["serve/workers"] == 2.0
    for key in ("reward", "completions/mean_length", "loss"):
        assert a1[key] == b1[key] and a2[key] == b2[key], key


class _KillWorkerAfterStep1(TrainerCallback):
    def __init__(self, pids):
        self.pids = pids

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 1:
            for pid in self.pids:
                os.kill(pid, signal.SIGKILL)


def test_losing_the_only_worker_stops_the_run_cleanly(tiny_model_dir, tmp_path):
    out = tmp_path / "lost"
    t = GRPOTrainer(run_config(tiny_model_dir, out, **{"rollout.workers": 1, "save_every": 1}))
    try:
        t.callbacks.callbacks.append(_KillWorkerAfterStep1(_pids(t)))
        with pytest.warns(UserWarning, match="no worker is left"):
            with pytest.raises(WorkersLostError, match="every rollout worker is lost .* resume=auto"):
                t.train()
    finally:
        t.remote.close()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1]
    assert (out / "checkpoints" / "step-1" / "trainer_state.pt").is_file()


def test_a_trainer_killed_with_sigkill_leaves_no_worker(tiny_model_dir, tmp_path):
    script = textwrap.dedent(
        f"""
        import sys, time
        sys.path[:0] = {sys.path!r}
        from _serve_helpers import run_config
        from cohort.trainer import GRPOTrainer
        t = GRPOTrainer(run_config({str(tiny_model_dir)!r}, {str(tmp_path / "orphan")!r}, **{{"rollout.workers": 2}}))
        print(" ".join(str(p.pid) for p in t.remote.local.processes), flush=True)
        time.sleep(120)
        """
    )
    trainer = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    pids: list[int] = []
    try:
        assert trainer.stdout is not None
        pids = [int(p) for p in trainer.stdout.readline().split()]
        assert len(pids) == 2 and all(alive(p) for p in pids)
        trainer.send_signal(signal.SIGKILL)
        trainer.wait(10)
        deadline = time.monotonic() + 10
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(alive(p) for p in pids), "a worker outlived its trainer"
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait(10)
        for p in pids:
            if alive(p):
                os.kill(p, signal.SIGKILL)
        trainer.stdout.close()  # type: ignore[union-attr]


def test_losing_listed_workers_says_a_resume_needs_them_back_at_the_same_addresses():
    import zmq

    from cohort.rollout import SamplingParams
    from cohort.serve.client import RemoteGeneration, WorkerClient

    context = zmq.Context()
    clients = [WorkerClient(context, f"127.0.0.1:{port}") for port in (1, 2)]
    for c in clients:
        c.lost = "its connection closed"
    source = RemoteGeneration(clients, torch.nn.Linear(1, 1), timeout=1.0, context=context, bucket_bytes=1)
    try:
        with pytest.raises(WorkersLostError) as caught:
            source.submit([[1, 2]], 2, SamplingParams(max_completion_length=2), None)
    finally:
        source.close()
    said = str(caught.value)
    assert "restart the workers at the same addresses (127.0.0.1:1, 127.0.0.1:2)" in said, said
    assert "resume=auto" in said and "allow_config_change=true" in said
    assert "rollout.workers to null" not in said  # a resume refuses a changed rollout.workers
