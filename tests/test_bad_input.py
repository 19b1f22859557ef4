"""Hostile input and faults: no silent failure, nothing lost, every user error one clear line.

Grouped by the five families of the reliability issue: training that goes wrong without a word, resume
that is not exact, checkpoints that can be lost, two runs in one folder, errors that do not name the
problem. (Kill -9 at random moments is tests/train/test_resume.py.)
"""

from __future__ import annotations

import errno
import json
import math
import re
import subprocess
import sys
import warnings

import pytest
import torch
from test_trainer import _cfg

from cohort.config import ConfigError, load_config
from cohort.data import DataError, load_rows, validate_rows
from cohort.errors import NonFiniteError, TrainingError
from cohort.rewards import score
from cohort.runtime.checkpoint_files import list_checkpoints, readable_checkpoints
from cohort.runtime.rundir import RunLock, RunLockedError, trim_logs
from cohort.trainer import GRPOTrainer


def _finite(path) -> bool:
    from safetensors.torch import load_file

    return all(torch.isfinite(t).all() for t in load_file(str(path / "model.safetensors")).values())


# ------------------------------------------------------------------ 1. training that goes wrong without a word


def test_a_learning_rate_that_saturates_the_policy_is_reported(tiny_model_dir, tmp_path):
    # Which symptom comes first depends on the machine's float kernels (AVX-512 vs AVX2, a GPU): saturated
    # probabilities give an exactly-zero gradient, or an overflow a NaN one. Either is reported, naming optim.lr.
    t = GRPOTrainer(
        _cfg(tiny_model_dir, tmp_path / "lr", steps=6, **{"optim.lr": 1e3, "optim.max_grad_norm": 0})
    )
    stopped = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            t.train()
        except NonFiniteError as e:
            stopped = str(e)
    said = [str(w.message) for w in caught if "health check 'zero_gradient'" in str(w.message)]
    assert said or stopped, [str(w.message) for w in caught]
    assert all(re.search(r"step \d+: .*the gradient is exactly 0 .*optim.lr=1000", m) for m in said), said
    assert stopped is None or re.search(r"step \d+: non-finite (gradient|loss).*optim.lr=1000", stopped), (
        stopped
    )


def test_non_finite_logits_stop_the_run_before_the_weights_or_a_checkpoint_go_bad(tiny_model_dir, tmp_path):
    from cohort.models import load_model, load_tokenizer

    model = load_model(tiny_model_dir)
    with torch.no_grad():
        model.lm_head.weight[5].fill_(3e38)  # finite weights whose logits overflow to inf
    before = {n: p.clone() for n, p in model.named_parameters()}
    t = GRPOTrainer(
        _cfg(tiny_model_dir, tmp_path / "inf", steps=3, save_every=1),
        model=model,
        tokenizer=load_tokenizer(tiny_model_dir),
    )
    with pytest.raises(TrainingError, match=r"step 1: .*non-finite") as raised:
        t.train()
    assert isinstance(raised.value, NonFiniteError)  # typed: callers catch it without reading the text
    # nothing applied (compared on the CPU: on a GPU machine the trainer moved the model to CUDA)
    assert all(torch.equal(p.cpu(), before[n]) for n, p in t.model.named_parameters())
    assert not list_checkpoints(tmp_path / "inf")  # and nothing saved


def test_a_model_with_nan_weights_is_refused(tiny_model_dir, tmp_path):
    from cohort.models import load_model, load_tokenizer

    model = load_model(tiny_model_dir)
    with torch.no_grad():
        model.lm_head.weight[3, 5] = float("nan")
    with pytest.raises(
        NonFiniteError, match="non-finite weights: 1 NaN/inf values in 1 tensors .*lm_head.weight"
    ):
        GRPOTrainer(
            _cfg(tiny_model_dir, tmp_path / "nan"), model=model, tokenizer=load_tokenizer(tiny_model_dir)
        )


def _none_reward(completions, **kwargs):
    return [None] * len(completions)


@pytest.mark.parametrize(
    ("over", "rewards", "fragment"),
    [
        ({}, [_none_reward], "every reward function returned None"),
        (
            {"algo.mask_truncated": True, "rollout.max_completion_length": 1},
            None,
            "every completion was left out of the loss",
        ),
    ],
)
def test_a_step_that_cannot_learn_warns_once(tiny_model_dir, tmp_path, over, rewards, fragment):
    t = GRPOTrainer(_cfg(tiny_model_dir, tmp_path / "w", steps=2, **over), reward_funcs=rewards)
    with pytest.warns(UserWarning, match=fragment) as record:
        t.step()
        t.step()
    assert sum(fragment in str(w.message) for w in record) == 1


