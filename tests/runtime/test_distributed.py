"""cohort train under torchrun (gloo, CPU): replicated and sharded (FSDP2) runs, sharded checkpoints that resume
exactly and on other process counts, the consolidated final model, LoRA."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

REWARD = str(Path(__file__).parents[1] / "digit_reward.py") + ":digit_fraction"
PARITY = str(Path(__file__).parents[1] / "digit_reward.py") + ":first_char_parity"


@pytest.fixture(autouse=True)
def _processes_on_the_cpu(monkeypatch):
    """The launched processes see no GPU: these tests are about gloo on the CPU (one GPU cannot host two ranks)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


def test_more_processes_than_gpus_is_one_clear_error_before_the_process_group(monkeypatch):
    from cohort.errors import ConfigError
    from cohort.runtime import distributed

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(distributed.tdist, "is_initialized", lambda: False)
    monkeypatch.setattr(distributed.tdist, "init_process_group", lambda **kw: pytest.fail("group started"))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(ConfigError, match=r"LOCAL_RANK=1 but only 1 CUDA GPU\(s\) are visible") as e:
        distributed.init_from_env()
    assert "--gpus-per-task" in str(e.value) and "LOCAL_RANK=0" in str(
        e.value
    )  # the launcher-binding way out
    monkeypatch.setenv("LOCAL_RANK", "0")
    distributed.check_local_gpu()  # local rank 0 has its GPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("LOCAL_RANK", "5")
    distributed.check_local_gpu()  # no CUDA: gloo processes on the CPU, any number


def test_collectives_wait_longer_than_rollout_workers_may_hold_process_0(monkeypatch):
    """NCCL's default collective timeout (10 minutes) is no longer than one rollout worker's timeout, while process 0
    may wait for a push's acknowledgement and then its transfer, worker after worker: the group gets room for that."""
    from datetime import timedelta

    from cohort.runtime import distributed

    assert distributed.collective_timeout(600.0, 0) == 1800.0  # gloo's own default: the floor
    assert distributed.collective_timeout(600.0, 1) == 1800.0
    assert distributed.collective_timeout(600.0, 4) == 2 * 600 * 4 + 300
    assert distributed.collective_timeout(30.0, 2) == 1800.0
    made: list = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(distributed.tdist, "is_initialized", lambda: False)
    monkeypatch.setattr(distributed.tdist, "init_process_group", lambda **kw: made.append(kw))
    monkeypatch.setattr(distributed.atexit, "register", lambda fn: None)
    monkeypatch.setenv("WORLD_SIZE", "2")
    distributed.init_from_env("auto", 2700.0)
    distributed.init_from_env("gloo")
    assert made == [{"backend": "gloo", "timeout": timedelta(seconds=2700.0)}, {"backend": "gloo"}]


def _small_run(model_dir: Path, out: Path) -> list[str]:
    """Returns the overrides of a small run on the tiny model (a few seconds a step on one thread)."""
    return [
        f"model.name_or_path={model_dir}",
        "data.task=addition",
        "data.n_train=64",
        "data.n_eval=8",
        "rollout.group_size=4",
        "rollout.batch_size=8",
        "rollout.max_completion_length=5",
        "optim.lr=1e-3",
        "model.device=cpu",  # gloo processes on the CPU, also where a GPU is visible (_processes_on_the_cpu)
        "progress=false",
        "eval_at_ends=false",
        "threads=1",
        f"out_dir={out}",
    ]


