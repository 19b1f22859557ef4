"""cohort vs TRL's GRPOTrainer, side by side on the same local models, prompts and hyperparameters.

    python benchmarks/vs_trl/run.py                 # speed workloads + scaling sweep + time to accuracy (~25 min)
    python benchmarks/vs_trl/run.py --quick         # smoke test (< 5 min)
    python benchmarks/vs_trl/run.py --sections tta  # only time to accuracy
    python benchmarks/vs_trl/run.py --sections speed --workloads b_gsm8k:14m --override fast.segments=off

Every measurement runs in its own fresh process (benchmarks/vs_trl/worker.py), alternating cohort, TRL,
cohort, TRL, with the same torch threads and seed, so peak RSS is per framework and slow drifts of
the machine hit both. Prints a table and writes benchmark-results.json (see docs/performance.md for
what each column means, the FLOP-floor formula and how the models are built). `--override` passes
config overrides to cohort's runs only (e.g. `fast.segments=off` to time cohort without one fast path).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `benchmarks` as a package

from benchmarks.common import (  # noqa: E402
    ROOT,
    WORKLOADS,
    build_models,
    busy_seconds,
    model_key,
    workload_rows,
)
from benchmarks.vs_trl import bench_flops, bench_report  # noqa: E402

HERE = Path(__file__).resolve().parent
FRAMEWORKS = ("cohort", "trl")
COMMON = {"lr": 1e-6, "beta": 0.0, "loss_type": "grpo", "temperature": 1.0, "reward": "token_parity"}


def parse_args(argv=None) -> argparse.Namespace:
    """Return the command-line options."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--quick", action="store_true", help="smoke test: small models, fewer steps, one round (< 5 min)"
    )
    p.add_argument(
        "--sections", default="speed,sweep,tta", help="comma list of speed, sweep, tta (default: all)"
    )
    p.add_argument("--out", default="benchmark-results.json", help="results JSON path")
    p.add_argument("--workdir", default="runs/bench", help="models, prompts, logs (reused between runs)")
    p.add_argument("--threads", type=int, default=2, help="torch threads for both frameworks")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--rounds", type=int, default=None, help="alternations cohort/TRL per workload (default 2, quick 1)"
    )
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help="measured steps per run after warm-up (default: 3, 1 for (c); quick 1)",
    )
    p.add_argument("--warmup", type=int, default=1, help="steps discarded at the start of each run")
    p.add_argument(
        "--workloads", default=None, help="comma list of workload[:model] to run, e.g. b_gsm8k:14m"
    )
    p.add_argument("--frameworks", default="cohort,trl", help="comma list (default: cohort,trl)")
    p.add_argument(
        "--device",
        default="cpu",
        help="device of the speed section's runs: cpu (default) or cuda (cohort's bf16 autocast, TRL's bf16=True)",
    )
    p.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override for cohort's runs (repeatable), e.g. fast.segments=off; TRL's runs ignore it",
    )
    p.add_argument("--sweep-model", default=None, help="model for the sweep (default 14m, quick 0.5m)")
    p.add_argument("--sweep-g", default=None, help="group sizes of the sweep (default 4,8,16,32)")
    p.add_argument("--sweep-len", default=None, help="completion lengths of the sweep (default 32,64,128)")
    p.add_argument(
        "--sweep-prompts", type=int, default=2, help="prompts per step in the sweep (N = prompts x G)"
    )
    p.add_argument(
        "--sweep-trl",
        default="auto",
        choices=["auto", "yes", "no"],
        help="also sweep TRL (auto: not in --quick)",
    )
    p.add_argument(
        "--tta-target", type=float, default=0.5, help="held-out greedy accuracy to reach (warm start: ~34%%)"
    )
    p.add_argument(
        "--tta-max-steps",
        type=int,
        default=None,
        help="give up after this many GRPO steps (default 3000, quick 20)",
    )
    p.add_argument(
        "--tta-eval-every",
        type=int,
        default=None,
        help="evaluate every this many steps (default 25, quick 5)",
    )
    p.add_argument(
        "--tta-max-seconds",
        type=float,
        default=None,
        help="training-time budget per framework (default 600, quick 60)",
    )
    p.add_argument("--tta-seeds", default="0", help="comma list of seeds (one warm start each)")
    p.add_argument(
        "--tta-warm-threads",
        type=int,
        default=None,
        help="torch threads of the SFT warm start (default --threads): runs of other thread counts share it",
    )
    p.add_argument(
        "--idle-wait",
        type=float,
        default=0.0,
        help="before each run, wait up to this many seconds for other processes to use < 5%% of the CPU",
    )
    return p.parse_args(argv)