@pytest.mark.parametrize(
    ("over", "fragment"),
    [
        ({"rollout.temperature": 0}, "rollout.temperature=0 decodes greedily"),
        ({"algo.eps_low": 1.5}, "algo.eps_low=1.5 must be in [0, 1)"),
        ({"algo.delta": 1.1}, "algo.delta=1.1 must be > 1 + eps_high"),
        ({"save_every": -1}, "save_every=-1 must be >= 0"),
        ({"keep_checkpoints": 0}, "keep_checkpoints=0 must be >= 1"),
        ({"optim.lr": float("nan")}, "optim.lr=nan: must be a finite number"),
        ({"optim.adam_beta2": 1.0}, "optim.adam_beta2=1.0 must be in [0, 1)"),
        ({"reward_weights": [float("nan")]}, "reward_weights"),
        ({"data.max_prompt_length": 0}, "data.max_prompt_length=0 must be >= 1"),
        ({"eval_every": -3}, "eval_every=-3 must be >= 0"),
        (
            {"algo.ref_update_every": 5},
            "algo.ref_sync.every=5 changes nothing in this configuration: algo.beta=0 runs no reference",
        ),
        ({"model.attn_implementation": "bogus"}, "model.attn_implementation='bogus' is not one of sdpa"),
        (
            {"algo.ref_sync": {"kl": 0.5}},
            "algo.ref_sync.kl=0.5 changes nothing in this configuration: algo.beta=0 runs no reference",
        ),
        (
            {"algo.ref_sync_kl": -1.0, "algo.beta": 0.1},
            "algo.ref_sync.kl (algo.ref_sync_kl)=-1.0 must be > 0",
        ),
        ({"algo.ref_update_every": -2, "algo.beta": 0.1}, "algo.ref_update_every)=-2 must be an int >= 0"),
        (
            {"algo.ref_update_every": 4, "algo.ref_mixup_alpha": 0.0, "algo.beta": 0.1},
            "algo.ref_sync.alpha (algo.ref_mixup_alpha)=0.0 must be in (0, 1]",
        ),
        (
            {"algo.ref_sync": {"every": 4, "alpha": 1.5}, "algo.beta": 0.1},
            "algo.ref_mixup_alpha)=1.5 must be in (0, 1]",
        ),
        (
            {"algo.ref_mixup_alpha": 0.6, "algo.beta": 0.1},
            "algo.ref_mixup_alpha=0.6 does nothing while algo.ref_sync is off: turn it on",
        ),
        ({"algo.ref_sync": True, "algo.beta": 0.1}, "algo.ref_sync is on but never syncs"),
        ({"fast.grouped_min_saving_cuda": 2}, "fast.grouped_min_saving_cuda=2.0 must be a share in [0, 1]"),
        (
            {"fast.unmasked_padding": "maybe"},
            "fast.unmasked_padding='maybe' is not valid; choose one of: auto, on",
        ),
        (
            {"algo.dynamic_sampling": True, "algo.max_sampling_rounds": 0},
            "algo.dynamic_sampling.max_rounds=0 must be an integer >= 1",
        ),
        ({"curriculum.enabled": True, "curriculum.retry_after": 0}, "curriculum.retry_after=0 must be >= 1"),
        (
            {"curriculum.enabled": True, "curriculum.min_samplings": 0},
            "curriculum.min_samplings=0 must be >= 1",
        ),
    ],
)
def test_options_are_checked_before_the_model_loads(tmp_path, over, fragment):
    with pytest.raises(ConfigError) as e:
        GRPOTrainer(_cfg("no-model-needed", tmp_path / "o", **over))
    assert fragment in str(e.value), str(e.value)


