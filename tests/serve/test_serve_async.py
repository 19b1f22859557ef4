"""Asynchronous steps (rollout.max_staleness = k > 0): the workers sample the next steps' batches while the
trainer updates. Checked: each batch's staleness (0, 1, ..., k, then k), the importance correction on by
default, runs that reproduce, a crash then resume and an interrupted step that train exactly the batches of
the uninterrupted run, and the checkpoint holding the queued batches."""

from __future__ import annotations

import json
import math

import digit_reward
import pytest
import torch
from _serve_helpers import run_config

from cohort.train.ahead import rollout_from, rollout_state
from cohort.trainer import GRPOTrainer


def _rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _same_rows(a, b):
    """Asserts two metrics rows agree on everything but timings."""
    differ = [
        k
        for k in a
        if not k.startswith("time")
        and k != "step_time"
        and a[k] != b[k]
        and not (isinstance(a[k], float) and math.isnan(a[k]) and math.isnan(b[k]))
    ]
    assert not differ, {k: (a[k], b.get(k)) for k in differ}


def _resume_equals(model_dir, out, full, full_out, over):
    """Asserts that resuming the run in `out` to its end gives the uninterrupted run's rows and weights."""
    resumed = _train(model_dir, out, resume="auto", **over)
    for ra, rb in zip(_rows(full_out), _rows(out), strict=True):
        _same_rows(ra, rb)
    wa, wb = full.model.state_dict(), resumed.model.state_dict()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def _train(model_dir, out, **over):
    t = GRPOTrainer(run_config(model_dir, out, **{"rollout.workers": 1, **over}))
    try:
        t.train()
    finally:
        t.remote.close()
    return t


def test_staleness_is_logged_and_corrected_by_default(tiny_model_dir, tmp_path):
    t = _train(tiny_model_dir, tmp_path / "k2", **{"rollout.max_staleness": 2, "steps": 4})
    # model.device=auto: the local worker samples on the device the trainer resolved (a GPU where there is one)
    assert t.remote.clients[0].identity["device"] == t.device.type
    assert t.cfg.algo.sampler_correction == "token_tis"
    rows = _rows(tmp_path / "k2")
    assert [r["serve/staleness"] for r in rows] == [0.0, 1.0, 2.0, 2.0]
    for r in rows:
        assert r["sampler/is_ratio_mean"] > 0 and math.isfinite(r["sampler/is_ratio_max"])
    # a stale batch's sampler is not the policy being trained: their log-probs differ (not on step 1's batch)
    assert abs(rows[0]["sampler/is_ratio_max"] - 1) < 1e-4 < abs(rows[2]["sampler/is_ratio_max"] - 1)
    assert "health/logprob_gap" not in rows[2]  # the gap of a stale batch is expected, not a finding
    # an explicit choice stands
    t = _train(
        tiny_model_dir,
        tmp_path / "none",
        **{"rollout.max_staleness": 1, "steps": 2, "algo.sampler_correction": "none"},
    )
    assert t.cfg.algo.sampler_correction == "none"
    assert "sampler/is_ratio_mean" not in _rows(tmp_path / "none")[-1]


def test_async_runs_reproduce_and_differ_from_the_synchronous_run(tiny_model_dir, tmp_path):
    over = {"rollout.max_staleness": 1, "steps": 3}
    a = _train(tiny_model_dir, tmp_path / "a", **over)
    b = _train(tiny_model_dir, tmp_path / "b", **over)
    sync = _train(tiny_model_dir, tmp_path / "sync", steps=3)
    for ra, rb in zip(_rows(tmp_path / "a"), _rows(tmp_path / "b"), strict=True):
        _same_rows(ra, rb)
    wa, wb, ws = a.model.state_dict(), b.model.state_dict(), sync.model.state_dict()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert any(not torch.equal(wa[k], ws[k]) for k in wa)


class _Crash(Exception):
    pass


