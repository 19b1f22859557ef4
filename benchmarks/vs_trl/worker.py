"""One measurement in a fresh process: train one framework on one workload and write what it took.

Run by `run.py` as ``python benchmarks/vs_trl/worker.py SPEC.json OUT.json``; never imports the other
framework, so the process's peak RSS (VmHWM) is that framework's alone. SPEC keys:
framework (cohort | trl), model, rows (JSONL of {"prompt", "answer"}), group_size, batch_size
(completions per optimizer step), max_completion_length, lr, beta, loss_type, temperature, threads,
steps, seed, reward (token_parity | accuracy), optionally `configs` (a list of overrides run one
after the other in this process, for the sweep) and `cohort_overrides` (config overrides such as
"fast.segments=off", applied to cohort's runs only).

Timing: a step is one generation batch and one optimizer step, measured end to end (for TRL between
consecutive ``on_step_end`` callbacks, so data loading and logging count, as they do for cohort).
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `benchmarks` as a package

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("DISABLE_TQDM", "1")

from benchmarks.common import peak_rss_mib, rss_mib  # noqa: E402

TRL_RUNTIME = {
    "use_cpu": True,
    "bf16": False,
    "fp16": False,
    "gradient_checkpointing": False,  # TRL defaults to True; cohort's model.gradient_checkpointing is off here too
    "report_to": "none",
    "save_strategy": "no",
    "logging_steps": 1,
    "disable_tqdm": True,
    "log_completions": False,
    "dataloader_num_workers": 0,
}
"""GRPOConfig settings every TRL run here shares: float32 on the CPU, no logging, saving or checkpointing."""


def trl_runtime(device: str) -> dict:
    """Returns TRL_RUNTIME for the spec's device: on CUDA, float32 weights under bf16 autocast (cohort's default
    there, `model.bf16_autocast`)."""
    if device == "cpu":
        return dict(TRL_RUNTIME)
    return {**TRL_RUNTIME, "use_cpu": False, "bf16": True}


def peak_gpu_mib() -> float | None:
    """Returns the peak CUDA memory this process allocated in MiB (None without CUDA)."""
    import torch

    return torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None


def read_rows(path: str) -> list[dict]:
    """Return the rows of a JSONL file."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def reward_function(name: str):
    """Return the reward callable a spec names (the same function object both frameworks call)."""
    if name == "token_parity":
        from benchmarks.bench_tasks import token_parity

        return token_parity
    if name == "accuracy":
        from cohort.rewards import accuracy_reward

        return accuracy_reward
    raise ValueError(f"reward={name!r} is not known; use token_parity or accuracy")


def step_record(t_step, t_gen, t_score, prompt_lens, completion_lens, extra=None) -> dict:
    """Return one step's record: timings (s) and the token counts the FLOP floor needs."""
    rec = {
        "step_time": t_step,
        "time_generate": t_gen,
        "time_generate_and_score": t_score,
        "prompt_lengths": prompt_lens,  # one per unique prompt
        "completion_lengths": completion_lens,  # one per completion, EOS included
    }
    rec.update(extra or {})
    return rec


# ------------------------------------------------------------------------------------------- cohort
def cohort_config(spec: dict, base):
    """Returns cohort's TrainConfig `base` with the spec's `cohort_overrides` applied ("key=value" strings
    such as "fast.segments=off"; none: `base` itself)."""
    from cohort.config import load_config

    if not spec.get("cohort_overrides"):
        return base
    return load_config(None, list(spec["cohort_overrides"]), base=base)


def recording(reward, group_size: int, prompt_tokens: dict[str, int], captured: dict):
    """Returns `reward` wrapped to note each step's prompt lengths (tokens, one per group, looked up in
    `prompt_tokens` by prompt text) and completion lengths (EOS included) in `captured`: what the FLOP
    floor needs, read from the reward's own arguments."""

    @functools.wraps(reward)
    def wrapped(prompts, completions, completion_ids, **kwargs):
        captured["prompt_lengths"] = [prompt_tokens[p] for p in prompts[::group_size]]
        captured["completion_lengths"] = [len(c) for c in completion_ids]
        return reward(prompts=prompts, completions=completions, completion_ids=completion_ids, **kwargs)

    return wrapped