def test_cli_rejects_k_zero_in_one_line(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "cohort.cli", "eval", "--model", "m", "--task", "addition", "--k", "0"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "argument --k: 0 must be an integer >= 1" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_prompts_longer_than_the_context_are_refused_and_dropped_prompts_counted(tmp_path, capsys):
    from cohort.models import build_tiny_model

    small = build_tiny_model(
        tmp_path / "ctx", hidden_size=32, num_layers=1, num_heads=4, max_position_embeddings=16
    )
    rows = [{"prompt": "1+1=" * k, "answer": "2"} for k in (1, 2, 3, 5)]  # 4 to 20 tokens
    with pytest.raises(
        TrainingError,
        match=r"2 of 4 training prompts \(the longest 20 tokens\) do not leave room .*context of 16 .*: set "
        r"data.max_prompt_length=8 to leave those prompts out$",
    ):
        GRPOTrainer(
            _cfg(small, tmp_path / "c1", **{"rollout.max_completion_length": 8}),
            train_rows=rows,
            eval_rows=[],
        )
    # every prompt too long: dropping them all is no fix, so only the completion length is named, with a number
    with pytest.raises(
        TrainingError, match=r"3 of 3 training prompts .*: lower rollout.max_completion_length to 4 or less$"
    ):
        GRPOTrainer(
            _cfg(small, tmp_path / "c3", **{"rollout.max_completion_length": 14}),
            train_rows=rows[:3],
            eval_rows=[],
        )
    # and where no completion length fits the longest, shorter prompts (or both settings together)
    with pytest.raises(TrainingError, match=r"4 of 4 training prompts .*: shorten the training prompts"):
        GRPOTrainer(
            _cfg(small, tmp_path / "c5", **{"rollout.max_completion_length": 14}),
            train_rows=rows,
            eval_rows=[],
        )
    # held-out prompts are not dropped by data.max_prompt_length: it is not offered for them
    with pytest.raises(
        TrainingError, match=r"1 of 1 held-out prompts .*: lower rollout.max_completion_length to 7 or less$"
    ):
        GRPOTrainer(
            _cfg(small, tmp_path / "c4", **{"rollout.max_completion_length": 8, "data.max_prompt_length": 8}),
            train_rows=rows[:2],
            eval_rows=[{"prompt": "1+1=1+1=1", "answer": "2"}],
        )
    t = GRPOTrainer(
        _cfg(small, tmp_path / "c2", **{"rollout.max_completion_length": 8, "data.max_prompt_length": 8}),
        train_rows=rows,
        eval_rows=[],
    )
    assert t.dropped_prompts == 2 and len(t.train_rows) == 2
    assert "2 of 4 training prompts are longer" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("rows", "fragment"),
    [
        ([{"prompt": [{"role": "wizard", "content": "hi"}]}], "unknown chat role 'wizard'"),
        ([{"prompt": "1+1="}, {"prompt": "  \n"}], "row 1 has a prompt of only whitespace"),
        (
            [{"prompt": "1+1="}, {"prompt": [{"role": "user", "content": "2+2="}]}],
            "row 1 has a chat-message prompt but row 0",
        ),
    ],
)
def test_data_that_would_be_changed_quietly_is_refused(rows, fragment):
    with pytest.raises(DataError, match=fragment):
        validate_rows(rows)


def test_a_reward_function_cannot_corrupt_the_data_it_receives():
    prompts = [[{"role": "user", "content": "1+1="}]] * 2
    answer = [["2"], ["2"]]

    def vandal(prompts, completions, answer, **kwargs):
        prompts[0][0]["content"] = "garbage"
        answer[0].append("x")
        completions[0][0]["content"] = "garbage"
        return [0.0, 0.0]

    def reader(prompts, completions, answer, **kwargs):
        return [
            float(p[0]["content"] == "1+1=" and a == ["2"] and c[0]["content"] == "2")
            for p, c, a in zip(prompts, completions, answer)
        ]

    completions = [[{"role": "assistant", "content": "2"}]] * 2
    out = score([vandal, reader], prompts=prompts, completions=completions, columns={"answer": answer})
    assert out[:, 1].tolist() == [1.0, 1.0]
    assert prompts[0][0]["content"] == "1+1=" and answer[0] == ["2"] and completions[0][0]["content"] == "2"


# ------------------------------------------------------------------ 2. resume that is not exact


def test_logs_are_cut_back_to_the_checkpoint_and_a_torn_line_is_repaired(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3, 4)) + '{"step": 5, "lo'
    )
    (tmp_path / "evals.jsonl").write_text('{"step": 0, "accuracy": 0.1}\n{"step": 4, "accuracy": 0.2}\n')
    removed = trim_logs(tmp_path, 3)
    assert removed == {"metrics": 2, "evals": 1}
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    assert (tmp_path / "metrics.jsonl").read_text().endswith("\n")


def test_a_run_directory_that_holds_a_run_is_not_restarted_silently(tiny_model_dir, tmp_path):
    GRPOTrainer(_cfg(tiny_model_dir, tmp_path / "r", steps=1)).train()
    with pytest.raises(ConfigError, match="already holds a run .*pass resume=auto"):
        GRPOTrainer(_cfg(tiny_model_dir, tmp_path / "r", steps=2))


def test_resume_auto_without_a_checkpoint_keeps_the_old_logs_aside(tiny_model_dir, tmp_path):
    run = tmp_path / "nock"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    t = GRPOTrainer(_cfg(tiny_model_dir, run, steps=1, resume="auto"))
    assert t.step_idx == 0
    t.train()
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [1]
    assert (run / "metrics.jsonl.before-restart").read_text() == '{"step": 1}\n{"step": 2}\n'


