"""At rollout.max_staleness 0 a run whose completions come from one rollout worker is the in-process run, to the
bit: the same metrics rows (timings aside) and the same final weights. Guards the generator-state round trip,
the weight push (every tensor, every step) and the RolloutBatch's transport (log-probs as raw float32 bytes)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from _serve_helpers import run_config

from cohort.serve import weights
from cohort.trainer import GRPOTrainer


def _rows_of(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _rows(out):
    return _rows_of(out / "metrics.jsonl")


def _same(a, b) -> bool:
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


def test_one_local_worker_equals_the_in_process_run(tiny_model_dir, tmp_path):
    # Held-out evaluations at both ends and at step 2, sampled by the worker too.
    ev = {"eval_every": 2, "eval_at_ends": True}
    plain = GRPOTrainer(run_config(tiny_model_dir, tmp_path / "plain", **ev))
    plain.train()
    remote = GRPOTrainer(run_config(tiny_model_dir, tmp_path / "remote", **{"rollout.workers": 1, **ev}))
    try:
        assert remote.remote is not None and len(remote.remote.live) == 1
        remote.train()
    finally:
        if remote.remote is not None:
            remote.remote.close()
    a, b = _rows(tmp_path / "plain"), _rows(tmp_path / "remote")
    assert len(a) == len(b) == 3
    evals = [_rows_of(tmp_path / run / "evals.jsonl") for run in ("plain", "remote")]
    assert len(evals[0]) == len(evals[1]) == 3
    for ea, eb in zip(*evals):
        assert "accuracy" in str(ea)
        assert {k: v for k, v in ea.items() if "time" not in k} == {
            k: v for k, v in eb.items() if "time" not in k
        }
    for ra, rb in zip(a, b):
        extra = set(rb) - set(ra)
        assert extra == {"serve/workers", "time/weight_push"}, extra
        assert rb["serve/workers"] == 1.0
        differ = [k for k in ra if not k.startswith("time") and k != "step_time" and not _same(ra[k], rb[k])]
        assert not differ, {k: (ra[k], rb[k]) for k in differ}
    wa, wb = plain.model.state_dict(), remote.model.state_dict()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert any(
        not torch.equal(wa[k], plain_init.to(wa[k].device))
        for k, plain_init in _initial(tiny_model_dir).items()
    )


def _initial(model_dir):
    from cohort.models import load_model

    return load_model(model_dir).state_dict()


def test_lora_pushes_only_the_adapter_and_stays_exact(tiny_model_dir, tmp_path):
    pytest.importorskip("peft")
    over = {
        "model.lora.enabled": True,
        "model.lora.r": 4,
        "model.lora.alpha": 8,
        "optim.lr": 5e-2,
        "steps": 2,
    }
    plain = GRPOTrainer(run_config(tiny_model_dir, tmp_path / "plain", **over))
    plain.train()
    remote = GRPOTrainer(run_config(tiny_model_dir, tmp_path / "remote", **over, **{"rollout.workers": 1}))
    try:
        sent = weights.push_tensors(remote.model, full=False)
        assert sent and all("lora_" in name for name, _ in sent)
        remote.train()
    finally:
        if remote.remote is not None:
            remote.remote.close()
    a, b = _rows(tmp_path / "plain"), _rows(tmp_path / "remote")
    for ra, rb in zip(a, b):
        differ = [k for k in ra if not k.startswith("time") and k != "step_time" and not _same(ra[k], rb[k])]
        assert not differ, {k: (ra[k], rb[k]) for k in differ}
    wa, wb = plain.model.state_dict(), remote.model.state_dict()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_a_worker_samples_under_the_autocast_the_trainer_names(tiny_model_dir):
    # On a GPU the trainer samples in-process under bf16 autocast; a worker told so in the hello does the same, so
    # its log-probs are in-process sampling's (without, they sat 1e-3 apart on an H200 and the exact run differed).
    from cohort.models import load_model, load_tokenizer
    from cohort.serve.backend import BuiltinBackend

    model, tokenizer = load_model(tiny_model_dir), load_tokenizer(tiny_model_dir)
    cpu = BuiltinBackend(model, tokenizer, torch.device("cpu"))
    cpu.hello({"engine": "builtin", "autocast": "bfloat16"})
    assert cpu.autocast is None  # the trainer autocasts on CUDA only: a CPU worker samples as it does
    with pytest.raises(ValueError, match="no torch dtype"):
        cpu.hello({"engine": "builtin", "autocast": "float77"})
    if torch.cuda.is_available():
        gpu = BuiltinBackend(model.to("cuda"), tokenizer, torch.device("cuda"))
        gpu.hello({"engine": "builtin", "autocast": "bfloat16"})
        assert gpu.autocast is torch.bfloat16
        gpu.hello({"engine": "builtin", "autocast": None})
        assert gpu.autocast is None