def run_cohort(spec: dict, rows: list[dict]) -> list[dict]:
    """Return per-step records of cohort's GRPOTrainer on the spec's workload."""
    from cohort.config import load_config
    from cohort.trainer import GRPOTrainer

    settings = load_config(
        None,
        {
            "model": {"name_or_path": spec["model"], "device": spec.get("device", "cpu")},
            "data": {"task": "addition"},  # placeholder: the rows are passed in directly
            "rollout": {
                "group_size": spec["group_size"],
                "batch_size": spec["batch_size"],
                "max_completion_length": spec["max_completion_length"],
                "temperature": spec["temperature"],
                "engine": "builtin",
            },
            "algo": {"loss_type": spec["loss_type"], "beta": spec["beta"]},
            "optim": {"lr": spec["lr"]},
            "rewards": ["accuracy"],
            "steps": spec["steps"],
            "seed": spec["seed"],
            "out_dir": spec["scratch"],
            "progress": False,
            "eval_at_ends": False,
            "save_every": 0,
            "threads": spec["threads"],
        },
    )
    cfg = cohort_config(spec, settings)
    captured: dict = {}
    prompt_tokens: dict[str, int] = {}  # filled from the trainer's own encoding once it exists
    reward = recording(reward_function(spec["reward"]), spec["group_size"], prompt_tokens, captured)
    trainer = GRPOTrainer(cfg, reward_funcs=[reward], train_rows=rows, eval_rows=[])
    prompt_tokens.update(
        {row["prompt"]: len(ids) for row, ids in zip(trainer.train_rows, trainer.train_prompt_ids)}
    )
    records = []
    for _ in range(spec["steps"]):
        t0 = time.perf_counter()
        m = trainer.step().metrics
        wall = time.perf_counter() - t0
        records.append(
            step_record(
                wall,
                m["time/generate"],
                m["time/generate"] + m["time/score"],
                captured["prompt_lengths"],
                captured["completion_lengths"],
                {
                    "rows_computed_frac": m.get("rows_computed_frac"),
                    "time_update": m["time/update"],
                    "reward": m.get("reward"),
                    "fast_paths": {k.removeprefix("fast/"): v for k, v in m.items() if k.startswith("fast/")},
                },
            )
        )
    return records