def test_resume_with_a_changed_config_says_what_differs(tiny_model_dir, tmp_path):
    GRPOTrainer(_cfg(tiny_model_dir, tmp_path / "cc", steps=1)).train()
    with pytest.raises(ConfigError, match=r"rollout.group_size: 4 -> 2.*allow_config_change=true"):
        GRPOTrainer(
            _cfg(tiny_model_dir, tmp_path / "cc", steps=2, resume="auto", **{"rollout.group_size": 2})
        )
    # steps, logging, fast-path and health-check keys may change; allow_config_change accepts the rest
    t = GRPOTrainer(_cfg(tiny_model_dir, tmp_path / "cc", steps=3, resume="auto", **{"fast.segments": "off"}))
    assert t.step_idx == 1
    over = {"health.logprob_gap_max": 1e-3, "health.window": 3}  # a run saved before logprob_gap_max's null
    assert GRPOTrainer(_cfg(tiny_model_dir, tmp_path / "cc", steps=3, resume="auto", **over)).step_idx == 1
    t = GRPOTrainer(
        _cfg(
            tiny_model_dir,
            tmp_path / "cc",
            steps=3,
            resume="auto",
            allow_config_change=True,
            **{"optim.lr": 1e-4},
        )
    )
    assert t.step_idx == 1


def test_resume_into_a_different_model_is_one_line(tiny_model_dir, tmp_path):
    from cohort.models import build_tiny_model

    GRPOTrainer(_cfg(tiny_model_dir, tmp_path / "dm", steps=1)).train()
    other = build_tiny_model(tmp_path / "other", hidden_size=48, num_layers=2, num_heads=4)
    with pytest.raises(TrainingError, match="holds a different model") as e:
        GRPOTrainer(_cfg(other, tmp_path / "dm", steps=2, resume="auto", allow_config_change=True))
    assert "\n" not in str(e.value)


def test_the_reference_after_a_refresh_is_saved_and_restored(tiny_model_dir, tmp_path):
    over = {"algo.beta": 0.05, "algo.ref_update_every": 2, "optim.lr": 1e-2}
    t = GRPOTrainer(_cfg(tiny_model_dir, tmp_path / "ref", steps=3, save_every=3, **over))
    t.train()
    resumed = GRPOTrainer(_cfg(tiny_model_dir, tmp_path / "ref", steps=4, resume="auto", **over))
    for (n, a), b in zip(t.ref_model.state_dict().items(), resumed.ref_model.state_dict().values()):
        assert torch.equal(a, b), n
    assert any(
        not torch.equal(a, b) for a, b in zip(resumed.ref_model.parameters(), resumed.model.parameters())
    )


# ------------------------------------------------------------------ 3. checkpoints that can be lost


def test_saving_a_step_again_never_leaves_it_missing(tiny_model_dir, tmp_path):
    t = GRPOTrainer(_cfg(tiny_model_dir, tmp_path / "twice", steps=1))
    first = t.save()
    root = first.parent
    # A kill between moving the old copy aside and renaming the new one in: the old copy is recovered.
    first.rename(root / ".old-step-0")
    assert [p.name for p in list_checkpoints(tmp_path / "twice")] == ["step-0"]
    t.save()
    assert [p.name for p in list_checkpoints(tmp_path / "twice")] == ["step-0"]
    assert not list(root.glob(".old-*")) and not list(root.glob(".tmp-*"))


def test_an_unreadable_newest_checkpoint_falls_back_to_the_previous_one(tiny_model_dir, tmp_path):
    t = GRPOTrainer(_cfg(tiny_model_dir, tmp_path / "bad", steps=2, save_every=1))
    t.train()
    newest = list_checkpoints(tmp_path / "bad")[-1]
    (newest / "trainer_state.pt").write_bytes(b"not a checkpoint")
    with pytest.warns(UserWarning, match="step-2.* is unreadable"):
        assert [p.name for p, _ in readable_checkpoints(tmp_path / "bad")] == ["step-1"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        resumed = GRPOTrainer(_cfg(tiny_model_dir, tmp_path / "bad", steps=3, resume="auto"))
    assert resumed.step_idx == 1


def test_resuming_past_an_unreadable_checkpoint_never_prunes_the_one_resumed_from(tiny_model_dir, tmp_path):
    run = tmp_path / "prune"
    GRPOTrainer(_cfg(tiny_model_dir, run, steps=2, save_every=1, keep_checkpoints=2)).train()
    (list_checkpoints(run)[-1] / "trainer_state.pt").write_bytes(b"torn")  # step-2 unreadable
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t = GRPOTrainer(_cfg(tiny_model_dir, run, steps=4, save_every=1, keep_checkpoints=2, resume="auto"))
    assert t.step_idx == 1
    assert (run / "checkpoints" / "abandoned-step-2").is_dir()  # kept, but out of the way
    t.train()
    assert [p.name for p in list_checkpoints(run)] == ["step-3", "step-4"]
    assert (run / "checkpoints" / "abandoned-step-2").is_dir()


def test_an_explicit_resume_from_an_older_checkpoint_sets_the_newer_ones_aside(tiny_model_dir, tmp_path):
    run = tmp_path / "branch"
    GRPOTrainer(_cfg(tiny_model_dir, run, steps=3, save_every=1, keep_checkpoints=3)).train()
    first = run / "checkpoints" / "step-1"
    t = GRPOTrainer(_cfg(tiny_model_dir, run, steps=3, save_every=1, keep_checkpoints=3, resume=str(first)))
    assert t.step_idx == 1
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        "abandoned-step-2",
        "abandoned-step-3",
        "step-1",
    ]


