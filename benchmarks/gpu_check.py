"""Exercise cohort's CUDA paths on one GPU: trainer steps under each precision, engine and adapter setting.

    python benchmarks/gpu_check.py --out gpu-check.jsonl                       # every scenario on the 14m model
    python benchmarks/gpu_check.py --shapes 14m,0.5b --scenarios default,bf16_weights,lora

Each scenario builds a GRPOTrainer on the GSM8K-shaped workload (b_gsm8k of benchmarks/common.py: 100-150-token
prompts, G = 8, completions up to --max-len tokens ending at EOS, the token_parity reward, so every row carries
an advantage), runs --warmup + --steps steps and writes one JSON line: median seconds per step after the
warm-up, generate / update seconds, peak CUDA memory allocated and reserved, the fast paths each step took
(`fast/*` metrics), the probes' verdicts on the model, whether the loss stayed finite and the weights moved,
the sampler/trainer log-prob gap, and the warnings cohort emitted (a fast path refused says why there). A
scenario that raises is written with its traceback and the next one runs. Needs a CUDA GPU.

Shapes: the model shapes of benchmarks/common.py, plus `0.5b`: Qwen2.5-0.5B's widths (hidden 896, 24 layers,
14 heads, MLP 4864, its 151,936-token vocabulary; full multi-head attention, untied embeddings: 0.67 B
parameters), randomly initialised with the same EOS-rate edit as every bench model.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: `benchmarks` as a package

from benchmarks.common import MODEL_SHAPES, WORKLOADS, build_models, workload_rows  # noqa: E402

SHAPES = {
    **MODEL_SHAPES,
    "0.5b": {
        "hidden_size": 896,
        "num_layers": 24,
        "num_heads": 14,
        "intermediate_size": 4864,
        "vocab_size": 151936,
    },
}
"""Model shapes by name: the benchmarks' own and a Qwen2.5-0.5B-wide one."""

SCENARIOS: dict[str, dict] = {
    "default": {},
    "fp32_no_autocast": {"model.bf16_autocast": False},
    "bf16_weights": {"model.dtype": "bfloat16"},
    "bf16_sampler_tis": {"rollout.sampler_dtype": "bfloat16", "algo.sampler_correction": "token_tis"},
    "hf_engine": {"rollout.engine": "hf"},
    "lora": {"model.lora.enabled": True, "optim.lr": 1e-4},
    "kl_reference": {"algo.beta": 0.04},
    "lora_kl": {"model.lora.enabled": True, "algo.beta": 0.04, "optim.lr": 1e-4},
    "grad_checkpointing": {"model.gradient_checkpointing": True},
    "eager_attention": {"model.attn_implementation": "eager"},
    "fast_off": {
        f"fast.{k}": "off"
        for k in (
            "grouped",
            "segments",
            "chunked_head",
            "skip_zero_advantage",
            "shared_prefix",
            "packed_weights",
            "preallocated_kv",
            "heap_bound",
        )
    },
    "fast_on": {
        "fast.segments": "on",
        "fast.chunked_head": "on",
        "fast.shared_prefix": "on",
        "fast.preallocated_kv": "on",
    },
}
"""Config overrides of each scenario (dotted keys), on top of the GSM8K-shaped base config."""