def _torchrun(model_dir: Path, out: Path, port: int, *overrides: str, nproc: int = 2) -> list[dict]:
    """Returns metrics.jsonl's rows after `cohort train` on `nproc` processes (a small run on the tiny model)."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        "--master-port",
        str(port),
        "-m",
        "cohort.cli",
        "train",
        *_small_run(model_dir, out),
        "save_every=0",
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


def _weights(folder: Path) -> dict:
    return load_file(str(folder / "model.safetensors"))


@pytest.mark.slow
def test_fsdp_checkpoints_resume_exactly_and_on_other_process_counts(tiny_model_dir, tmp_path):
    common = (
        f"rewards=['{REWARD}']",
        "distributed.strategy=fsdp",
        "algo.beta=0.04",
        "algo.ref_update_every=1",  # the reference moves: its shards are state too
        "save_every=1",
        "keep_checkpoints=3",
    )
    # A: two steps in one go. B: one step, then resumed for the second, on the same two processes.
    a_rows = _torchrun(tiny_model_dir, tmp_path / "a", 29551, *common, "steps=2")
    _torchrun(tiny_model_dir, tmp_path / "b", 29552, *common, "steps=1")
    b_rows = _torchrun(tiny_model_dir, tmp_path / "b", 29553, *common, "steps=2", "resume=auto")
    ckpt = tmp_path / "a" / "checkpoints" / "step-2"
    assert (ckpt / "sharded" / ".metadata").is_file()
    assert (ckpt / "rank-0.pt").is_file() and (ckpt / "rank-1.pt").is_file()
    assert not (ckpt / "model.safetensors").exists()  # the weights live in the shards only
    final_a, final_b = _weights(tmp_path / "a" / "final"), _weights(tmp_path / "b" / "final")
    assert final_a.keys() == final_b.keys()
    assert all(torch.equal(final_a[k], final_b[k]) for k in final_a)
    assert [r["reward"] for r in a_rows] == [r["reward"] for r in b_rows]
    assert [r["loss"] for r in a_rows] == [r["loss"] for r in b_rows]
    # The consolidated final model is a plain transformers folder with the trained weights.
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "a" / "final")
    start = _weights(Path(tiny_model_dir))
    assert any(not torch.equal(final_a[k], start[k]) for k in final_a)
    assert all(torch.equal(plain.state_dict()[k], final_a[k]) for k in final_a)

    # On one process: the two processes' shards load into a whole model equal to the consolidated one.
    from cohort.config import load_config
    from cohort.trainer import GRPOTrainer

    cfg = load_config(
        None, [*_small_run(tiny_model_dir, tmp_path / "one"), f"resume={ckpt}", "steps=3", *common]
    )
    cfg.distributed.strategy = "auto"
    trainer = GRPOTrainer(cfg)
    assert trainer.step_idx == 2
    state = trainer.model.state_dict()
    assert all(torch.equal(state[k], final_a[k]) for k in final_a)
    assert trainer.reference is not None and trainer.reference.syncs == 2
    moments = [s["exp_avg"] for s in trainer.optimizer.state.values()]
    assert moments and all(m.abs().sum() > 0 for m in moments)  # AdamW's state came with the shards
    assert trainer.scheduler.last_epoch == 2
    trainer.train()
    assert trainer.step_idx == 3

    # On three processes: resharded 2 -> 3, one more step.
    c_rows = _torchrun(tiny_model_dir, tmp_path / "c", 29554, *common, f"resume={ckpt}", "steps=3", nproc=3)
    assert [r["step"] for r in c_rows] == [3]


@pytest.mark.slow
def test_fsdp_lora_with_checkpointing_trains_resumes_and_saves_an_adapter(tiny_model_dir, tmp_path):
    common = (
        f"rewards=['{REWARD}']",
        "distributed.strategy=fsdp",
        "model.lora.enabled=true",
        "model.lora.r=4",
        "model.gradient_checkpointing=true",
        "algo.beta=0.04",  # the reference is the base with the adapter off
        "save_every=1",
    )
    _torchrun(tiny_model_dir, tmp_path / "a", 29561, *common, "steps=1")
    rows = _torchrun(tiny_model_dir, tmp_path / "a", 29562, *common, "steps=2", "resume=auto")
    assert [r["step"] for r in rows] == [1, 2]
    from peft import AutoPeftModelForCausalLM

    model = AutoPeftModelForCausalLM.from_pretrained(tmp_path / "a" / "final")
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert lora_b and any(p.abs().sum() > 0 for p in lora_b)  # trained: B starts at zero


@pytest.mark.slow
def test_resuming_shards_into_another_model_is_one_clear_error(tiny_model_dir, tmp_path):
    _torchrun(
        tiny_model_dir, tmp_path / "a", 29571, f"rewards=['{REWARD}']", "distributed.strategy=fsdp", "steps=1"
    )
    from cohort.config import load_config
    from cohort.errors import TrainingError
    from cohort.models import build_tiny_model
    from cohort.trainer import GRPOTrainer

    other = build_tiny_model(tmp_path / "other", hidden_size=48, num_layers=2, num_heads=4, seed=0)
    step1 = tmp_path / "a" / "checkpoints" / "step-1"
    overrides = [*_small_run(other, tmp_path / "b"), f"resume={step1}", "steps=2", "allow_config_change=true"]
    cfg = load_config(None, overrides)
    with pytest.raises(TrainingError, match="holds a different model"):
        GRPOTrainer(cfg)


@pytest.mark.slow
def test_a_one_process_checkpoint_resumes_sharded(tiny_model_dir, tmp_path):
    common = [*_small_run(tiny_model_dir, tmp_path / "a"), f"rewards=['{REWARD}']"]
    proc = subprocess.run(
        [sys.executable, "-m", "cohort.cli", "train", *common, "steps=1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    one = load_file(str(tmp_path / "a" / "checkpoints" / "step-1" / "model.safetensors"))
    rows = _torchrun(
        tiny_model_dir, tmp_path / "a", 29581, f"rewards=['{REWARD}']", "distributed.strategy=fsdp", "steps=2",
        "resume=auto",
    )  # fmt: skip
    assert [r["step"] for r in rows] == [1, 2]
    # The sharded run started from the one-process weights and AdamW state: one more optimizer step on both.
    final = _weights(tmp_path / "a" / "final")
    assert final.keys() == one.keys()
    assert max((final[k] - one[k]).abs().max().item() for k in one) < 0.05
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(tmp_path / "a" / "checkpoints" / "step-2" / "sharded", tmp_path / "step2.pt")
    state = torch.load(tmp_path / "step2.pt", weights_only=False)["optimizer"]["state"]
    assert state and all(float(s["step"]) == 2.0 for s in state.values())  # 1 from the checkpoint, then 1


@pytest.mark.slow
def test_sigterm_stops_every_process_at_one_step_boundary_with_a_checkpoint(tiny_model_dir, tmp_path):
    import signal
    import time

    out = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29591",
        "-m", "cohort.cli", "train", *_small_run(tiny_model_dir, out), "save_every=0", "steps=500",
        f"rewards=['{REWARD}']", "distributed.strategy=fsdp",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and (
        not metrics.is_file() or len(metrics.read_text().splitlines()) < 3
    ):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)  # torchrun passes it to both workers
    _, err = proc.communicate(timeout=300)
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    done = rows[-1]["step"]
    assert 3 <= done < 500, err[-2000:]
    ckpt = out / "checkpoints" / f"step-{done}"
    assert (ckpt / "sharded" / ".metadata").is_file(), err[-3000:]  # the step boundary both processes reached
    assert (ckpt / "rank-0.pt").is_file() and (ckpt / "rank-1.pt").is_file()
    resumed = _torchrun(tiny_model_dir, out, 29592, f"rewards=['{REWARD}']", "distributed.strategy=fsdp",
                        f"steps={done + 1}", "resume=auto")  # fmt: skip
    assert [r["step"] for r in resumed] == list(range(1, done + 2))


@pytest.mark.slow
def test_fsdp_with_dynamic_sampling_where_processes_need_different_rounds(tiny_model_dir, tmp_path):
    # Each process refills its own share: one may sample 3 rounds while the other samples 2. The weights stay
    # gathered over all of a step's rounds, so the processes' unshard collectives still pair up.
    rows = _torchrun(
        tiny_model_dir, tmp_path / "a", 29601, f"rewards=['{PARITY}']", "distributed.strategy=fsdp",
        "algo.dynamic_sampling=true", "steps=4", "seed=3",
    )  # fmt: skip
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["sampling/groups_kept"] <= 4 and r["sampling/rounds"] >= 1 for r in rows)
    assert max(r["sampling/rounds"] for r in rows) > 1  # refills happened


@pytest.mark.slow
def test_a_full_disk_under_a_sharded_checkpoint_is_one_line_from_process_0(tiny_model_dir, tmp_path):
    import torch.multiprocessing as mp
    from _rank_workers import full_disk_case

    mp.spawn(
        full_disk_case,
        args=(2, str(tmp_path / "store"), str(tmp_path), str(tiny_model_dir)),
        nprocs=2,
        join=True,
    )
    (code0, err0), (code1, err1) = (torch.load(tmp_path / f"full-{r}.pt") for r in (0, 1))
    said = [line for line in err0.splitlines() if line.startswith("error:")]
    assert code0 != 0 and len(said) == 1 and "Traceback" not in err0, err0
    assert said[0].startswith(
        "error: training process 1 of 2: no space left on device while writing the checkpoint"
    )
    assert str(tmp_path / "run" / "checkpoints") in said[0] and "resume=auto" in said[0]
    assert code1 == 1 and "error:" not in err1 and "Traceback" not in err1, err1  # told once, by process 0
    assert not (tmp_path / "run" / "checkpoints" / ".tmp-step-1").exists()
