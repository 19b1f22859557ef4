"""End-to-end: the real `cohort` command line on a tiny model, asserting on what the run logged."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

REWARD = str(Path(__file__).parent / "digit_reward.py") + ":digit_fraction"
REQUIRED = [
    "step",
    "reward",
    "reward_std",
    "rewards/digit_fraction/mean",
    "rewards/digit_fraction/std",
    "kl",
    "clip_ratio/region_mean",
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "completions/mean_length",
    "completions/clipped_ratio",
    "num_tokens",
    "frac_reward_zero_std",
    "entropy",
    "step_time",
    "loss",
    "grad_norm",
]


def _cohort(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "cohort.cli", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=600,
    )


@pytest.mark.slow
def test_train_cli_learns_an_easy_reward(tiny_model_dir, tmp_path):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(
        f"model: {{name_or_path: {tiny_model_dir}}}\n"
        "data: {task: addition, n_train: 200, n_eval: 16}\n"
        "rollout: {group_size: 8, batch_size: 64, max_completion_length: 8}\n"
        "algo: {loss_type: dapo, beta: 0.02}\n"
        "optim: {lr: 1.0e-2, warmup_steps: 2}\n"
        f"rewards: ['{REWARD}']\n"
        "steps: 25\nsave_every: 10\nprogress: false\nthreads: 2\n"
    )
    out = tmp_path / "run"
    proc = _cohort("train", cfg, f"out_dir={out}", "eval_at_ends=false")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 26))
    for key in REQUIRED:
        assert key in rows[0], key
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["kl"]) for r in rows)
    first = sum(r["reward"] for r in rows[:5]) / 5
    last = sum(r["reward"] for r in rows[-5:]) / 5
    # Digits are ~4 % of random characters at the start; measured 0.93-0.96 after 25 steps (seeds 0-2, 1 and 2
    # threads), against 0.16 at lr 3e-3, whose margin over a +0.1 check was too thin to hold on every CPU.
    assert last > first + 0.4, (first, last)
    before = load_file(str(Path(tiny_model_dir) / "model.safetensors"))
    after = load_file(str(out / "final" / "model.safetensors"))
    assert any(not (before[k] == after[k]).all() for k in before)
    assert (out / "report.html").is_file() and (out / "config.yaml").is_file()
    assert (out / "checkpoints" / "step-25" / "trainer_state.pt").is_file()
    # the report can be rebuilt from the run directory alone
    assert _cohort("report", out).returncode == 0


def test_cli_errors_are_clear(tmp_path, tiny_model_dir):
    proc = _cohort(
        "train", f"model.name_or_path={tiny_model_dir}", "data.task=addition", "rollout.group_size=1"
    )
    assert proc.returncode == 2 and "group_size" in proc.stderr and "at least 2" in proc.stderr
    proc = _cohort("train", f"model.name_or_path={tiny_model_dir}", "data.task=addition", "algo.bogus=1")
    assert (
        proc.returncode == 2
        and "unknown config key 'algo.bogus'" in proc.stderr
        and "algo.loss_type" in proc.stderr
    )
    proc = _cohort("train", "model.name_or_path=x", "data.task=addition", "preset=nope")
    assert proc.returncode == 2 and "r1, dapo, dr_grpo" in proc.stderr
    proc = _cohort("report", tmp_path / "nothing-here")
    assert proc.returncode == 2 and "does not exist" in proc.stderr


@pytest.mark.slow
def test_sft_eval_sample_commands(tiny_model_dir, tmp_path):
    sft_out = tmp_path / "sft"
    proc = _cohort(
        "sft",
        "--model",
        tiny_model_dir,
        "--task",
        "addition",
        "--n",
        64,
        "--steps",
        5,
        "--lr",
        "1e-3",
        "--out",
        sft_out,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (
        "Loading weights" not in proc.stderr and "Writing model shards" not in proc.stderr
    )  # cohort's lines only
    proc = _cohort(
        "eval",
        "--model",
        sft_out,
        "--task",
        "addition",
        "--split",
        "test",
        "--n",
        16,
        "--k",
        4,
        "--max-completion-length",
        6,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (
        "Loading weights" not in proc.stderr and "Writing model shards" not in proc.stderr
    )  # cohort's lines only
    result = json.loads(proc.stdout[proc.stdout.index("{") :])
    assert {"accuracy", "pass@4", "maj@4", "n"} <= set(result) and 0 <= result["pass@4"] <= 1
    proc = _cohort(
        "sample",
        "--model",
        sft_out,
        "--task",
        "addition",
        "--n",
        8,
        "--k",
        2,
        "--max-completion-length",
        4,
        "--reward",
        REWARD,
        "--threshold",
        "0.0",
        "--out",
        tmp_path / "s.jsonl",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (
        "Loading weights" not in proc.stderr and "Writing model shards" not in proc.stderr
    )  # cohort's lines only
    lines = (tmp_path / "s.jsonl").read_text().splitlines()
    assert len(lines) == 8 and "completion" in json.loads(lines[0])


def test_eval_sample_and_merge_take_a_lora_adapter_folder(tmp_path, monkeypatch, capsys):
    """The LoRA round trip on the command line (in process): an adapter folder, whose base is recorded as a
    relative path where it was trained, evaluates and samples from elsewhere, and merges into a plain folder."""
    pytest.importorskip("peft")
    import torch
    from transformers import AutoModelForCausalLM

    from cohort.cli import main
    from cohort.config import LoraConfig
    from cohort.models import build_tiny_model, load_model

    monkeypatch.chdir(tmp_path)
    build_tiny_model("base", hidden_size=32, num_layers=1, num_heads=4, seed=1)
    model = load_model("base", lora=LoraConfig(r=2, target_modules=["q_proj", "v_proj"])).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.fill_(0.05)
    model.save_pretrained("run/final")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    adapter = str(tmp_path / "run" / "final")
    common = ["--task", "addition", "--n", 4, "--max-completion-length", 4]
    assert main(["eval", "--model", adapter, "--split", "test", *map(str, common)]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["n"] == 4 and 0 <= result["accuracy"] <= 1
    out = tmp_path / "s.jsonl"
    args = ["sample", "--model", adapter, *map(str, common), "--k", "2", "--reward", REWARD]
    assert main([*args, "--threshold", "0.0", "--out", str(out)]) == 0
    assert len(out.read_text().splitlines()) == 4

    for over in (adapter, str(tmp_path / "run")):  # over the adapter it reads, or its parent: refused
        assert main(["merge", adapter, over]) == 2
        assert "would write the merged model over the adapter folder" in capsys.readouterr().err
    assert (tmp_path / "run" / "final" / "adapter_config.json").is_file()
    assert main(["merge", adapter, str(tmp_path / "merged")]) == 0
    assert "saved the merged model" in capsys.readouterr().out
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    ids = torch.tensor([[5, 6, 76, 7, 8, 84]])
    with torch.no_grad():
        torch.testing.assert_close(plain(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)
    capsys.readouterr()
    # user errors: exit code 2 and one line on stderr
    assert main(["merge", str(tmp_path / "merged"), str(tmp_path / "again")]) == 2
    assert "not a LoRA adapter folder" in capsys.readouterr().err
    assert main(["sft", "--model", adapter, "--task", "addition", "--out", str(tmp_path / "sft")]) == 2
    assert "merge it into its base model first" in capsys.readouterr().err


def test_a_torchrun_process_exits_with_its_code_after_its_exit_handlers():
    """Under torchrun (WORLD_SIZE > 1) the CLI skips the interpreter's teardown, where gloo's threads can abort a
    finished run; its exit handlers still run and its output still arrives."""
    script = (
        "import atexit, sys\n"
        "atexit.register(lambda: print('handler ran', flush=True))\n"
        "from cohort.cli import main\n"
        "sys.exit(main(['config', 'algo.beta']))\n"
    )
    env = {**os.environ, "WORLD_SIZE": "2"}
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "beta" in proc.stdout and proc.stdout.rstrip().endswith("handler ran")


def test_sample_says_what_it_wrote_and_which_folders_it_made(tiny_model_dir, tmp_path, capsys):
    from cohort.cli import main

    out = tmp_path / "new" / "deeper" / "kept.jsonl"
    common = ["sample", "--model", str(tiny_model_dir), "--task", "addition", "--n", "2", "--k", "1"]
    common += ["--max-completion-length", "2", "--reward", REWARD]
    # No completion can score 2 (a digit share is at most 1): the file is written, empty, and said to be.
    assert main([*common, "--threshold", "2", "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert out.is_file() and out.read_text() == ""
    assert "kept 0 of 2 prompts" in said and f"wrote {out} with no rows (lower --threshold" in said
    assert f"created the folder {tmp_path / 'new'}" in said
    # An existing folder is not announced; the earlier file is replaced whole.
    assert main([*common, "--threshold", "0", "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert "kept 2 of 2" in said and "created the folder" not in said
    assert len(out.read_text().splitlines()) == 2


def test_eval_and_sample_draw_with_a_generator_on_the_models_device(tiny_model_dir, tmp_path, monkeypatch):
    """The builtin engine refuses a generator on another device than the model's: `cohort eval` and `cohort sample`
    made theirs on the CPU whatever --device said, so both failed on a GPU. The device a model is on is made to
    read as a GPU here; the generator is asked for on it."""
    import torch

    import cohort.models
    from cohort.cli import main

    asked: list = []
    real = torch.Generator

    class Generator:
        def __new__(cls, device="cpu"):
            asked.append(str(device))
            return real()

    monkeypatch.setattr(cohort.models, "input_device", lambda model: torch.device("cuda", 0))
    monkeypatch.setattr(torch, "Generator", Generator)
    common = [
        "--model",
        str(tiny_model_dir),
        "--task",
        "addition",
        "--n",
        "2",
        "--max-completion-length",
        "4",
    ]
    assert main(["eval", *common]) == 0
    assert main(["sample", *common, "--k", "1", "--out", str(tmp_path / "s.jsonl")]) == 0
    assert asked.count("cuda:0") == 2, asked