def parse_args(argv=None) -> argparse.Namespace:
    """Return the command-line options."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="14m", help=f"comma list of model shapes ({', '.join(SHAPES)})")
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma list of scenarios")
    p.add_argument("--steps", type=int, default=3, help="measured steps per scenario")
    p.add_argument("--warmup", type=int, default=1, help="steps run before the measured ones")
    p.add_argument("--prompts", type=int, default=4, help="prompts per step (G = 8 completions each)")
    p.add_argument("--max-len", type=int, default=128, help="max completion length")
    p.add_argument("--workdir", default="runs/gpu-check", help="models and scratch run directories")
    p.add_argument("--out", default="gpu-check.jsonl", help="one JSON line per (shape, scenario)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu, to try the script without a GPU")
    return p.parse_args(argv)


def base_config(model_path: str, scratch: Path, args) -> dict:
    """Return the config every scenario starts from (cohort's own defaults otherwise)."""
    w = WORKLOADS["b_gsm8k"]
    return {
        "model": {"name_or_path": model_path, "device": args.device},
        "data": {"task": "addition"},  # placeholder: the rows are passed in directly
        "rollout": {
            "group_size": w["group_size"],
            "batch_size": w["group_size"] * args.prompts,
            "max_completion_length": args.max_len,
            "temperature": 1.0,
        },
        "algo": {"loss_type": "grpo", "beta": 0.0},
        "optim": {"lr": 1e-6},
        "rewards": ["accuracy"],
        "steps": args.warmup + args.steps,
        "seed": args.seed,
        "out_dir": str(scratch),
        "progress": False,
        "eval_at_ends": False,
        "save_every": 0,
    }


def weights_checksum(model) -> float:
    """Return the sum of the trainable parameters in float64 (changes when an optimizer step moves them)."""
    import torch

    with torch.no_grad():
        return float(sum(p.detach().double().sum() for p in model.parameters() if p.requires_grad))


def run_scenario(shape: str, name: str, model_path: str, rows: list[dict], args) -> dict:
    """Return one scenario's measurements (raises what the trainer raises)."""
    import torch

    from benchmarks.bench_tasks import token_parity
    from cohort.config import load_config
    from cohort.fastpath import probes
    from cohort.trainer import GRPOTrainer

    scratch = Path(args.workdir) / "scratch" / f"{shape}-{name}-{time.time_ns()}"
    cfg = load_config(None, base_config(model_path, scratch, args))
    overrides = [f"{k}={json.dumps(v) if isinstance(v, bool) else v}" for k, v in SCENARIOS[name].items()]
    if overrides:
        cfg = load_config(None, overrides, base=cfg)
    cuda = args.device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t0 = time.perf_counter()
        trainer = GRPOTrainer(cfg, reward_funcs=[token_parity], train_rows=rows, eval_rows=[])
        setup = time.perf_counter() - t0
        before = weights_checksum(trainer.model)
        steps = []
        for _ in range(args.warmup + args.steps):
            t0 = time.perf_counter()
            m = trainer.step().metrics
            if cuda:
                torch.cuda.synchronize()
            steps.append({"seconds": time.perf_counter() - t0, **m})
        after = weights_checksum(trainer.model)
    measured = steps[args.warmup :]
    params = list(trainer.model.parameters())
    out = {
        "shape": shape,
        "scenario": name,
        "overrides": SCENARIOS[name],
        "device": str(trainer.device),
        "param_dtype": str(params[0].dtype),
        "trainable_parameters": sum(p.numel() for p in params if p.requires_grad),
        "setup_seconds": round(setup, 2),
        "seconds_per_step": statistics.median(s["seconds"] for s in measured),
        "seconds_per_step_all": [round(s["seconds"], 4) for s in steps],
        "seconds_generate": statistics.median(s["time/generate"] for s in measured),
        "seconds_update": statistics.median(s["time/update"] for s in measured),
        "mean_completion_length": statistics.mean(
            s.get("completions/mean_length", float("nan")) for s in measured
        ),
        "peak_allocated_mib": torch.cuda.max_memory_allocated() / 2**20 if cuda else 0.0,
        "peak_reserved_mib": torch.cuda.max_memory_reserved() / 2**20 if cuda else 0.0,
        "loss_finite": all(torch.isfinite(torch.tensor(float(s.get("loss", float("nan"))))) for s in steps),
        "weights_moved": after != before,
        "sampler_logprob_gap": [s.get("sampler/logprob_gap") for s in measured],
        "fast_paths": {
            k.removeprefix("fast/"): statistics.mean(float(s.get(k, 0.0)) for s in measured)
            for k in sorted({k for s in measured for k in s if k.startswith("fast/")})
        },
        "probes": {k: bool(v) for k, v in probes.results(trainer.model).items()},
        "warnings": sorted({f"{w.category.__name__}: {w.message}" for w in caught})[:20],
    }
    del trainer
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return out


def main(argv=None) -> None:
    """Run every (shape, scenario) pair and write one JSON line each to --out."""
    args = parse_args(argv)
    import torch
    import transformers

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("gpu_check needs a CUDA GPU (torch.cuda.is_available() is False)")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    shapes = [s for s in args.shapes.split(",") if s]
    unknown = [s for s in shapes if s not in SHAPES] + [
        s for s in args.scenarios.split(",") if s and s not in SCENARIOS
    ]
    if unknown:
        raise SystemExit(f"unknown shape or scenario: {unknown}")
    MODEL_SHAPES.update(SHAPES)  # build_models reads the shapes from there
    workdir = Path(args.workdir)
    models = build_models(workdir, {f"{s}@mean60" for s in shapes}, args.seed)
    rows = workload_rows("gsm8k", 512, args.seed)
    header = {
        "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
    }
    print(json.dumps(header), flush=True)
    with open(args.out, "w") as f:
        f.write(json.dumps({"header": header}) + "\n")
        for shape in shapes:
            path = models[f"{shape}@mean60"]["path"]
            for name in [s for s in args.scenarios.split(",") if s]:
                t0 = time.perf_counter()
                try:
                    rec = run_scenario(shape, name, path, rows, args)
                except Exception as e:  # noqa: BLE001 - a failing scenario is recorded, the next one runs
                    rec = {"shape": shape, "scenario": name, "error": f"{type(e).__name__}: {e}"}
                    rec["traceback"] = traceback.format_exc()[-4000:]
                    gc.collect()
                    if args.device.startswith("cuda"):
                        torch.cuda.empty_cache()
                rec["wall_seconds"] = round(time.perf_counter() - t0, 1)
                f.write(json.dumps(rec) + "\n")
                f.flush()
                if "error" in rec:
                    print(f"{shape:5s} {name:18s} FAILED {rec['error']}\n{rec['traceback']}", flush=True)
                else:
                    print(
                        f"{shape:5s} {name:18s} {rec['seconds_per_step']:.3f} s/step "
                        f"(gen {rec['seconds_generate']:.3f}, update {rec['seconds_update']:.3f}) "
                        f"peak {rec['peak_allocated_mib']:.0f} MiB alloc / {rec['peak_reserved_mib']:.0f} reserved, "
                        f"finite={rec['loss_finite']} moved={rec['weights_moved']} fast={rec['fast_paths']} "
                        f"probes={rec['probes']} gap={rec['sampler_logprob_gap']}",
                        flush=True,
                    )
                    for w in rec["warnings"]:
                        print(f"      warning: {w}", flush=True)


if __name__ == "__main__":
    main()