def machine_info() -> dict:
    """Return the CPU, memory and library versions of this machine."""
    import torch
    import transformers

    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "gpu": torch.cuda.is_available(),
    }
    for mod in ("trl", "accelerate", "datasets", "cohort"):
        try:
            from importlib.metadata import version

            info[mod] = version(mod)
        except Exception:  # noqa: BLE001 - a missing optional package is reported, not fatal
            info[mod] = None
    return info


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


# ------------------------------------------------------------------------------------ preparation
def write_rows(workdir: Path, kind: str, seed: int) -> str:
    """Returns the path of a JSONL file of 512 prompts of the given kind (addition | gsm8k)."""
    path = workdir / f"rows_{kind}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in workload_rows(kind, 512, seed)))
    return str(path)


def children_cpu_seconds() -> float:
    """Return the CPU seconds this process's finished children have used."""
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def others_load(seconds: float = 3.0) -> float:
    """Return the fraction of the machine's CPU that other processes used over the next `seconds`."""
    b0, t0 = busy_seconds(), time.time()
    time.sleep(seconds)
    return (busy_seconds() - b0) / ((time.time() - t0) * (os.cpu_count() or 1))


def wait_idle(limit_s: float) -> float | None:
    """Return the CPU share other processes use, after waiting up to limit_s seconds for it to fall below 5 %."""
    if limit_s <= 0:
        return None
    t0 = time.time()
    load = others_load()
    while limit_s > 0 and load > 0.05 and time.time() - t0 < limit_s:
        load = others_load(10.0)
    return load