@pytest.mark.parametrize("staleness", [0, 2])
@pytest.mark.parametrize("how", ["trainer", "worker"])
def test_a_crash_then_resume_trains_the_batches_of_the_uninterrupted_run(
    tiny_model_dir, tmp_path, staleness, how
):
    # At staleness 2 the checkpoint of step 2 holds the batches queued for steps 3 and 4 (sampled with the
    # initial weights and those after step 1); the resumed run trains on them, then queues as the uninterrupted
    # run did. The trainer crashes after step 3's update, or its only worker is killed there (the run stops with
    # WorkersLostError when it next needs it: at the latest for step 6's batch, requested after the kill; a run
    # whose remaining batches were all sampled before the kill would finish without it): either way the
    # resumed run is the uninterrupted one.
    import os
    import signal

    from cohort.serve.client import WorkersLostError

    over = {"rollout.max_staleness": staleness, "steps": 6, "save_every": 2}
    full = _train(tiny_model_dir, tmp_path / "full", **over)
    out = tmp_path / "crash"
    t = GRPOTrainer(run_config(tiny_model_dir, out, **{"rollout.workers": 1, **over}))
    updates = {"n": 0}

    def crash_at_step_3(optimizer, args, kwargs):
        """torch's optimizer hook: runs once step 3's update moved the weights."""
        updates["n"] += 1
        if updates["n"] == 3:
            if how == "trainer":
                raise _Crash  # as kill -9 after step 3's update: the state on disk is step 2's checkpoint
            os.kill(t.remote.local.processes[0].pid, signal.SIGKILL)

    t.optimizer.register_step_post_hook(crash_at_step_3)
    try:
        with pytest.raises(_Crash if how == "trainer" else WorkersLostError):
            if how == "worker":
                with pytest.warns(UserWarning, match="no worker is left"):
                    t.train()
            else:
                t.train()
    finally:
        t.remote.close()
    state = torch.load(out / "checkpoints" / "step-2" / "trainer_state.pt", weights_only=True)
    if staleness:
        queued = state["extra"]["ahead"]["queued"]
        assert [q["step"] for q in queued] == [3, 4] and [q["weights_step"] for q in queued] == [0, 1]
    else:
        assert "ahead" not in state["extra"]
    _resume_equals(tiny_model_dir, out, full, tmp_path / "full", over)


def test_an_interrupted_step_puts_back_its_queue(tiny_model_dir, tmp_path):
    # Step 3 is interrupted while being prepared (after it took its batch and queued step 4's): the queue is put
    # back, the checkpoint of step 2 saved with it, and the resumed run is the uninterrupted one.
    over = {"rollout.max_staleness": 1, "steps": 4}
    full = _train(tiny_model_dir, tmp_path / "full", **over)
    out = tmp_path / "int"
    calls = {"n": 0}

    def digit_fraction(completions, **kwargs):
        """The run's reward, under its own name; interrupts step 3 while its batch is scored (being prepared)."""
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return digit_reward.digit_fraction(completions, **kwargs)

    t = GRPOTrainer(
        run_config(tiny_model_dir, out, **{"rollout.workers": 1, **over}), reward_funcs=[digit_fraction]
    )
    try:
        with pytest.raises(KeyboardInterrupt, match="at step 2"):
            t.train()
    finally:
        t.remote.close()
    state = torch.load(out / "checkpoints" / "step-2" / "trainer_state.pt", weights_only=True)
    assert [q["step"] for q in state["extra"]["ahead"]["queued"]] == [3]
    _resume_equals(tiny_model_dir, out, full, tmp_path / "full", over)


def test_two_workers_share_the_queue_and_one_may_be_lost(tiny_model_dir, tmp_path):
    # Several workers split each queued batch into chunks; when one is killed mid-run, its queued chunks are sent
    # to the other (sampled there with the newest weights pushed) and the run goes on.
    import os
    import signal

    over = {"rollout.workers": 2, "rollout.max_staleness": 1, "steps": 4}
    t = GRPOTrainer(run_config(tiny_model_dir, tmp_path / "kill", **over))
    try:
        rows = [t.step().metrics]
        os.kill(t.remote.local.processes[0].pid, signal.SIGKILL)
        with pytest.warns(UserWarning, match="rollout worker at 127.0.0.1:.* is lost .* 1 worker"):
            rows += [t.step().metrics for _ in range(3)]
    finally:
        t.remote.close()
    assert rows[0]["serve/workers"] == 2.0 and rows[-1]["serve/workers"] == 1.0
    assert [r["serve/staleness"] for r in rows] == [0.0, 1.0, 1.0, 1.0]
    assert all(math.isfinite(r["loss"]) and r["completions/mean_length"] > 0 for r in rows)


def test_a_queued_rollout_round_trips_through_plain_types():
    from cohort.rollout import RolloutBatch

    batch = RolloutBatch(
        prompt_ids=[[1, 2], [3]],
        completion_ids=[[4], [5, 6], [7], []],
        truncated=torch.tensor([False, True, False, False]),
        group_size=2,
        sampling_logprobs=[
            torch.tensor([-0.5]),
            torch.tensor([-1.0, -2.0]),
            torch.tensor([-0.1]),
            torch.zeros(0),
        ],
        paths={"shared_prefix": True},
    )
    back = rollout_from(rollout_state(batch))
    assert back.prompt_ids == batch.prompt_ids and back.completion_ids == batch.completion_ids
    assert torch.equal(back.truncated, batch.truncated) and back.paths == batch.paths
    assert all(torch.equal(x, y) for x, y in zip(back.sampling_logprobs, batch.sampling_logprobs))