def test_a_corrupt_weights_file_in_a_checkpoint_falls_back_and_in_a_model_is_named(tiny_model_dir, tmp_path):
    import shutil

    from cohort.models import load_model

    run = tmp_path / "corrupt"
    GRPOTrainer(_cfg(tiny_model_dir, run, steps=2, save_every=1)).train()
    weights = list_checkpoints(run)[-1] / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.warns(UserWarning, match=r"step-2 cannot be loaded \(the weights file .* is corrupt"):
        t = GRPOTrainer(_cfg(tiny_model_dir, run, steps=3, resume="auto"))
    assert t.step_idx == 1
    broken = tmp_path / "broken-model"
    shutil.copytree(tiny_model_dir, broken)
    (broken / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(ValueError, match=r"\(model.safetensors\) is corrupt or truncated .* save it again"):
        load_model(str(broken))


def test_resume_with_fewer_steps_than_the_checkpoint_is_refused(tiny_model_dir, tmp_path, capsys):
    run = tmp_path / "short"
    GRPOTrainer(_cfg(tiny_model_dir, run, steps=3)).train()
    with pytest.raises(ConfigError, match=r"is at step 3, past steps=2; steps is the total .* set steps > 3"):
        GRPOTrainer(_cfg(tiny_model_dir, run, steps=2, resume="auto"))
    GRPOTrainer(_cfg(tiny_model_dir, run, steps=3, resume="auto"))
    assert "the run already reached steps=3; nothing to train" in capsys.readouterr().out


def test_a_full_disk_is_one_clear_error_and_leaves_no_partial_checkpoint(
    tiny_model_dir, tmp_path, monkeypatch
):
    t = GRPOTrainer(_cfg(tiny_model_dir, tmp_path / "full", steps=1))

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(OSError, match="no space left on device while writing the checkpoint of step 0"):
        t.save()
    assert not list((tmp_path / "full" / "checkpoints").iterdir())


class _LibraryError(Exception):
    """What safetensors raises for a failed write: its own type, the OS error only in the text."""


def test_a_full_disk_inside_a_library_writer_is_the_same_one_error(tiny_model_dir, tmp_path, monkeypatch):
    t = GRPOTrainer(_cfg(tiny_model_dir, tmp_path / "lib", steps=1))

    def full(*args, **kwargs):
        raise _LibraryError(
            "Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "
            '"No space left on device" })'
        )

    monkeypatch.setattr(type(t.model), "save_pretrained", full)
    with pytest.raises(
        OSError, match="no space left on device while writing the checkpoint of step 0 to .*removed"
    ):
        t.save()
    assert not list((tmp_path / "lib" / "checkpoints").iterdir())  # no .tmp-step-0 left behind


# ------------------------------------------------------------------ 4. two runs, one folder


def test_a_second_run_in_the_same_folder_is_refused_and_a_stale_lock_is_taken_over(tmp_path):
    (tmp_path / ".lock").write_text('{"pid": 999999, "host": "gone", "since": 0}')  # left by a crash
    with RunLock(tmp_path):
        with pytest.raises(RunLockedError, match=r"in use by another cohort run \(pid \d+ on "):
            RunLock(tmp_path).acquire()
    RunLock(tmp_path).acquire().release()  # released at the end of the block


def test_a_second_training_process_refuses_to_share_the_folder(tiny_model_dir, tmp_path):
    run = tmp_path / "shared"
    holder = RunLock(run).acquire()  # stands in for a live run
    try:
        t = GRPOTrainer(_cfg(tiny_model_dir, run, steps=1))
        with pytest.raises(RunLockedError):
            t.train()
    finally:
        holder.release()
    assert not (run / "metrics.jsonl").exists()


# ------------------------------------------------------------------ 5. errors that name the problem


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("steps: 3\nsteps: 5\n", "key 'steps' is given twice (first on line 1); keep one of them (line 2"),
        ("algo:\n  beta: 0.1\n  beta: 0.2\n", "key 'beta' is given twice"),
        ("model: 5\n", "model is a section; give its keys"),
        ("rollout: [1, 2]\n", "rollout is a section"),
        ("steps: [1\n", "is not valid YAML: while parsing a flow sequence"),
        ("- a\n- b\n", "must hold a mapping of keys to values"),
    ],
)
def test_a_yaml_file_that_means_something_else_is_refused(tmp_path, text, fragment):
    f = tmp_path / "c.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(f)
    assert fragment in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_a_folder_given_as_the_config_file_is_named_as_such(tmp_path):
    (tmp_path / "config.yaml").write_text("steps: 2\n")
    with pytest.raises(ConfigError, match=r"is a folder; pass the path of a YAML file \(e.g. .*config.yaml"):
        load_config(tmp_path)