def run_worker(spec: dict, workdir: Path, tag: str, idle_wait: float) -> dict:
    """Return the worker's result for `spec`, run in a fresh Python process (raises with its log on failure)."""
    logs = workdir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    spec_path, out_path, log_path = logs / f"{tag}.spec.json", logs / f"{tag}.out.json", logs / f"{tag}.log"
    spec_path.write_text(json.dumps(spec, indent=1))
    out_path.unlink(missing_ok=True)
    load_before = wait_idle(idle_wait)
    t0, busy0, own0 = time.time(), busy_seconds(), children_cpu_seconds()
    with open(log_path, "w") as log:
        proc = subprocess.run(
            [sys.executable, str(HERE / "worker.py"), str(spec_path), str(out_path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=str(ROOT),
        )
    if proc.returncode != 0 or not out_path.exists():
        tail = log_path.read_text()[-3000:]
        raise RuntimeError(f"worker {tag} failed (exit {proc.returncode}); log {log_path}:\n{tail}")
    result = json.loads(out_path.read_text())
    wall = time.time() - t0
    result["wall_seconds"] = wall
    result["others_cpu_before"] = load_before
    # CPU share used by other processes while the worker ran: > 0.05 means the timings are contended.
    others = busy_seconds() - busy0 - (children_cpu_seconds() - own0)
    result["others_cpu_during"] = max(0.0, others / (wall * (os.cpu_count() or 1)))
    return result


def framework_options(args, framework: str) -> dict:
    """Returns the spec keys that name the framework and, for cohort, its config overrides."""
    if framework == "cohort" and args.override:
        return {"framework": framework, "cohort_overrides": list(args.override)}
    return {"framework": framework}


# ------------------------------------------------------------------------------------ statistics
def summarise(results: list[dict], warmup: int, meta: dict, rate: dict, spec: dict) -> dict:
    """Return one framework's figures on one workload from its runs (all rounds, warm-up steps dropped)."""
    steps = [s for r in results for run in r["runs"] for s in run["steps"][warmup:]]
    if not steps:
        raise ValueError("no measured steps: raise --steps above --warmup")
    step_time = statistics.median(s["step_time"] for s in steps)
    gen = statistics.median(s["time_generate"] for s in steps)
    gen_score = statistics.median(s["time_generate_and_score"] for s in steps)
    tokens = statistics.mean(sum(s["completion_lengths"]) for s in steps)
    n = spec["batch_size"]
    G = spec["group_size"]
    floors = [
        bench_flops.floor_seconds(meta, rate, s["prompt_lengths"], s["completion_lengths"], G, spec["beta"])
        for s in steps
    ]
    flops = [
        bench_flops.step_floor_flops(meta, s["prompt_lengths"], s["completion_lengths"], G, spec["beta"])
        for s in steps
    ]
    floor = statistics.mean(floors)
    decode_floors = [
        bench_flops.decode_floor_seconds(
            meta, rate, s["prompt_lengths"], s["completion_lengths"], G, spec["beta"]
        )
        for s in steps
    ]
    decode_floor = statistics.mean(decode_floors) if None not in decode_floors else None
    out = {
        "seconds_per_step": step_time,
        "seconds_per_step_all": [round(s["step_time"], 4) for s in steps],
        "seconds_generate": gen,
        "seconds_score": gen_score - gen,
        "seconds_update": step_time - gen_score,
        "completions_per_s": n / step_time,
        "tokens_per_s": tokens / step_time,
        "mean_completion_length": tokens / n,
        "peak_rss_mib": max(r["peak_rss_mib"] for r in results),
        "peak_gpu_mib": max((r.get("peak_gpu_mib") or 0.0 for r in results), default=0.0) or None,
        "rss_after_import_mib": max(r["rss_after_import_mib"] for r in results),
        "floor_seconds": floor,
        "step_over_floor": step_time / floor,
        "decode_floor_seconds": decode_floor,
        "step_over_decode_floor": step_time / decode_floor if decode_floor else None,
        "useful_gflops": statistics.mean(flops) / step_time / 1e9,
        "measured_steps": len(steps),
        "others_cpu_during": [round(r["others_cpu_during"], 3) for r in results],
    }
    rows = [s.get("rows_computed_frac") for s in steps if s.get("rows_computed_frac") is not None]
    if rows:
        out["rows_computed_frac"] = statistics.mean(rows)
    fast = [s["fast_paths"] for s in steps if s.get("fast_paths")]
    if fast:
        # cohort's fast paths taken (its `fast/*` metrics): the share of measured steps or computations.
        out["fast_paths"] = {
            k: statistics.mean(f.get(k, 0.0) for f in fast) for k in sorted(set().union(*fast))
        }
    return out


def ratios(c: dict, t: dict) -> dict:
    """Return cohort/TRL ratios of the headline figures."""
    keys = (
        "seconds_per_step",
        "completions_per_s",
        "tokens_per_s",
        "peak_rss_mib",
        "seconds_generate",
        "seconds_update",
    )
    return {k: c[k] / t[k] if t.get(k) else None for k in keys}


# ------------------------------------------------------------------------------------ sections
def section_speed(args, workdir: Path, models: dict, rates: dict, pairs, rows: dict) -> list[dict]:
    """Return one entry per (workload, model): both frameworks' figures and the ratios."""
    out = []
    frameworks = [f for f in args.frameworks.split(",") if f]
    for wl, shape in pairs:
        w = WORKLOADS[wl]
        key = model_key(shape, w["mean_length"])
        spec = {
            **COMMON,
            "model": models[key]["path"],
            "rows": rows[w["prompts"]],
            "group_size": w["group_size"],
            "batch_size": w["batch_size"],
            "max_completion_length": w["max_completion_length"],
            "threads": args.threads,
            "device": args.device,
            "steps": args.warmup + (args.steps or (1 if args.quick else w["steps"])),
            "seed": args.seed,
        }
        if args.quick:
            spec.update(w["quick"])
        per_fw: dict[str, list] = {f: [] for f in frameworks}
        for rnd in range(args.rounds_given or w.get("rounds", args.rounds)):
            for fw in frameworks:
                tag = f"{wl}-{shape}-{fw}-r{rnd}"
                print(f"  running {tag} ...", flush=True)
                s = {**spec, **framework_options(args, fw), "scratch": str(workdir / "scratch" / tag)}
                per_fw[fw].append(run_worker(s, workdir, tag, args.idle_wait))
        entry = {
            "workload": wl,
            "about": w["about"],
            "model": shape,
            "model_facts": {
                k: models[key][k]
                for k in ("parameters", "parameters_nonembedding", "vocab_size", "hidden_size", "num_layers")
            },
            "settings": {k: v for k, v in spec.items() if k not in ("model", "rows")},
            "matmul_gflops": rates[key],
        }
        for fw in frameworks:
            entry[fw] = summarise(per_fw[fw], args.warmup, models[key], rates[key], spec)
        if "cohort" in entry and "trl" in entry:
            entry["ratio"] = ratios(entry["cohort"], entry["trl"])
        out.append(entry)
        bench_report.print_speed([entry])
    return out


def section_sweep(args, workdir: Path, models: dict, rates: dict, rows: dict) -> dict:
    """Return step times over G x completion length (EOS unreachable: lengths are exact) per framework."""
    key = model_key(args.sweep_model, None)
    Gs = [int(x) for x in args.sweep_g.split(",")]
    Ls = [int(x) for x in args.sweep_len.split(",")]
    configs = [
        {"group_size": G, "batch_size": G * args.sweep_prompts, "max_completion_length": L}
        for L in Ls
        for G in Gs
    ]
    spec = {
        **COMMON,
        "model": models[key]["path"],
        "rows": rows["addition"],
        "threads": args.threads,
        "steps": args.warmup + (args.steps or (1 if args.quick else 3)),
        "seed": args.seed,
        "configs": configs,
        "group_size": Gs[0],
        "batch_size": Gs[0] * args.sweep_prompts,
        "max_completion_length": Ls[0],
    }
    frameworks = ["cohort"] + (["trl"] if args.sweep_trl == "yes" else [])
    others: dict[str, float] = {}
    out = {
        "model": args.sweep_model,
        "prompts_per_step": args.sweep_prompts,
        "G": Gs,
        "lengths": Ls,
        "points": [],
    }
    for fw in frameworks:
        tag = f"sweep-{args.sweep_model}-{fw}"
        print(f"  running {tag} ({len(configs)} configs) ...", flush=True)
        res = run_worker(
            {**spec, **framework_options(args, fw), "scratch": str(workdir / "scratch" / tag)},
            workdir,
            tag,
            args.idle_wait,
        )
        others[fw] = res["others_cpu_during"]
        for run in res["runs"]:
            cfgs = run["override"]
            steps = run["steps"][args.warmup :]
            t = statistics.median(s["step_time"] for s in steps)
            floor = statistics.mean(
                bench_flops.floor_seconds(
                    models[key],
                    rates[key],
                    s["prompt_lengths"],
                    s["completion_lengths"],
                    cfgs["group_size"],
                    0.0,
                )
                for s in steps
            )
            out["points"].append(
                {
                    "framework": fw,
                    "G": cfgs["group_size"],
                    "length": cfgs["max_completion_length"],
                    "completions": cfgs["batch_size"],
                    "completion_tokens": statistics.mean(sum(s["completion_lengths"]) for s in steps),
                    "seconds_per_step": t,
                    "seconds_generate": statistics.median(s["time_generate"] for s in steps),
                    "floor_seconds": floor,
                    "step_over_floor": t / floor,
                }
            )
    out["others_cpu_during"] = others
    out["linearity"] = {
        fw: bench_report.linearity([p for p in out["points"] if p["framework"] == fw], Gs, Ls)
        for fw in frameworks
    }
    bench_report.print_sweep(out)
    return out


def demo_recipe_key() -> dict:
    """Return the parts of cohort's demo recipe that determine the warm start (to reuse a cached one)."""
    from cohort.commands import demo

    recipe = {
        "model": demo.DEMO_MODEL,
        "sft": demo.DEMO_SFT.__dict__,
        "sft_target": getattr(demo, "DEMO_SFT_TARGET", None),
        "grpo": demo.DEMO_GRPO,
    }
    return json.loads(json.dumps(recipe, default=str))


def section_tta(args, workdir: Path) -> dict:
    """Return time-to-accuracy runs of both frameworks from the same SFT warm start, per seed."""
    out = {"target": args.tta_target, "eval_every": args.tta_eval_every, "runs": []}
    for seed in [int(s) for s in args.tta_seeds.split(",")]:
        warm = workdir / f"tta-warmstart-s{seed}"
        warm_threads = args.tta_warm_threads or args.threads
        key = {"recipe": demo_recipe_key(), "seed": seed, "threads": warm_threads}
        cached = warm / "warm_start.json"
        if cached.exists() and json.loads(cached.read_text()).get("key") == key:
            prep = json.loads(cached.read_text())["result"]
            print(f"  reusing the SFT warm start in {warm}", flush=True)
        else:
            print(f"  building the SFT warm start in {warm} (cohort demo's recipe; cached) ...", flush=True)
            spec = {
                "mode": "tta_prepare",
                "framework": "cohort",
                "out_dir": str(warm),
                "seed": seed,
                "threads": warm_threads,
            }
            prep = run_worker(spec, workdir, f"tta-prepare-s{seed}", 0)["runs"][0]
            cached.write_text(json.dumps({"key": key, "result": prep}))
        entry = {"seed": seed, "warm_start": prep}
        for fw in [f for f in args.frameworks.split(",") if f]:
            tag = f"tta-{fw}-s{seed}"
            print(f"  running {tag} ...", flush=True)
            spec = {
                "mode": "tta",
                **framework_options(args, fw),
                "model": str(warm / "sft-model"),
                "seed": seed,
                "threads": args.threads,
                "target": args.tta_target,
                "max_steps": args.tta_max_steps,
                "max_seconds": args.tta_max_seconds,
                "eval_every": args.tta_eval_every,
                "scratch": str(workdir / "scratch" / tag),
            }
            entry[fw] = run_worker(spec, workdir, tag, args.idle_wait)["runs"][0]
        c, t = entry.get("cohort", {}), entry.get("trl", {})
        if c.get("seconds_to_target") and t.get("seconds_to_target"):
            entry["ratio_seconds_to_target"] = c["seconds_to_target"] / t["seconds_to_target"]
        elif c.get("seconds_to_target") and t:
            # TRL did not get there within its budget: the ratio is at most this.
            entry["ratio_seconds_to_target_at_most"] = c["seconds_to_target"] / t["seconds_trained"]
        out["runs"].append(entry)
    bench_report.print_tta(out)
    return out


def main(argv=None) -> None:
    """Run the chosen sections and write the results JSON."""
    args = parse_args(argv)
    q = args.quick
    args.rounds_given = args.rounds
    args.rounds = args.rounds or (1 if q else 2)
    args.sweep_model = args.sweep_model or ("0.5m" if q else "14m")
    args.sweep_g = args.sweep_g or ("4,8" if q else "4,8,16,32")
    args.sweep_len = args.sweep_len or ("32,64" if q else "32,64,128")
    args.sweep_trl = {"auto": "no", "yes": "yes", "no": "no"}[args.sweep_trl]
    args.tta_max_steps = args.tta_max_steps or (20 if q else 3000)
    args.tta_eval_every = args.tta_eval_every or (5 if q else 25)
    args.tta_max_seconds = args.tta_max_seconds or (60.0 if q else 600.0)
    sections = [s for s in args.sections.split(",") if s]
    workdir = Path(args.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    t_start = time.time()

    pairs = [(wl, m) for wl, w in WORKLOADS.items() for m in w["models"]]
    if q:
        pairs = [("a_demo", "0.5m"), ("b_gsm8k", "0.5m"), ("c_vocab", "vocab152k")]
    if args.workloads:
        chosen = [x.split(":") for x in args.workloads.split(",")]
        pairs = [(wl, m) for wl, m in pairs if any(c[0] == wl and (len(c) == 1 or c[1] == m) for c in chosen)]
        pairs += [(c[0], c[1]) for c in chosen if len(c) == 2 and (c[0], c[1]) not in pairs]
    needed = set()
    if "speed" in sections:
        needed |= {model_key(m, WORKLOADS[wl]["mean_length"]) for wl, m in pairs}
    if "sweep" in sections:
        needed.add(model_key(args.sweep_model, None))
    print(f"building models in {workdir / 'models'}: {', '.join(sorted(needed))}", flush=True)
    models = build_models(workdir, needed, args.seed)
    rates = {}
    for k in sorted(needed):
        rates[k] = bench_flops.matmul_rate(models[k], threads=args.threads)
        dec = ", ".join(f"{v:.1f} at {r} rows" for r, v in rates[k]["gflops_layer_decode"].items())
        print(
            f"  matmul rate on {k} shapes: {rates[k]['gflops_layer']:.1f} GFLOP/s (layers), "
            f"{rates[k]['gflops_lm_head']:.1f} (LM head); decode-shaped layers: {dec}"
        )
    rows = {kind: write_rows(workdir, kind, args.seed) for kind in ("addition", "gsm8k")}

    results = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": machine_info(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "options": vars(args),
        "models": models,
        "matmul": rates,
    }
    out_path = Path(args.out)

    def save() -> None:
        results["seconds_total"] = time.time() - t_start
        results["targets"] = bench_report.targets(results)
        out_path.write_text(json.dumps(results, indent=1))

    if "speed" in sections:
        print("== speed workloads", flush=True)
        results["speed"] = section_speed(args, workdir, models, rates, pairs, rows)
        save()
    if "sweep" in sections:
        print("== scaling sweep", flush=True)
        results["sweep"] = section_sweep(args, workdir, models, rates, rows)
        save()
    if "tta" in sections:
        print("== time to accuracy", flush=True)
        results["tta"] = section_tta(args, workdir)
        save()
    save()
    print()
    bench_report.print_all(results)
    print(f"\nwrote {out_path} in {results['seconds_total'] / 60:.1f} min")


if __name__ == "__main__":
    main()
