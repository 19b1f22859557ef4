"""cohort vs TRL's GRPOTrainer on one GRPO step of Qwen2.5-0.5B's shape, in both precisions, on one GPU.

    python benchmarks/gpu/grpo_vs_trl.py --out grpo.json                            # on a GPU
    python benchmarks/gpu/grpo_vs_trl.py --device cpu --tiny --out grpo.json        # dry run on a CPU
    python benchmarks/gpu/grpo_vs_trl.py --device cpu --tiny --frameworks cohort    # without TRL installed

Workload: a randomly initialised model of the shape (benchmarks/gpu/models.py: hidden 896, 24 layers, 14 query
heads, 2 KV heads, MLP 4,864, 151,936-token vocabulary, tied embeddings) saved once with cohort's char tokenizer,
8 GSM8K-shaped prompts of 120-200 characters (= tokens) a step, G = 8, up to 256 new tokens at temperature 1,
beta = 0.04, loss dapo, lr 1e-6, no gradient checkpointing, the token_parity reward (every row carries an
advantage, so both trainers do the whole update). Precisions:

- `fp32-autocast`: float32 weights under bf16 autocast (cohort's CUDA default; TRL `bf16=True`);
- `bf16`: bfloat16 weights (cohort `model.dtype=bfloat16`; TRL `model_init_kwargs={"dtype": bfloat16}`).

Each (precision, framework) runs in its own process (this script with --worker), one warm-up step then
--steps measured ones; the median s/step, generation seconds and the process's peak CUDA memory
(`torch.cuda.max_memory_allocated`, the warm-up included) are reported. A worker writes its record after every
step, so one stopped by the time budget keeps the steps it finished. The settings TRL shares with the CPU
comparison are benchmarks/vs_trl/worker.py's (TRL_RUNTIME, its GRPOConfig fields).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `benchmarks` as a package

from benchmarks.gpu.models import SHAPES, save_model  # noqa: E402
from benchmarks.vs_trl.worker import reward_function, trl_runtime  # noqa: E402

PRECISIONS = ("bf16", "fp32-autocast")
FRAMEWORKS = ("cohort", "trl")


def parse_args(argv=None) -> argparse.Namespace:
    """Returns the command-line options."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (a dry run: with --tiny)")
    p.add_argument("--tiny", action="store_true", help="tiny shape, short prompts and completions, 1 step")
    p.add_argument(
        "--shape",
        "--shapes",
        dest="shape",
        default="0.5b",
        help="comma list of shapes (benchmarks/gpu/models.py), each optionally with its own precisions after a "
        "colon, '+'-separated (e.g. '0.5b,14L1024:bf16'); the variants run on the first",
    )
    p.add_argument("--precisions", default=",".join(PRECISIONS), help="comma list of bf16, fp32-autocast")
    p.add_argument("--frameworks", default=",".join(FRAMEWORKS), help="comma list of cohort, trl")
    p.add_argument("--prompts", type=int, default=8, help="prompts per step")
    p.add_argument("--group", type=int, default=8, help="G")
    p.add_argument("--tokens", type=int, default=256, help="max new tokens")
    p.add_argument("--prompt-chars", default="120,200", help="min,max prompt characters (= tokens)")
    p.add_argument("--steps", type=int, default=3, help="measured steps after --warmup")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--beta", type=float, default=0.04)
    p.add_argument("--loss", default="dapo")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--variants",
        default="",
        help="extra cohort runs, ';'-separated, each a ','-separated list of config overrides "
        "(e.g. 'fast.segments=off;micro_batch_tokens=32768'): run after the default cohort run of each precision",
    )
    p.add_argument(
        "--variant-precisions", default="", help="the precisions the variants run in (default: all)"
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="cohort runs end with two more steps: one split into synchronised stage timers, one under "
        "torch.profiler (top kernels and host calls in the record)",
    )
    p.add_argument(
        "--budget-s", type=float, default=0, help="stop the workers after this many seconds (0: none)"
    )
    p.add_argument("--workdir", default="/tmp/gpu-check/grpo", help="the saved model, prompts, worker files")
    p.add_argument("--out", default="grpo.json")
    p.add_argument("--worker", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.tiny:
        args.shape, args.tokens, args.prompt_chars, args.steps = "tiny", 16, "100,120", 1
        args.prompts, args.group = 2, 4
    return args


# ------------------------------------------------------------------------------------------------- workers
def write_record(out: str, rec: dict) -> None:
    """Writes a worker's record so far (atomically: the driver may read it after a timeout)."""
    tmp = Path(out + ".tmp")
    tmp.write_text(json.dumps(rec))
    tmp.replace(out)


def peak_cuda_mib(device: str) -> float | None:
    """Returns this process's peak allocated CUDA memory in MiB (None on a CPU)."""
    import torch

    return torch.cuda.max_memory_allocated() / 2**20 if device.startswith("cuda") else None


def segment_counts(cuda: bool) -> tuple[int, int]:
    """Returns how many memory segments the CUDA caching allocator has taken from and given back to the driver
    so far in this process ((0, 0) on a CPU)."""
    if not cuda:
        return 0, 0
    import torch

    stats = torch.cuda.memory_stats()
    return stats.get("segment.all.allocated", 0), stats.get("segment.all.freed", 0)


def run_cohort(spec: dict, rows: list[dict], rec: dict, out: str) -> None:
    """Runs cohort's GRPOTrainer for the spec's steps, writing `rec` after each."""
    import torch

    from cohort.config import load_config
    from cohort.trainer import GRPOTrainer

    overrides = ["model.dtype=bfloat16"] if spec["precision"] == "bf16" else []
    overrides += [o for o in spec.get("variant", "").split(",") if o]
    base = {
        "model": {"name_or_path": spec["model"], "device": spec["device"], "gradient_checkpointing": False},
        "data": {"task": "addition"},  # placeholder: the rows are passed in directly
        "rollout": {
            "group_size": spec["group"],
            "batch_size": spec["group"] * spec["prompts"],
            "max_completion_length": spec["tokens"],
            "temperature": 1.0,
            "engine": "builtin",
        },
        "algo": {"loss_type": spec["loss"], "beta": spec["beta"]},
        "optim": {"lr": 1e-6},
        "rewards": ["accuracy"],
        "steps": spec["warmup"] + spec["steps"] + (2 if spec.get("profile") else 0),
        "seed": spec["seed"],
        "out_dir": spec["scratch"],
        "progress": False,
        "eval_at_ends": False,
        "save_every": 0,
    }
    cfg = load_config(None, base)
    if overrides:
        cfg = load_config(None, overrides, base=cfg)
    trainer = GRPOTrainer(cfg, reward_funcs=[reward_function("token_parity")], train_rows=rows, eval_rows=[])
    params = list(trainer.model.parameters())
    rec.update(param_dtype=str(params[0].dtype), parameters=sum(p.numel() for p in params))
    cuda = spec["device"].startswith("cuda")
    rec["setup_s"] = round(time.perf_counter() - spec["started"], 1)
    for _ in range(spec["warmup"] + spec["steps"]):
        before = segment_counts(cuda)
        t0 = time.perf_counter()
        m = trainer.step().metrics
        if cuda:
            torch.cuda.synchronize()
        after = segment_counts(cuda)
        rec["steps"].append(
            {
                "seconds": time.perf_counter() - t0,
                "generate_s": m.get("time/generate"),
                "update_s": m.get("time/update"),
                "mean_length": m.get("completions/mean_length"),
                "loss": m.get("loss"),
                "fast": {k.removeprefix("fast/"): v for k, v in m.items() if k.startswith("fast/")},
                # How the token budget split the update: passes with gradients, the largest in tokens.
                "micro_batches": m.get("micro_batches"),
                "micro_batch_tokens_max": m.get("micro_batch_tokens_max"),
                # Every stage's seconds, for the whole-step profile (issue 39.3).
                "times": {k.removeprefix("time/"): v for k, v in m.items() if k.startswith("time/")},
                # Memory the caching allocator took from (cudaMalloc) and gave back to (cudaFree) the driver
                # during the step: each costs host time, and a cudaFree waits for the device.
                "segments_allocated": after[0] - before[0] if cuda else None,
                "segments_freed": after[1] - before[1] if cuda else None,
            }
        )
        rec["peak_cuda_mib"] = peak_cuda_mib(spec["device"])
        write_record(out, rec)
    if spec.get("profile"):
        t0 = time.perf_counter()
        rec["split_s"] = split_step(trainer, cuda)
        write_record(out, rec)
        rec["profile"] = profiled_step(trainer, cuda)
        rec["profile_wall_s"] = round(time.perf_counter() - t0, 1)  # the two steps and the profile's reading
        write_record(out, rec)


def split_step(trainer, cuda: bool) -> dict:
    """Returns one step's wall seconds split over its parts (generation, the frozen passes, the policy's
    forwards, backwards and optimizer steps, the rest), each timed between two device synchronisations."""
    import torch

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    spent: dict[str, float] = {}

    def timed(name, fn):
        def wrapper(*a, **k):
            sync()
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                sync()
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - t0
                spent[name + "#calls"] = spent.get(name + "#calls", 0) + 1

        return wrapper

    up = trainer.run.updater
    patched = [
        (trainer.run.drawer, "draw"),
        (up, "update"),
        (up, "frozen_logprobs"),
        (up, "_logprobs"),
        (up.optimizer, "step"),
    ]
    saved = [(obj, name, getattr(obj, name)) for obj, name in patched]
    backward = torch.Tensor.backward
    for obj, name, fn in saved:
        setattr(obj, name, timed(f"{type(obj).__name__}.{name}", fn))
    torch.Tensor.backward = timed("backward", backward)  # type: ignore[method-assign]
    try:
        sync()
        t0 = time.perf_counter()
        trainer.step()
        sync()
        spent["step"] = time.perf_counter() - t0
    finally:
        torch.Tensor.backward = backward  # type: ignore[method-assign]
        for obj, name, fn in saved:
            setattr(obj, name, fn)
    return {k: round(v, 4) for k, v in spent.items()}


def profiled_step(trainer, cuda: bool, top: int = 30) -> dict:
    """Returns one step under torch.profiler: its wall seconds, the device's busy seconds, the host calls that
    launch or wait (counts), and the `top` ops by device time and by host time."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        trainer.step()
        if cuda:
            torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    events = prof.key_averages()

    def device_us(e) -> float:
        return float(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0.0)) or 0.0)

    def row(e) -> list:
        return [e.key[:90], e.count, round(device_us(e) / 1e3, 2), round(e.self_cpu_time_total / 1e3, 2)]

    host_calls = {
        e.key: [e.count, round(e.self_cpu_time_total / 1e3, 2)]
        for e in events
        if e.key.startswith(("cuda", "aten::_local_scalar_dense", "aten::item", "aten::nonzero"))
    }
    busy_ms = sum(device_us(e) for e in events if e.device_type.name == "CUDA") / 1e3 if cuda else None
    return {
        "wall_s": round(wall, 3),
        "device_busy_ms": round(busy_ms, 1) if busy_ms is not None else None,
        "host_calls": host_calls,
        "by_device_ms": [row(e) for e in sorted(events, key=device_us, reverse=True)[:top]],
        "by_host_ms": [
            row(e) for e in sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
        ],
    }


def run_trl(spec: dict, rows: list[dict], rec: dict, out: str) -> None:
    """Runs TRL's GRPOTrainer for the spec's steps (configured as benchmarks/vs_trl/worker.py does, on the
    spec's device and precision), writing `rec` after each."""
    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    rec["trl"] = trl.__version__
    N = spec["group"] * spec["prompts"]
    runtime = trl_runtime(spec["device"])
    dtype = torch.bfloat16 if spec["precision"] == "bf16" else torch.float32
    args = GRPOConfig(
        output_dir=spec["scratch"],
        model_init_kwargs={"dtype": dtype, "attn_implementation": "sdpa"},
        # One optimizer step per generation batch of N completions, mu = 1 (as in the CPU comparison).
        per_device_train_batch_size=N,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_iterations=1,
        num_generations=spec["group"],
        max_completion_length=spec["tokens"],
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=spec["beta"],
        loss_type=spec["loss"],
        epsilon=0.2,
        scale_rewards="group",
        learning_rate=1e-6,
        lr_scheduler_type="constant",
        warmup_steps=0,
        adam_beta1=0.9,
        adam_beta2=0.99,
        weight_decay=0.0,
        max_grad_norm=1.0,
        max_steps=spec["warmup"] + spec["steps"],
        seed=spec["seed"],
        **runtime,
    )
    trainer = GRPOTrainer(
        model=spec["model"],
        reward_funcs=[reward_function("token_parity")],
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=AutoTokenizer.from_pretrained(spec["model"]),
    )
    rec.update(param_dtype=str(next(trainer.model.parameters()).dtype), trl_bf16=runtime.get("bf16"))
    timing = {"gen": 0.0, "lengths": []}
    generate = trainer._generate  # TRL has no public hook around generation: its own method is timed

    def timed_generate(prompts):
        t0 = time.perf_counter()
        result = generate(prompts)
        timing["gen"] += time.perf_counter() - t0
        timing["lengths"] = [len(c) for c in result[1]]
        return result

    trainer._generate = timed_generate
    cuda = spec["device"].startswith("cuda")

    class StepTimer(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            self.t = time.perf_counter()
            rec["setup_s"] = round(self.t - spec["started"], 1)

        def on_step_end(self, args, state, control, **kw):
            if cuda:
                torch.cuda.synchronize()
            now = time.perf_counter()
            lengths = timing["lengths"]
            rec["steps"].append(
                {
                    "seconds": now - self.t,
                    "generate_s": timing["gen"],
                    "mean_length": statistics.mean(lengths) if lengths else None,
                }
            )
            rec["peak_cuda_mib"] = peak_cuda_mib(spec["device"])
            write_record(out, rec)
            timing["gen"] = 0.0
            self.t = time.perf_counter()

    trainer.add_callback(StepTimer())
    trainer.train()


def worker(spec_path: str, out: str) -> None:
    """Runs one (framework, precision) in this process and writes its record to `out`."""
    started = time.perf_counter()
    spec = json.loads(Path(spec_path).read_text())
    spec["started"] = started  # a run's setup_s (imports, model load, trainer) counts from here
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    torch.manual_seed(spec["seed"])
    rows = [json.loads(line) for line in Path(spec["rows"]).read_text().splitlines() if line.strip()]
    rec = {
        "framework": spec["framework"],
        "precision": spec["precision"],
        "steps": [],
        "started": time.time(),
    }
    write_record(out, rec)
    try:
        (run_cohort if spec["framework"] == "cohort" else run_trl)(spec, rows, rec, out)
    except Exception as e:  # noqa: BLE001 - the record says why; the driver runs the next worker
        rec["error"] = f"{type(e).__name__}: {e}"[:2000]
        rec["traceback"] = traceback.format_exc()[-4000:]
    rec["peak_cuda_mib"] = peak_cuda_mib(spec["device"])
    write_record(out, rec)
    if "error" in rec:
        print(rec["traceback"], file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------- driver
def summarise_worker(rec: dict, warmup: int) -> dict:
    """Returns a worker's figures: median s/step and generation seconds of the measured steps, peak memory."""
    steps = rec.get("steps", [])
    measured = steps[warmup:] or steps[-1:]  # a run cut short: the warm-up step stands in, marked below
    out = {
        "framework": rec.get("framework"),
        "precision": rec.get("precision"),
        "steps_done": len(steps),
        "measured_steps": len(steps[warmup:]),
        "s_per_step": statistics.median(s["seconds"] for s in measured) if measured else None,
        "generate_s": (
            statistics.median(s["generate_s"] for s in measured if s.get("generate_s") is not None)
            if any(s.get("generate_s") is not None for s in measured)
            else None
        ),
        "peak_cuda_gib": rec["peak_cuda_mib"] / 1024 if rec.get("peak_cuda_mib") is not None else None,
        "mean_length": (
            statistics.mean(s["mean_length"] for s in measured if s.get("mean_length") is not None)
            if any(s.get("mean_length") is not None for s in measured)
            else None
        ),
        "seconds_all": [round(s["seconds"], 3) for s in steps],
        "param_dtype": rec.get("param_dtype"),
    }
    if steps and not steps[warmup:]:
        out["note"] = "no measured step finished: the warm-up step's time"
    if steps and "fast" in steps[-1]:
        out["fast"] = steps[-1]["fast"]
    for key in ("micro_batches", "micro_batch_tokens_max"):
        if steps and steps[-1].get(key) is not None:
            out[key] = steps[-1][key]
    for key in ("segments_allocated", "segments_freed"):  # per measured step
        counts = [s[key] for s in measured if s.get(key) is not None]
        if counts:
            out[key] = counts
    timed = [s["times"] for s in measured if s.get("times")]
    if timed:  # the median seconds of each stage over the measured steps: where a step's time goes
        out["stage_s"] = {k: statistics.median(t.get(k, 0.0) for t in timed) for k in sorted(timed[-1])}
    out["steps_stage_s"] = [
        {k: round(v, 3) for k, v in s["times"].items() if v is not None} for s in steps if s.get("times")
    ]
    for k in ("error", "timed_out", "trl", "setup_s", "split_s", "profile", "profile_wall_s"):
        if k in rec:
            out[k] = rec[k]
    return out


def main(argv=None) -> None:
    """Drives the workers (or runs one, with --worker) and writes --out."""
    args = parse_args(argv)
    if args.worker:
        worker(*args.worker)
        return
    t_start = time.perf_counter()
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    import torch
    import transformers

    from benchmarks.bench_tasks import gsm8k_like_rows

    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        raise SystemExit("grpo_vs_trl.py needs a CUDA GPU here (or --device cpu --tiny for a dry run)")
    t0 = time.perf_counter()
    shapes = parse_shapes(args.shape, args.precisions)
    lo, hi = (int(x) for x in args.prompt_chars.split(","))
    rows = gsm8k_like_rows(64, seed=args.seed, min_chars=lo, max_chars=hi)
    rows_path = work / "rows.jsonl"
    rows_path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result: dict = {
        "header": {
            "device": torch.cuda.get_device_name() if cuda else "cpu",
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "shape": args.shape,
            "prompts": args.prompts,
            "group": args.group,
            "max_tokens": args.tokens,
            "prompt_chars": args.prompt_chars,
            "beta": args.beta,
            "loss": args.loss,
            "warmup": args.warmup,
            "steps": args.steps,
        },
        "runs": [],
    }

    def save() -> None:
        Path(args.out).write_text(json.dumps(result, indent=1))

    save()
    print(json.dumps(result["header"]), flush=True)
    variants = [v.strip() for v in args.variants.split(";") if v.strip()]
    variant_precisions = [p for p in (args.variant_precisions or args.precisions).split(",") if p]
    # The comparison first (every framework in every precision of each shape), then the variants on the first
    # shape: a run cut by the time budget loses the variants first.
    frameworks = [f for f in args.frameworks.split(",") if f]
    order = [(shape, p, f, "") for shape, precisions in shapes for p in precisions for f in frameworks]
    order += [(shapes[0][0], p, "cohort", v) for p in variant_precisions for v in variants]
    models: dict[str, Path] = {}
    for shape, precision, framework, variant in order:
        if shape not in models:
            t0 = time.perf_counter()
            models[shape] = save_model(work / f"model-{shape}", shape, args.device, args.seed)
            result["header"].setdefault("model_build_s", {})[shape] = round(time.perf_counter() - t0, 1)
            if cuda:
                torch.cuda.empty_cache()  # the model was built on the GPU: leave its memory to the workers
        model = models[shape]
        label = f"{framework}-{shape}-{precision}" + (f"-v{variants.index(variant)}" if variant else "")
        spec = {
            "framework": framework,
            "precision": precision,
            "variant": variant,
            "profile": bool(args.profile and framework == "cohort"),
            "device": args.device,
            "model": str(model),
            "rows": str(rows_path),
            "prompts": args.prompts,
            "group": args.group,
            "tokens": args.tokens,
            "beta": args.beta,
            "loss": args.loss,
            "warmup": args.warmup,
            "steps": args.steps,
            "seed": args.seed,
            "scratch": str(work / f"scratch-{label}"),
        }
        spec_path, out = (work / f"spec-{label}.json", work / f"out-{label}.json")
        spec_path.write_text(json.dumps(spec))
        out.unlink(missing_ok=True)
        left = args.budget_s - (time.perf_counter() - t_start) if args.budget_s else None
        if left is not None and left < 20:
            result["runs"].append(
                {
                    "framework": framework,
                    "shape": shape,
                    "precision": precision,
                    "variant": variant,
                    "skipped": "time budget spent",
                }
            )
            save()
            continue
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", str(spec_path), str(out)]
        timed_out = False
        t0 = time.perf_counter()
        stop = False
        try:
            subprocess.run(cmd, timeout=left, check=False)
        except subprocess.TimeoutExpired:
            timed_out = True  # subprocess.run killed the worker; its record holds the steps it finished
        except KeyboardInterrupt:
            # check.sh's timeout interrupts the whole process group: keep what the worker finished, then stop.
            timed_out = stop = True
        rec = (
            json.loads(out.read_text()) if out.exists() else {"framework": framework, "precision": precision}
        )
        if timed_out:
            rec["timed_out"] = True
        summary = summarise_worker(rec, args.warmup)
        summary["variant"] = variant
        summary["shape"] = shape
        summary["wall_s"] = round(time.perf_counter() - t0, 1)
        result["runs"].append(summary)
        result["comparison"] = compare(result["runs"])
        save()
        print(json.dumps(summary), flush=True)
        if stop:
            break
    save()
    for row in result.get("comparison", []):
        print(json.dumps(row), flush=True)


def parse_shapes(text: str, precisions: str) -> list[tuple[str, list[str]]]:
    """Returns [(shape, its precisions)] from --shapes ('0.5b,14L1024:bf16'; a shape without a colon takes
    --precisions)."""
    out = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        shape, _, own = item.partition(":")
        wanted = own.split("+") if own else precisions.split(",")
        unknown = [p for p in wanted if p not in PRECISIONS]
        if shape not in SHAPES or unknown:
            raise SystemExit(
                f"--shapes {item!r}: shapes are {', '.join(SHAPES)}; precisions {', '.join(PRECISIONS)}"
            )
        out.append((shape, [p for p in wanted if p]))
    return out


def compare(runs: list[dict]) -> list[dict]:
    """Returns per shape and precision: cohort's throughput relative to TRL's (TRL s/step / cohort s/step) and
    its peak memory relative to TRL's."""
    rows = []
    for shape, precision in dict.fromkeys((r.get("shape"), r["precision"]) for r in runs):
        by = {
            r["framework"]: r
            for r in runs
            if r.get("shape") == shape and r["precision"] == precision and not r.get("variant")
        }
        c, t = by.get("cohort", {}), by.get("trl", {})
        row = {
            "shape": shape,
            "precision": precision,
            "cohort_s_per_step": c.get("s_per_step"),
            "cohort_generate_s": c.get("generate_s"),
            "trl_s_per_step": t.get("s_per_step"),
            "trl_generate_s": t.get("generate_s"),
            "cohort_peak_gib": c.get("peak_cuda_gib"),
            "trl_peak_gib": t.get("peak_cuda_gib"),
        }
        if c.get("s_per_step") and t.get("s_per_step"):
            row["throughput_vs_trl"] = t["s_per_step"] / c["s_per_step"]
        if c.get("peak_cuda_gib") and t.get("peak_cuda_gib"):
            row["memory_vs_trl"] = c["peak_cuda_gib"] / t["peak_cuda_gib"]
        rows.append(row)
    return rows


if __name__ == "__main__":
    main()