@pytest.mark.parametrize(
    ("over", "fragment"),
    [
        ({"seed": -1}, "seed=-1 must be in 0 .. 2**32 - 1"),
        ({"seed": 2**40}, "seed=1099511627776 must be in 0 .. 2**32 - 1"),
        ({"data.task_seed": -5}, "data.task_seed=-5 must be in 0 .. 2**32 - 1"),
        ({"out_dir": ""}, "out_dir is empty"),
        ({"model.device": "0"}, "model.device='0' is not a device; use auto, cpu, cuda, cuda:N"),
        ({"model.device": "bogus"}, "model.device='bogus' is not a device"),
        ({"preset": [1]}, "preset=[1] is not known; choose one of: r1"),
        (
            {"eval_every": 2, "data.n_eval": 0},
            "eval_every=2 asks for held-out evaluations, but there are no held-out rows",
        ),
    ],
)
def test_seeds_and_out_dir_are_checked_before_the_model_loads(tmp_path, over, fragment):
    with pytest.raises(ConfigError) as e:
        GRPOTrainer(_cfg("no-model-needed", tmp_path / "o", **over))
    assert fragment in str(e.value), str(e.value)


def test_an_out_dir_that_is_a_file_or_under_one_is_refused(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigError, match=r"out_dir=.*f' is a file; choose a folder"):
        GRPOTrainer(_cfg("no-model-needed", tmp_path / "f"))
    with pytest.raises(ConfigError, match=r"sits under .*f', which is a file"):
        GRPOTrainer(_cfg("no-model-needed", tmp_path / "f" / "run"))
    assert (tmp_path / "f").read_text() == "x"


def test_fewer_prompts_than_a_step_samples_is_a_warning(tiny_model_dir, tmp_path):
    rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"}]
    with pytest.warns(UserWarning, match="has 2 prompts, fewer than the 4 a step samples"):
        GRPOTrainer(_cfg(tiny_model_dir, tmp_path / "few"), train_rows=rows, eval_rows=[])


