"""`cohort demo`: the whole R1-style pipeline on a laptop CPU in minutes.

Builds a tiny Qwen2-architecture model with a character tokenizer (saved with save_pretrained and loaded
back with from_pretrained, like any hub model), warm-starts it with a short SFT on the built-in addition
task, measures held-out greedy accuracy, trains it with GRPO on the accuracy reward, measures again,
and writes the run directory (metrics.jsonl, report.html, final model, summary.json).

The recipe below was tuned on a 2-core CPU; the numbers it reaches are in the README.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from cohort.commands.evaluation import evaluate
from cohort.commands.sft import SFTConfig, encode_pairs, sft_train
from cohort.config import OptimConfig, TrainConfig, load_config
from cohort.data import encode_prompts, make_task, sft_completion
from cohort.models import build_tiny_model, load_model, load_tokenizer, stop_token_ids
from cohort.report import quiet_hf_progress, write_report, write_summary
from cohort.rewards import accuracy_reward
from cohort.rollout import make_engine
from cohort.runtime.seeds import seed_globals
from cohort.trainer import GRPOTrainer

DEMO_TASK = "addition"
DEMO_MODEL: dict[str, Any] = {"hidden_size": 128, "num_layers": 2, "num_heads": 4, "intermediate_size": 512}
# Cold start: SFT on worked answers until greedy accuracy on 200 training problems reaches
# DEMO_SFT_TARGET (checked every 25 steps), so GRPO starts from a model that answers roughly a third of
# the problems whatever the seed. The held-out set is never looked at before the GRPO run.
DEMO_SFT = SFTConfig(
    steps=1500,
    batch_size=128,
    optim=OptimConfig(lr=3e-3, warmup_steps=10, weight_decay=0.1, schedule="cosine", adam_beta2=0.999),
    seed=0,
)
DEMO_SFT_TARGET = 0.30
DEMO_GRPO = {
    "data": {"task": DEMO_TASK, "n_train": 4000, "n_eval": 200},
    # Sampling a little hotter than 1 and refilling all-equal groups (DAPO's dynamic sampling) are the two
    # levers that measurably help this task (docs/usage.md, "The demo", has the lever table).
    "rollout": {"group_size": 8, "batch_size": 128, "max_completion_length": 6, "temperature": 1.2},
    "algo": {
        "loss_type": "dapo",
        "beta": 0.0,
        "eps_low": 0.2,
        "eps_high": 0.28,
        "dynamic_sampling": True,
        "max_sampling_rounds": 4,
    },
    "optim": {"lr": 1.5e-4, "warmup_steps": 10, "schedule": "constant", "max_grad_norm": 1.0},
    "rewards": ["accuracy"],
    "steps": 3000,
    "save_every": 1000,
    "eval_every": 500,
}


def demo_config(out_dir: str | Path, model_path: str | Path, *, steps: int | None, seed: int) -> TrainConfig:
    """Return the GRPO config the demo trains with."""
    overrides: dict[str, Any] = json.loads(json.dumps(DEMO_GRPO))
    overrides["model"] = {"name_or_path": str(model_path)}
    overrides["out_dir"] = str(out_dir)
    overrides["seed"] = seed
    if steps is not None:
        overrides["steps"] = steps
    return load_config(None, overrides)


def run_demo(
    out_dir: str | Path = "runs/demo", *, steps: int | None = None, seed: int = 0, progress: bool = True
) -> dict[str, Any]:
    """Return the demo's summary after building, warm-starting, evaluating and GRPO-training a tiny model."""
    with quiet_hf_progress():  # no "Loading weights" / "Writing model shards" bars between the demo's lines
        return _run_demo(out_dir, steps=steps, seed=seed, progress=progress)