# ---------------------------------------------------------------------------------------------- TRL
def run_trl(spec: dict, rows: list[dict]) -> list[dict]:
    """Return per-step records of TRL's GRPOTrainer on the spec's workload, configured to match cohort."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    model = AutoModelForCausalLM.from_pretrained(
        spec["model"], dtype=torch.float32, attn_implementation="sdpa"
    )
    G, N = spec["group_size"], spec["batch_size"]
    args = GRPOConfig(
        output_dir=spec["scratch"],
        # One optimizer step per generation batch of N completions, mu = 1: TRL then skips pi_old.
        per_device_train_batch_size=N,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_iterations=1,
        num_generations=G,
        max_completion_length=spec["max_completion_length"],
        temperature=spec["temperature"],
        top_p=1.0,
        top_k=0,
        beta=spec["beta"],
        loss_type=spec["loss_type"],
        epsilon=0.2,
        scale_rewards="group",
        learning_rate=spec["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        adam_beta1=0.9,
        adam_beta2=0.99,  # cohort's default
        weight_decay=0.0,
        max_grad_norm=1.0,
        max_steps=spec["steps"],
        seed=spec["seed"],
        **trl_runtime(spec.get("device", "cpu")),
    )
    dataset = Dataset.from_list(rows)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[reward_function(spec["reward"])],
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
    )
    timing = {"gen": 0.0, "gen_score": 0.0}
    captured: dict = {}
    # TRL has no public hook around generation and scoring: its own (private) methods are timed.
    generate, generate_and_score = trainer._generate, trainer._generate_and_score_completions

    def timed_generate(prompts):
        t0 = time.perf_counter()
        out = generate(prompts)
        timing["gen"] += time.perf_counter() - t0
        prompt_ids, completion_ids = out[0], out[1]
        # TRL repeats each prompt G times; the FLOP floor counts each unique prompt once.
        captured["prompt_lengths"] = [len(p) for p in prompt_ids[::G]]
        captured["completion_lengths"] = [len(c) for c in completion_ids]
        return out

    def timed_generate_and_score(inputs):
        t0 = time.perf_counter()
        out = generate_and_score(inputs)
        timing["gen_score"] += time.perf_counter() - t0
        return out

    trainer._generate = timed_generate
    trainer._generate_and_score_completions = timed_generate_and_score
    records: list[dict] = []

    class StepTimer(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            now = time.perf_counter()
            records.append(
                step_record(
                    now - self.t,
                    timing["gen"],
                    timing["gen_score"],
                    captured["prompt_lengths"],
                    captured["completion_lengths"],
                    {"time_update": now - self.t - timing["gen_score"]},
                )
            )
            timing["gen"] = timing["gen_score"] = 0.0
            self.t = now

    trainer.add_callback(StepTimer())
    trainer.train()
    return records


# --------------------------------------------------------------------------------- time to accuracy
def greedy_accuracy(model, tokenizer, rows: list[dict], max_len: int) -> float:
    """Return held-out greedy accuracy under the accuracy reward (one evaluator for both frameworks)."""
    from cohort.commands.evaluation import evaluate
    from cohort.data import encode_prompts
    from cohort.rewards import accuracy_reward
    from cohort.rollout import make_engine

    engine = make_engine(
        "builtin", eos_token_ids=[tokenizer.eos_token_id], pad_token_id=tokenizer.pad_token_id
    )
    ids = encode_prompts(tokenizer, [r["prompt"] for r in rows])
    res = evaluate(
        model, tokenizer, rows, accuracy_reward, prompt_ids=ids, engine=engine, max_completion_length=max_len
    )
    return res["accuracy"]


def tta_prepare(spec: dict) -> dict:
    """Return facts about the shared warm start: cohort's demo model, SFT-ed exactly as `cohort demo` does."""
    import inspect

    from cohort.commands import demo
    from cohort.commands.sft import SFTConfig, encode_pairs, sft_train
    from cohort.data import encode_prompts, make_task, sft_completion
    from cohort.models import build_tiny_model, load_model, load_tokenizer
    from cohort.runtime.seeds import seed_globals

    out = Path(spec["out_dir"])
    seed = spec["seed"]
    seed_globals(seed)
    base = build_tiny_model(out / "base-model", seed=seed, **demo.DEMO_MODEL)
    tokenizer, model = load_tokenizer(base), load_model(base)
    cfg = demo.demo_config(out / "unused", base, steps=None, seed=seed)
    L = cfg.rollout.max_completion_length
    train, held = make_task(
        demo.DEMO_TASK, n_train=cfg.data.n_train, n_eval=cfg.data.n_eval, seed=cfg.data.task_seed
    )
    pairs = encode_pairs(
        tokenizer,
        encode_prompts(tokenizer, [r["prompt"] for r in train]),
        [sft_completion(demo.DEMO_TASK, r) for r in train],
    )
    sft_cfg = SFTConfig(**{**demo.DEMO_SFT.__dict__, "seed": seed})
    kwargs = {}
    target = getattr(demo, "DEMO_SFT_TARGET", None)
    if target is not None and "stop" in inspect.signature(sft_train).parameters:
        # The demo stops its warm start at a validation accuracy on training problems; so does this.
        val = train[:200]
        kwargs["stop"] = lambda step: greedy_accuracy(model, tokenizer, val, L) >= target
    t0 = time.perf_counter()
    hist = sft_train(model, pairs, sft_cfg, **kwargs)
    sft_s = time.perf_counter() - t0
    model.save_pretrained(out / "sft-model")
    tokenizer.save_pretrained(out / "sft-model")
    acc = greedy_accuracy(model, tokenizer, held[: cfg.eval_limit], L)
    return {
        "model": demo.DEMO_MODEL,
        "parameters": sum(p.numel() for p in model.parameters()),
        "sft_steps": hist[-1]["step"],
        "sft_target": target,
        "sft_seconds": sft_s,
        "sft_final_loss": hist[-1]["loss"],
        "accuracy": acc,
    }