def test_a_missing_answer_column_names_what_there_is():
    from cohort.rewards import accuracy_reward, check_reward_columns

    with pytest.raises(ValueError, match=r"no column besides the prompt \(which arrives as `prompts`\)"):
        check_reward_columns([accuracy_reward], [])


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["train", "{dir}"], "is a folder; pass the path of a YAML file"),
        (["report", "{file}"], "is a file, not a run directory"),
        (
            ["sample", "--model", "no-such-model", "--task", "addition", "--out", "{dir}"],
            "--out {dir} is a folder",
        ),
        (
            ["generate", "--model", "no-such-model", "--prompt", "hi", "--out", "{dir}"],
            "--out {dir} is a folder",
        ),
        (
            ["sft", "--model", "no-such-model", "--task", "addition", "--out", "{file}"],
            "--out {file} is a file",
        ),
        (["demo", "--out", "{file}"], "--out {file} is a file"),
        (["merge", "{dir}/nope", "{dir}/merged"], "{dir}/nope does not exist"),
        (
            ["eval", "--model", "no-such-model", "--task", "addition", "--split", "bogus"],
            "--split bogus: a built-in task has the splits train, test",
        ),
        (
            ["eval", "--model", "no-such-model", "--data", "{dir}/noans.jsonl"],
            "needs one of the columns ['answer', 'solution'] in --data",
        ),
        (["eval", "--model", "no-such-model"], "give --task NAME"),
        (["train", "model.name_or_path=m", "=5"], "override '=5' has no key before '='"),
    ],
)
def test_cli_paths_of_the_wrong_kind_are_named_before_anything_loads(tmp_path, argv, fragment):
    (tmp_path / "f.txt").write_text("x")
    (tmp_path / "noans.jsonl").write_text('{"prompt": "1+1="}\n')
    fill = {"dir": str(tmp_path), "file": str(tmp_path / "f.txt")}
    proc = subprocess.run(
        [sys.executable, "-m", "cohort.cli", *(a.format(**fill) for a in argv)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2, proc.stderr
    assert fragment.format(**fill) in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_a_non_utf8_byte_names_the_file_and_line(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(DataError, match=r"latin1.jsonl:2: not UTF-8 text \(byte 0xe9 at column 16\)"):
        load_rows(path)


def test_cli_training_errors_are_one_line(tiny_model_dir, tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "cohort.cli",
            "train",
            f"model.name_or_path={tiny_model_dir}",
            "data.task=addition",
            "algo.eps_low=2",
            f"out_dir={tmp_path / 'x'}",
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and proc.stderr.strip().startswith(
        "error: algo.eps_low=2.0 must be in [0, 1)"
    )
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_load_config_rejects_nan_in_yaml(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("model: {name_or_path: m}\ndata: {task: addition}\noptim: {lr: .nan}\n")
    with pytest.raises(ConfigError, match="optim.lr=nan"):
        load_config(f).validate()
    assert math.isnan(load_config(f).optim.lr)


@pytest.mark.parametrize(
    ("source", "spec", "fragment"),
    [
        ("LIMIT = 3\n", "LIMIT", "'LIMIT' is a int, not a function; name a function defined in it"),
        ("def f(:\n", "f", "r.py:1: SyntaxError: invalid syntax; fix the file"),
        (
            "import no_such_pkg_xyz\n",
            "f",
            "importing it raised ModuleNotFoundError: No module named 'no_such_pkg_xyz' at ",
        ),
        ("raise RuntimeError('no key')\n", "f", "importing it raised RuntimeError: no key at "),
        ("def f(completions, /):\n    return []\n", "f", "takes 'completions' as a positional-only argument"),
        ("def f(completions, **kw):\n    return []\n", "", "names no function after the ':'"),
    ],
)
def test_a_reward_file_that_cannot_give_a_function_is_one_line(tmp_path, source, spec, fragment):
    from cohort.rewards import resolve_reward_funcs

    (tmp_path / "r.py").write_text(source)
    with pytest.raises(ValueError) as e:  # ValueError: the command line prints it as one line
        resolve_reward_funcs([f"{tmp_path / 'r.py'}:{spec}"])
    assert fragment in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_rewards_beyond_float32_are_refused_and_huge_ones_still_rank():
    from cohort.algo import combine_rewards, group_advantages

    def huge(completions, **kwargs):
        return [1e39 * i for i in range(len(completions))]

    with pytest.raises(ValueError, match=r"returned 1e\+39 at index 1, beyond float32's range"):
        score([huge], prompts=["p"] * 2, completions=["a", "b"])
    r = torch.tensor([3e38, -3e38, 3e38, -3e38])  # finite, but their squared deviations overflow float32
    for adv in (group_advantages(r, 4), combine_rewards(r[:, None], None, 4, mode="decoupled")):
        assert adv.dtype == torch.float32 and torch.allclose(
            adv, torch.tensor([0.866, -0.866] * 2), atol=1e-3
        )


def test_generation_stays_within_the_context_and_a_prompt_that_fills_it_is_named(tmp_path):
    from cohort.commands.generate import generate_rows
    from cohort.models import build_tiny_model, load_model, load_tokenizer, stop_token_ids
    from cohort.rollout import SamplingParams, make_engine

    folder = build_tiny_model(
        tmp_path / "ctx", hidden_size=32, num_layers=1, num_heads=4, max_position_embeddings=16
    )
    model, tok = load_model(folder), load_tokenizer(folder)
    never_ends = SamplingParams(max_completion_length=50, greedy=True)
    eos, pad = stop_token_ids(model, tok)
    engine, limits = make_engine("builtin", eos_token_ids=eos, pad_token_id=pad), []
    real = engine.generate

    def recording(model, prompt_ids, n, params, generator):
        limits.append((len(prompt_ids[0]), params.max_completion_length))
        return real(model, prompt_ids, n, params, generator)

    engine.generate = recording  # type: ignore[method-assign]
    rows = generate_rows(model, tok, ["1+1=", "1+1=1+1=1+1="], never_ends, engine=engine)
    assert [r["prompt"] for r in rows] == ["1+1=", "1+1=1+1=1+1="]  # order kept
    assert sorted(limits) == [(4, 12), (12, 4)]  # each completion ends where the context does
    with pytest.raises(ValueError, match=r"1 prompt\(s\) \(prompt 1 first, the longest 20 tokens\) fill"):
        generate_rows(model, tok, ["1+1=", "1+1=" * 5], never_ends)


@pytest.mark.parametrize(
    ("fields", "fragment"),
    [
        ({"max_steps": -1, "num_train_epochs": 0}, "num_train_epochs=0) with max_steps=-1 trains nothing"),
        ({"warmup_ratio": 2.0}, "warmup_ratio=2.0) must be in [0, 1]"),
    ],
)
def test_trl_fields_that_would_train_something_else_are_refused(fields, fragment):
    from cohort import GRPOConfig

    args = GRPOConfig(output_dir="o", per_device_train_batch_size=8, num_generations=4, **fields)
    with pytest.raises(ConfigError) as e:
        args.to_train_config("m", 8)
    assert fragment in str(e.value), str(e.value)


def test_trl_step_fractions_count_in_steps():
    from cohort import GRPOConfig

    args = GRPOConfig(
        output_dir="o", max_steps=8, save_steps=0.5, eval_strategy="steps", eval_steps=0.25, logging_steps=0.5
    )
    cfg = args.to_train_config("m", 8)
    assert (cfg.save_every, cfg.eval_every, cfg.logging_steps) == (4, 2, 4)


def test_an_import_error_inside_cohort_is_a_traceback_not_a_user_error(monkeypatch):
    from cohort import cli, config

    def broken():
        raise ImportError("cannot import name 'X' from 'cohort.report'", name="cohort.report")

    monkeypatch.setattr(config, "describe_keys", broken)
    with pytest.raises(ImportError, match="cohort.report"):
        cli.main(["config"])


@pytest.mark.parametrize(
    ("over", "fragment"),
    [
        ({"distributed.backend": "nccl"}, "a one-process run opens no process group"),
        ({"algo.sampler_correction": "token_tis"}, "sampled by the weights being trained"),
        ({"algo.kl_estimator": "k1"}, "algo.beta=0 runs no reference model"),
        ({"algo.scale": "none", "algo.reward_mode": "decoupled"}, "reward_mode=decoupled (GDPO) normalises"),
        (
            {"algo.std": "population", "algo.advantage": "rloo"},
            "algo.advantage='rloo' does not read algo.std",
        ),
        ({"algo.adv_eps": 1e-6, "algo.advantage": "rloo"}, "does not read algo.adv_eps"),
    ],
)
def test_an_option_that_changes_nothing_is_named_with_why(tmp_path, over, fragment):
    from cohort.errors import ConfigWarning

    with pytest.warns(ConfigWarning) as record:
        _cfg("no-model-needed", tmp_path / "o", **over).validate(need_model=False)
    key = next(iter(over))  # the option under test comes first; the others set the scene
    messages = [str(w.message) for w in record if issubclass(w.category, ConfigWarning)]
    assert any(
        m.startswith(f"{key}=") and "changes nothing in this configuration" in m and fragment in m
        for m in messages
    ), messages


def test_options_that_matter_raise_no_config_warning(tmp_path):
    from cohort.errors import ConfigWarning

    over = {
        "algo.beta": 0.04,
        "algo.kl_estimator": "k1",
        "algo.dynamic_sampling": True,
        "algo.max_sampling_rounds": 8,
        "algo.std": "population",
    }
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)
        _cfg("no-model-needed", tmp_path / "o", **over).validate(need_model=False)


def _marking_reward(tmp_path):
    """Returns (a `file.py:function` reward spec whose import writes a marker file, the marker's path)."""
    marker = tmp_path / "imported"
    source = tmp_path / "user_reward.py"
    source.write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n\n"
        "def score(completions, **kwargs):\n    return [0.0] * len(completions)\n"
    )
    return f"{source}:score", marker


@pytest.mark.parametrize("kind", ["reward", "loss", "estimator"])
@pytest.mark.parametrize("case", ["missing data", "bad data", "run exists", "missing model"])
def test_a_refused_run_imports_no_user_code(tiny_model_dir, tmp_path, case, kind):
    spec, marker = _marking_reward(tmp_path)
    key = {"reward": "rewards", "loss": "algo.loss_type", "estimator": "algo.advantage"}[kind]
    over: dict = {key: [spec] if kind == "reward" else spec}
    if case == "missing data":
        over["data"] = {"path": str(tmp_path / "nowhere.jsonl")}
    elif case == "bad data":
        (tmp_path / "d.jsonl").write_text('{"prompt": "a"}\n{"other": 1}\n')
        over["data"] = {"path": str(tmp_path / "d.jsonl")}
    elif case == "run exists":
        (tmp_path / "r").mkdir()
        (tmp_path / "r" / "metrics.jsonl").write_text('{"step": 1}\n')
    else:
        over["model.name_or_path"] = str(tmp_path / "no-model")
    with pytest.raises((ConfigError, DataError, ValueError)):
        GRPOTrainer(_cfg(tiny_model_dir, tmp_path / "r", **over))
    assert not marker.exists(), f"{case}: the {kind} file ran for a run that was refused"


def test_resuming_with_other_rollout_workers_says_they_must_be_back_where_they_were(tiny_model_dir, tmp_path):
    GRPOTrainer(_cfg(tiny_model_dir, tmp_path / "r", steps=1, save_every=1)).train()
    over = {"steps": 2, "resume": "auto", "rollout.workers": ["127.0.0.1:1"]}
    with pytest.raises(ConfigError, match=r"rollout.workers: None -> \['127.0.0.1:1'\].*same addresses"):
        GRPOTrainer(_cfg(tiny_model_dir, tmp_path / "r", **over))