def _run_demo(out_dir: str | Path, *, steps: int | None, seed: int, progress: bool) -> dict[str, Any]:
    """Return the demo's summary (run_demo without the progress-bar switch)."""
    t0 = time.perf_counter()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    say = print
    # The demo rebuilds everything from its seed: an earlier demo's run in the same folder is replaced.
    earlier = [
        out / n
        for n in ("metrics.jsonl", "samples.jsonl", "evals.jsonl", "checkpoints")
        if (out / n).exists()
    ]
    if earlier:
        say(f"replacing the earlier demo run in {out}")
        for path in earlier:
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    seed_globals(seed)
    # 1. A tiny model, saved and loaded back exactly like a hub model.
    base = build_tiny_model(out / "base-model", seed=seed, **DEMO_MODEL)
    tokenizer = load_tokenizer(base)
    model = load_model(base)
    n_params = sum(p.numel() for p in model.parameters())
    say(f"[1/4] built a {n_params / 1e6:.2f} M-parameter Qwen2 model with a character tokenizer in {base}")
    # 2. Cold-start SFT on the task's worked answers.
    cfg = demo_config(out, base, steps=steps, seed=seed)
    train_rows, _ = make_task(
        DEMO_TASK, n_train=cfg.data.n_train, n_eval=cfg.data.n_eval, seed=cfg.data.task_seed
    )
    # Validation: 200 of the training problems (never held-out ones).
    val_rows, sft_rows = train_rows[:200], train_rows
    pairs = encode_pairs(
        tokenizer,
        encode_prompts(tokenizer, [r["prompt"] for r in sft_rows]),
        [sft_completion(DEMO_TASK, r) for r in sft_rows],
    )
    sft_cfg = SFTConfig(**{**DEMO_SFT.__dict__, "seed": seed})
    val_ids = encode_prompts(tokenizer, [r["prompt"] for r in val_rows])
    eos_ids, pad = stop_token_ids(model, tokenizer)
    engine = make_engine("builtin", eos_token_ids=eos_ids, pad_token_id=pad)
    val_acc: dict[int, float] = {}

    def reached_target(step: int) -> bool:
        val_acc[step] = evaluate(
            model,
            tokenizer,
            val_rows,
            accuracy_reward,
            prompt_ids=val_ids,
            engine=engine,
            max_completion_length=cfg.rollout.max_completion_length,
        )["accuracy"]
        return val_acc[step] >= DEMO_SFT_TARGET

    hist = sft_train(model, pairs, sft_cfg, stop=reached_target)
    sft_dir = out / "sft-model"
    model.save_pretrained(sft_dir)
    tokenizer.save_pretrained(sft_dir)
    last = max(val_acc) if val_acc else 0
    say(
        f"[2/4] SFT warm start: {hist[-1]['step']} steps (stopped at validation accuracy "
        f"{100 * val_acc.get(last, 0):.0f}% >= {100 * DEMO_SFT_TARGET:.0f}%), loss {hist[-1]['loss']:.3f}, "
        f"{hist[-1]['seconds']:.0f} s"
    )
    # 3. GRPO from the warm start, with held-out greedy accuracy before and after.
    cfg.model.name_or_path = str(sft_dir)
    cfg.progress = progress
    trainer = GRPOTrainer(cfg)
    say(f"[3/4] GRPO: {cfg.steps} steps × {cfg.prompts_per_step} prompts × G={cfg.rollout.group_size}")
    result = trainer.train()
    final = trainer.save_final(out / "final-model")
    # The trainer's summary.json (steps, timing, final metrics), extended with the demo's own keys.
    summary = {
        **result,
        "task": DEMO_TASK,
        "parameters": n_params,
        "accuracy_before": result.get("accuracy_before"),
        "accuracy_after": result.get("accuracy_after"),
        "grpo_steps": result.get("steps"),
        "seconds_grpo": round(result.get("seconds_train", 0.0), 1),
        "sft_steps": hist[-1]["step"],
        "sft_validation_accuracy": val_acc.get(last),
        "seconds_sft": round(hist[-1]["seconds"], 1),
        "seconds_total": round(time.perf_counter() - t0, 1),
        "final_model": str(final),
        "threads": torch.get_num_threads(),
    }
    write_summary(out, summary)

    write_report(out, title="cohort demo")
    say(
        f"[4/4] held-out greedy accuracy: {100 * (summary['accuracy_before'] or 0):.1f}% before GRPO → "
        f"{100 * (summary['accuracy_after'] or 0):.1f}% after, in {summary['seconds_total']:.0f} s total. "
        f"Report: {out / 'report.html'}"
    )
    return summary