def tta_config(spec: dict):
    """Return cohort's default (demo) GRPO recipe for the warm-start model, and its train / held-out rows."""
    from cohort.commands.demo import DEMO_TASK, demo_config
    from cohort.data import make_task

    cfg = demo_config(spec["scratch"], spec["model"], steps=spec["max_steps"], seed=spec["seed"])
    cfg.progress, cfg.eval_at_ends, cfg.save_every, cfg.eval_every = False, False, 0, 0
    cfg.threads = spec["threads"]
    if spec["framework"] == "cohort":
        cfg = cohort_config(spec, cfg)
    train, held = make_task(
        DEMO_TASK, n_train=cfg.data.n_train, n_eval=cfg.data.n_eval, seed=cfg.data.task_seed
    )
    return cfg, train, held[: cfg.eval_limit]


def tta_cohort(spec: dict) -> dict:
    """Return cohort's accuracy curve (training seconds, eval excluded) until the target or max_steps."""
    from cohort.trainer import GRPOTrainer

    cfg, train, held = tta_config(spec)
    t0 = time.perf_counter()
    trainer = GRPOTrainer(cfg, train_rows=train, eval_rows=held)
    setup = time.perf_counter() - t0
    L = cfg.rollout.max_completion_length
    curve = [
        {"step": 0, "seconds": 0.0, "accuracy": greedy_accuracy(trainer.model, trainer.tokenizer, held, L)}
    ]
    train_s = 0.0
    for step in range(1, spec["max_steps"] + 1):
        t0 = time.perf_counter()
        trainer.step()
        train_s += time.perf_counter() - t0
        if step % spec["eval_every"] == 0 or train_s > spec["max_seconds"]:
            acc = greedy_accuracy(trainer.model, trainer.tokenizer, held, L)
            curve.append({"step": step, "seconds": train_s, "accuracy": acc})
            if acc >= spec["target"] or train_s > spec["max_seconds"]:
                break
    return tta_result(curve, spec, setup, cfg)


