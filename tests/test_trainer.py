"""The trainer on a tiny model: reproducibility, exact resume, the zero-advantage skip, Ctrl-C, bad input."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import pytest
import torch

from cohort.config import ConfigError, load_config
from cohort.trainer import GRPOTrainer

DIGITS = str(Path(__file__).parent / "digit_reward.py") + ":digit_fraction"


def _cfg(model_dir, out, **over):
    base = {
        "model": {"name_or_path": str(model_dir)},
        "data": {"task": "addition", "n_train": 64, "n_eval": 16},
        "rollout": {"group_size": 4, "batch_size": 16, "max_completion_length": 6},
        "optim": {"lr": 5e-3},
        "rewards": [DIGITS],
        "steps": 3,
        "out_dir": str(out),
        "progress": False,
        "eval_at_ends": False,
        "save_every": 0,
    }
    for k, v in over.items():
        node = base
        *path, last = k.split(".")
        for p in path:
            node = node.setdefault(p, {})
        node[last] = v
    return load_config(None, base)


def _params(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_seeded_runs_are_reproducible(tiny_model_dir, tmp_path):
    runs = []
    for i in range(2):
        t = GRPOTrainer(_cfg(tiny_model_dir, tmp_path / f"r{i}"))
        t.train()
        runs.append(_params(t.model))
    for k in runs[0]:
        assert torch.equal(runs[0][k], runs[1][k]), k


def test_resume_continues_exactly(tiny_model_dir, tmp_path):
    full = GRPOTrainer(_cfg(tiny_model_dir, tmp_path / "full", steps=4))
    full.train()
    first = GRPOTrainer(_cfg(tiny_model_dir, tmp_path / "part", steps=2))
    first.train()
    resumed = GRPOTrainer(_cfg(tiny_model_dir, tmp_path / "part", steps=4, resume="auto"))
    assert resumed.step_idx == 2
    resumed.train()
    a, b = _params(full.model), _params(resumed.model)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6, msg=k)
    steps = [
        json.loads(line)["step"] for line in (tmp_path / "part" / "metrics.jsonl").read_text().splitlines()
    ]
    assert steps == [1, 2, 3, 4]


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo", "bnpo"])
def test_skipping_zero_advantage_rows_leaves_the_gradient_unchanged(tiny_model_dir, tmp_path, loss_type):
    """A binary reward gives many all-equal groups; skipping their rows must not change the gradient.

    Gradients are compared (not parameters after AdamW, which rescales even 1e-12 noise on parameters
    whose true gradient is 0, such as key biases, into full-size steps).
    """
    grads, computed = [], []
    for skip in ("on", "off"):
        over = {"algo.loss_type": loss_type, "fast.skip_zero_advantage": skip}
        cfg = _cfg(tiny_model_dir, tmp_path / f"{loss_type}{skip}", **over)
        cfg.rewards = [DIGITS.replace("digit_fraction", "any_digit")]
        t = GRPOTrainer(cfg)
        m = t.step().metrics
        assert m["fast/skip_zero_advantage"] == (1.0 if skip == "on" else 0.0)
        computed.append(m["rows_computed_frac"])
        assert 0 < m["frac_reward_zero_std"] < 1, "the batch needs both all-equal and mixed groups"
        grads.append({n: p.grad.clone() for n, p in t.model.named_parameters()})
    assert computed[0] < 1 and computed[1] == 1, computed
    scale = max(g.abs().max() for g in grads[1].values())
    assert scale > 0
    for n in grads[0]:
        torch.testing.assert_close(grads[0][n], grads[1][n], rtol=1e-4, atol=1e-6 * float(scale), msg=n)


def test_interrupt_leaves_a_checkpoint(tiny_model_dir, tmp_path, monkeypatch):
    t = GRPOTrainer(_cfg(tiny_model_dir, tmp_path / "int", steps=5))
    real_step = t.step
    calls = {"n": 0}

    def flaky_step():
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real_step()

    monkeypatch.setattr(t, "step", flaky_step)
    with pytest.raises(
        KeyboardInterrupt, match="step-2; the same command with resume=auto continues from it"
    ):
        t.train()
    ckpt = tmp_path / "int" / "checkpoints" / "step-2"
    assert (ckpt / "trainer_state.pt").is_file()
    resumed = GRPOTrainer(_cfg(tiny_model_dir, tmp_path / "int", steps=5, resume="auto"))
    assert resumed.step_idx == 2


def test_a_signal_after_the_update_waits_until_the_step_is_logged_and_saved(tiny_model_dir, tmp_path):
    # A SIGTERM landing between a step's update and its return (metrics, samples) cannot rewind the step (the
    # weights moved): it is held until the step is logged and saved, then the run stops there.
    import os
    import signal

    t = GRPOTrainer(_cfg(tiny_model_dir, tmp_path / "sig", steps=4))
    updates = {"n": 0}

    def signal_after_the_update(optimizer, args, kwargs):
        """torch's optimizer hook: runs once the weights moved, before the step computes its metrics."""
        updates["n"] += 1
        if updates["n"] == 2:
            os.kill(os.getpid(), signal.SIGTERM)

    t.optimizer.register_step_post_hook(signal_after_the_update)
    with pytest.raises(KeyboardInterrupt, match="at step 2"):
        t.train()
    rows = [json.loads(line) for line in (tmp_path / "sig" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    resumed = GRPOTrainer(_cfg(tiny_model_dir, tmp_path / "sig", steps=4, resume="auto"))
    assert resumed.step_idx == 2
    full = GRPOTrainer(_cfg(tiny_model_dir, tmp_path / "full", steps=4))
    full.train()
    resumed.train()
    a, b = _params(full.model), _params(resumed.model)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-6, msg=k)


def test_metrics_are_finite_and_named(tiny_model_dir, tmp_path):
    t = GRPOTrainer(_cfg(tiny_model_dir, tmp_path / "m", **{"algo.beta": 0.05}))
    result = t.step()
    m = result.metrics
    for key in ("reward", "reward_std", "kl", "loss", "grad_norm", "entropy", "clip_ratio/region_mean"):
        assert m[key] is not None and math.isfinite(m[key]), key
    assert m["kl"] >= 0


def test_lora_reference_is_the_base_model(tiny_model_dir, tmp_path):
    pytest.importorskip("peft")
    # packed_weights=on: rollouts decode through packed base weights under the adapters (a CPU lever)
    over = {"algo.beta": 0.1, "model.lora.enabled": True, "model.lora.r": 4, "fast.packed_weights": "on"}
    over["model.device"] = "cpu"
    cfg = _cfg(tiny_model_dir, tmp_path / "lora", **over)
    t = GRPOTrainer(cfg)
    assert t.ref_model is None  # no second copy: the adapter is switched off instead
    trainable = [n for n, p in t.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    t.train()
    assert (tmp_path / "lora" / "checkpoints" / "step-3" / "adapter_model.safetensors").is_file()


def test_bad_input_fails_before_the_model_loads(tmp_path, monkeypatch):
    import cohort.train.build as build

    def no_load(*a, **k):
        raise AssertionError("the model must not be loaded for a bad config")

    monkeypatch.setattr(build, "load_model", no_load)
    monkeypatch.setattr(build, "load_tokenizer", no_load)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    nocol = tmp_path / "nocol.jsonl"
    nocol.write_text('{"question": "1+1=", "answer": "2"}\n')
    cases = [
        ({"data.path": str(empty), "data.task": None}, "empty"),
        ({"data.path": str(nocol), "data.task": None}, "question"),
        ({"rewards": ["no_such_reward"]}, "accuracy"),
        ({"rollout.group_size": 1}, "at least 2"),
        ({"rollout.batch_size": 10}, "multiple"),
        ({"rollout.max_completion_length": 0}, "positive"),
        ({"reward_weights": [float("nan")]}, "is not finite"),
        ({"reward_weights": [1.0, 2.0]}, "one weight per function"),
        ({"model.lora.enabled": True, "model.lora.dropout": 1.5}, "model.lora.dropout=1.5"),
    ]
    for over, fragment in cases:
        with pytest.raises((ValueError, ConfigError)) as e:
            GRPOTrainer(_cfg("unused-model", tmp_path / "bad", **over))
        assert fragment in str(e.value), (over, str(e.value))


def test_reward_weights_are_checked_against_the_functions_passed(tmp_path, monkeypatch):
    import cohort.train.build as build

    class Loading(Exception):
        pass

    def loading(*a, **k):
        raise Loading

    monkeypatch.setattr(build, "load_tokenizer", loading)
    cfg = _cfg("unused-model", tmp_path / "w", reward_weights=[1.0, 0.5])  # the config names one reward
    with pytest.raises(
        ConfigError, match=r"2 values but there are 1 reward functions \['.*digit_fraction'\]"
    ):
        GRPOTrainer(cfg)
    with pytest.raises(Loading):  # two functions passed: the weights fit, so the model would load next
        GRPOTrainer(cfg, reward_funcs=[DIGITS, "accuracy"])
    with pytest.raises(
        ConfigError, match=r"there are 3 reward functions \['accuracy', 'format', 'accuracy'\]"
    ):
        GRPOTrainer(cfg, reward_funcs=["accuracy", "format", "accuracy"])


def test_unknown_model_path_is_clear(tmp_path):
    with pytest.raises(ValueError, match="neither a local model folder"):
        GRPOTrainer(_cfg(tmp_path / "missing-model", tmp_path / "x"))


def test_every_fast_path_trains_like_the_plain_paths(tiny_model_dir, tmp_path):
    """One step through segment attention + shared-prefix decoding + packed decode weights samples the
    same completions and computes the same loss and gradient norm as every switch off; the metrics say
    which paths ran. On the CPU: packed decode weights are a CPU lever, and float32 is what makes the
    completions equal (CUDA runs under bf16 autocast)."""
    runs = []
    for name in ("off", "on"):
        over = {f"fast.{s}": name for s in ("segments", "shared_prefix", "packed_weights", "chunked_head")}
        over["model.device"] = "cpu"
        t = GRPOTrainer(_cfg(tiny_model_dir, tmp_path / name, steps=1, **{"algo.beta": 0.04}, **over))
        t.train()
        runs.append(json.loads((tmp_path / name / "metrics.jsonl").read_text().splitlines()[0]))
    plain, fast = runs
    assert (
        fast["fast/segments"] == 1.0
        and fast["fast/shared_prefix"] == 1.0
        and fast["fast/packed_weights"] == 1.0
    )
    assert fast["fast/chunked_head"] == 1.0
    assert plain["fast/segments"] == 0.0 and plain["fast/dense_mask"] == 1.0  # grouped stays auto
    assert plain["fast/shared_prefix"] == 0.0 and plain["fast/packed_weights"] == 0.0
    assert plain["fast/chunked_head"] == 0.0
    for key in ("reward", "completions/mean_length", "num_tokens"):
        assert plain[key] == fast[key], key
    for key in ("loss", "grad_norm", "entropy"):
        assert math.isclose(plain[key], fast[key], rel_tol=1e-4, abs_tol=1e-6), key


def test_a_saved_lora_adapter_continues_training(tiny_model_dir, tmp_path):
    """LoRA round trip: a run's final adapter folder is a model cohort trains further (as LoRA, the base frozen,
    the reference the base with the adapter off)."""
    pytest.importorskip("peft")
    first = GRPOTrainer(
        _cfg(tiny_model_dir, tmp_path / "a", steps=1, **{"model.lora.enabled": True, "model.lora.r": 4})
    )
    first.train()
    adapter = first.save_final()
    assert (adapter / "adapter_config.json").is_file()
    t = GRPOTrainer(_cfg(adapter, tmp_path / "b", steps=2, **{"algo.beta": 0.05, "optim.lr": 5e-2}))
    trainable = {n: p.detach().clone() for n, p in t.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable) and t.ref_model is None
    t.train()
    after = dict(t.model.named_parameters())
    assert any(not torch.equal(after[n], v) for n, v in trainable.items())


def test_eval_k_adds_pass_and_majority_at_k_to_the_training_evaluations(tiny_model_dir, tmp_path):
    """The evaluations during training report pass@k and maj@k of eval_k sampled completions (the docs showed
    them, and no key asked for them); eval_k=1 keeps greedy accuracy alone; eval_k < 1 is refused before loading."""
    cfg = _cfg(tiny_model_dir, tmp_path / "k", eval_k=3, eval_every=1, steps=1, **{"data.n_eval": 4})
    GRPOTrainer(cfg).train()
    rows = [json.loads(line) for line in (tmp_path / "k" / "evals.jsonl").read_text().splitlines()]
    assert rows and all({"accuracy", "pass@3", "maj@3"} <= set(r) for r in rows), rows
    assert all(r["pass@3"] >= r["maj@3"] - 1e-9 for r in rows)  # any right answer counts for pass@k
    GRPOTrainer(_cfg(tiny_model_dir, tmp_path / "one", eval_every=1, steps=1, **{"data.n_eval": 4})).train()
    one = [json.loads(line) for line in (tmp_path / "one" / "evals.jsonl").read_text().splitlines()]
    assert one and not any(k.startswith(("pass@", "maj@")) for r in one for k in r)
    with pytest.raises(ConfigError, match=r"eval_k=0 .*>= 1"):
        _cfg("never/loaded", tmp_path / "bad", eval_k=0).validate()


def test_a_resume_with_nothing_to_train_keeps_the_finished_runs_summary(tiny_model_dir, tmp_path):
    """summary.json of a finished run (its evaluations, its timings) was rewritten by a resume at its last step,
    an attempt that trained nothing; it stays, and train() returns it."""
    out = tmp_path / "done"
    first = GRPOTrainer(_cfg(tiny_model_dir, out, steps=2, eval_at_ends=True, **{"data.n_eval": 4})).train()
    assert "accuracy_after" in first and first["steps"] == 2
    written = (out / "summary.json").read_text()
    again = GRPOTrainer(
        _cfg(tiny_model_dir, out, steps=2, eval_at_ends=True, resume="auto", **{"data.n_eval": 4})
    )
    assert again.train() == json.loads(written)
    assert (out / "summary.json").read_text() == written


def test_a_step_that_computed_no_row_logs_no_sampler_gap_or_per_token_values(tiny_model_dir, tmp_path):
    """With every group's rewards equal no row needs a pass: the sampler / trainer log-prob gap was never measured
    (it logged 0.0, an agreement no token showed), and entropy and KL stay null."""
    cfg = _cfg(
        tiny_model_dir, tmp_path / "flat", steps=2, rewards=[DIGITS.replace("digit_fraction", "constant")]
    )
    GRPOTrainer(cfg).train()
    rows = [json.loads(line) for line in (tmp_path / "flat" / "metrics.jsonl").read_text().splitlines()]
    assert [r["rows_computed_frac"] for r in rows] == [0.0, 0.0]
    assert all("sampler/logprob_gap" not in r and r["entropy"] is None for r in rows)
    trained = GRPOTrainer(_cfg(tiny_model_dir, tmp_path / "trained", steps=1)).train()
    assert trained["steps"] == 1
    row = json.loads((tmp_path / "trained" / "metrics.jsonl").read_text().splitlines()[0])
    assert row["rows_computed_frac"] > 0 and 0 <= row["sampler/logprob_gap"] < 1e-4


def test_metrics_log_the_learning_rate_each_step_used(tiny_model_dir, tmp_path):
    """With a 2-step warm-up the first step applies half the rate; it logged the next step's (the full rate)."""
    GRPOTrainer(_cfg(tiny_model_dir, tmp_path / "lr", steps=3, **{"optim.warmup_steps": 2})).train()
    rows = [json.loads(line) for line in (tmp_path / "lr" / "metrics.jsonl").read_text().splitlines()]
    assert [r["lr"] for r in rows] == pytest.approx([2.5e-3, 5e-3, 5e-3])


def _interrupted_at(tiny_model_dir, out, at: int, **over) -> None:
    """Runs 3 steps with evaluations at both ends and a Ctrl-C at the start of step `at` (saved: steps before it)."""
    t = GRPOTrainer(_cfg(tiny_model_dir, out, steps=3, eval_at_ends=True, **{"data.n_eval": 4}, **over))
    real_step, calls = t.step, {"n": 0}

    def flaky_step():
        calls["n"] += 1
        if calls["n"] == at:
            raise KeyboardInterrupt
        return real_step()

    t.step = flaky_step  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        t.train()


@pytest.mark.parametrize("at", [1, 2])
def test_a_resume_neither_repeats_nor_forgets_the_first_evaluation(tiny_model_dir, tmp_path, at):
    """Interrupted before its first step (a step-0 checkpoint) the resume logged the step-0 evaluation again; from
    a later one its summary lost accuracy_before."""
    out = tmp_path / f"at{at}"
    _interrupted_at(tiny_model_dir, out, at)
    first = json.loads((out / "evals.jsonl").read_text().splitlines()[0])
    summary = GRPOTrainer(
        _cfg(tiny_model_dir, out, steps=3, eval_at_ends=True, resume="auto", **{"data.n_eval": 4})
    ).train()
    assert [json.loads(r)["step"] for r in (out / "evals.jsonl").read_text().splitlines()] == [0, 3]
    assert summary["accuracy_before"] == first["accuracy"] and "accuracy_after" in summary


def test_a_run_killed_before_its_first_step_is_a_run_its_folder_holds(tiny_model_dir, tmp_path):
    """Killed (no checkpoint) after its first evaluation: a new run there was not refused, and resume=auto did not
    set the old logs aside (only metrics.jsonl was looked at), so evals.jsonl held step 0 twice."""
    out = tmp_path / "killed"
    out.mkdir()
    (out / "evals.jsonl").write_text(json.dumps({"step": 0, "accuracy": 0.25, "n": 4}) + "\n")
    with pytest.raises(Exception, match="already holds a run"):
        GRPOTrainer(_cfg(tiny_model_dir, out, steps=2, eval_at_ends=True, **{"data.n_eval": 4}))
    GRPOTrainer(
        _cfg(tiny_model_dir, out, steps=2, eval_at_ends=True, resume="auto", **{"data.n_eval": 4})
    ).train()
    assert [json.loads(r)["step"] for r in (out / "evals.jsonl").read_text().splitlines()] == [0, 2]
    assert (out / "evals.jsonl.before-restart").is_file()


def test_a_resume_that_stretches_a_decaying_schedule_says_the_rate_jumps(tiny_model_dir, tmp_path):
    out = tmp_path / "sched"
    GRPOTrainer(_cfg(tiny_model_dir, out, steps=2, **{"optim.schedule": "linear"})).train()
    with pytest.warns(
        UserWarning, match="steps changed from 2 to 4 under optim.schedule=linear: the rate now"
    ):
        GRPOTrainer(_cfg(tiny_model_dir, out, steps=4, resume="auto", **{"optim.schedule": "linear"}))
    GRPOTrainer(_cfg(tiny_model_dir, tmp_path / "flat", steps=2)).train()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        GRPOTrainer(_cfg(tiny_model_dir, tmp_path / "flat", steps=4, resume="auto"))
    assert not any("steps changed" in str(w.message) for w in caught)  # a constant rate does not move


def test_a_metrics_sink_without_its_package_is_refused_before_the_run_folder_is_made(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    with pytest.raises(
        ConfigError, match=r"wandb=true needs the wandb package: pip install 'cohort\[wandb\]'"
    ):
        GRPOTrainer(_cfg("unused-model", tmp_path / "sink", wandb=True))
    assert not (tmp_path / "sink").exists()


def test_a_resume_on_other_training_data_is_refused(tiny_model_dir, tmp_path):
    """The prompt order a checkpoint continues indexes its rows: cut from 40 rows to 20, the resume went on without
    a word, and was no longer the run it continued."""
    data = tmp_path / "rows.jsonl"
    rows = [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(40)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    over = {"data.task": None, "data.path": str(data)}
    GRPOTrainer(_cfg(tiny_model_dir, tmp_path / "run", steps=2, **over)).train()
    data.write_text("".join(json.dumps(r) + "\n" for r in rows[:20]))
    with pytest.raises(ConfigError, match=r"training data differs .*\(40 rows then, 20 now; fingerprint"):
        GRPOTrainer(_cfg(tiny_model_dir, tmp_path / "run", steps=4, resume="auto", **over))
    t = GRPOTrainer(
        _cfg(tiny_model_dir, tmp_path / "run", steps=4, resume="auto", allow_config_change=True, **over)
    )
    assert t.step_idx == 2
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))  # the same rows again: resumes as before
    assert GRPOTrainer(_cfg(tiny_model_dir, tmp_path / "run", steps=4, resume="auto", **over)).step_idx == 2