def tta_trl(spec: dict) -> dict:
    """Return TRL's accuracy curve on cohort's recipe, mirrored field by field into GRPOConfig."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from cohort.data import encode_prompts
    from cohort.rewards import accuracy_reward

    cfg, train, held = tta_config(spec)
    r, a, o = cfg.rollout, cfg.algo, cfg.optim
    if a.std != "sample" or a.reward_mode != "sum" or a.filter_zero_std or a.importance != "token":
        raise ValueError(f"the recipe uses options TRL cannot mirror here: {a}")
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    # Both trainers must see the same prompt ids: TRL tokenizes with processing_class(text=...).
    probe = [row["prompt"] for row in train[:16]]
    if tokenizer(text=probe)["input_ids"] != encode_prompts(tokenizer, probe):
        raise ValueError("TRL and cohort tokenize the prompts differently; the comparison would be unfair")
    model = AutoModelForCausalLM.from_pretrained(
        spec["model"], dtype=torch.float32, attn_implementation="sdpa"
    )
    schedule = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}[o.schedule]
    per_step = r.batch_size // a.num_minibatches
    args = GRPOConfig(
        output_dir=spec["scratch"],
        per_device_train_batch_size=per_step,
        gradient_accumulation_steps=1,
        steps_per_generation=a.num_minibatches,
        num_iterations=a.num_iterations,
        num_generations=r.group_size,
        max_completion_length=r.max_completion_length,
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        beta=a.beta,
        loss_type=a.loss_type,
        epsilon=a.eps_low,
        epsilon_high=a.eps_high,
        delta=a.delta,
        scale_rewards=a.scale,
        mask_truncated_completions=a.mask_truncated,
        learning_rate=o.lr,
        lr_scheduler_type=schedule,
        warmup_steps=o.warmup_steps,
        adam_beta1=o.adam_beta1,
        adam_beta2=o.adam_beta2,
        weight_decay=o.weight_decay,
        max_grad_norm=o.max_grad_norm,
        max_steps=spec["max_steps"] * a.num_iterations * a.num_minibatches,
        seed=spec["seed"],
        **TRL_RUNTIME,
    )
    t0 = time.perf_counter()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[accuracy_reward],
        args=args,
        train_dataset=Dataset.from_list([{"prompt": x["prompt"], "answer": x["answer"]} for x in train]),
        processing_class=tokenizer,
    )
    setup = time.perf_counter() - t0
    L = r.max_completion_length
    curve = [{"step": 0, "seconds": 0.0, "accuracy": greedy_accuracy(model, tokenizer, held, L)}]
    updates_per_gen = a.num_iterations * a.num_minibatches

    class EvalEvery(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            self.train_s, self.t = 0.0, time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            now = time.perf_counter()
            self.train_s += now - self.t
            gen_step = state.global_step // updates_per_gen
            over = self.train_s > spec["max_seconds"]
            if state.global_step % updates_per_gen == 0 and (gen_step % spec["eval_every"] == 0 or over):
                acc = greedy_accuracy(trainer.model, tokenizer, held, L)
                curve.append({"step": gen_step, "seconds": self.train_s, "accuracy": acc})
                if acc >= spec["target"] or over:
                    control.should_training_stop = True
            self.t = time.perf_counter()  # evaluation time is not training time

    trainer.add_callback(EvalEvery())
    trainer.train()
    return tta_result(curve, spec, setup, cfg)


def tta_result(curve: list[dict], spec: dict, setup: float, cfg) -> dict:
    """Return the curve with the first (seconds, step) at which accuracy reached the target."""
    hit = next((c for c in curve if c["accuracy"] >= spec["target"]), None)
    last = curve[-1]
    return {
        "curve": curve,
        "seconds_to_target": hit["seconds"] if hit else None,
        "steps_to_target": hit["step"] if hit else None,
        "seconds_trained": last["seconds"],
        "steps_trained": last["step"],
        "seconds_per_step": last["seconds"] / max(last["step"], 1),
        "setup_seconds": setup,
        "final_accuracy": last["accuracy"],
        "recipe": {
            "group_size": cfg.rollout.group_size,
            "batch_size": cfg.rollout.batch_size,
            "max_completion_length": cfg.rollout.max_completion_length,
            "loss_type": cfg.algo.loss_type,
            "eps": [cfg.algo.eps_low, cfg.algo.eps_high],
            "beta": cfg.algo.beta,
            "lr": cfg.optim.lr,
            "warmup_steps": cfg.optim.warmup_steps,
            "schedule": cfg.optim.schedule,
        },
    }


def main() -> None:
    """Run the spec in argv[1] and write the result JSON to argv[2]."""
    spec = json.loads(Path(sys.argv[1]).read_text())
    baseline = rss_mib()
    import torch

    torch.set_num_threads(spec["threads"])
    torch.manual_seed(spec["seed"])
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    framework = spec["framework"]
    mode = spec.get("mode", "speed")
    if mode != "speed":
        t0 = time.perf_counter()
        runner = {
            "tta_prepare": lambda sp: tta_prepare(sp),
            "tta": tta_cohort if framework == "cohort" else tta_trl,
        }[mode]
        result = runner(spec)
        out = {
            "framework": framework,
            "spec": spec,
            "runs": [result],
            "peak_rss_mib": peak_rss_mib(),
            "rss_after_import_mib": rss_mib(),
            "seconds_total": time.perf_counter() - t0,
        }
        Path(sys.argv[2]).write_text(json.dumps(out))
        return
    rows = read_rows(spec["rows"])
    if framework == "cohort":
        import cohort.trainer  # noqa: F401  (import cost counts in the baseline, as TRL's does)
    else:
        import trl  # noqa: F401
    after_import = rss_mib()
    runner = run_cohort if framework == "cohort" else run_trl
    results = []
    t0 = time.perf_counter()
    for override in spec.get("configs") or [{}]:
        sub = {**spec, **override}
        torch.manual_seed(sub["seed"])
        t_cfg = time.perf_counter()
        records = runner(sub, rows)
        results.append({"override": override, "steps": records, "seconds": time.perf_counter() - t_cfg})
    out = {
        "framework": framework,
        "spec": spec,
        "runs": results,
        "rss_start_mib": baseline,
        "rss_after_import_mib": after_import,
        "peak_rss_mib": peak_rss_mib(),
        "peak_gpu_mib": peak_gpu_mib(),
        "seconds_total": time.perf_counter() - t0,
        "threads": torch.get_num_threads(),
    }
    Path(sys.argv[2]).write_text(json.dumps(out))


if __name__ == "__main__":
    main()
