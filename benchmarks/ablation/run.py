"""Every loss type, advantage estimator and entropy control on the demo task, from one warm start, several seeds.

    python benchmarks/ablation/run.py --out runs/ablation                   # every variant x 3 seeds x 1000 steps
    python benchmarks/ablation/run.py --out runs/ablation --variants classic --steps 800 --eval-every 200 \
        --seeds 0 1 2 --page docs/ablation.md                              # docs/ablation.md's 14 variants
    python benchmarks/ablation/run.py --out runs/ablation2026 --variants 2026 --page docs/ablation-2026.md
    python benchmarks/ablation/run.py --out runs/ablation-code --task code --variants 2026 \
        --page docs/ablation-2026-code.md                                  # the same on the code task
    python benchmarks/ablation/run.py --out runs/ablation --variants cispo sapo --seeds 0 --steps 100
    python benchmarks/ablation/run.py --out runs/ablation --page-only       # redraw the page from the runs
    python benchmarks/ablation/page.py --out runs/ablation --page docs/ablation.md   # the same

The warm start is the demo's (`cohort demo --seed 0`: the tiny Qwen2 model after its SFT cold start), built
once under OUT/warm, or any model folder given with --warm-start. Each variant is the demo's GRPO recipe
(`cohort.commands.demo.DEMO_GRPO`: dapo loss, clip-higher, dynamic sampling, temperature 1.2, lr 1.5e-4) split into 4
minibatches (COMMON below: why) with only the listed overrides changed. Each variant x seed is one
`python -m cohort train OUT/runs/<variant>-s<seed>.yaml` in a subprocess (the YAML holds the whole config,
so the printed command reproduces the run), evaluated on the 200 held-out problems every --eval-every steps. --variants takes names or
the groups of GROUPS ("2026": the baseline, grpo, cispo, gspo and the members of issue 40; "classic": the
14 variants before them).
The seed changes sampling and shuffling, not the warm start.

--task code does the same on the built-in code task (examples/code_task.py): the warm start is that script's
SFT model (`python examples/code_task.py --steps 1 --seed 0 --out OUT/warm`: SFT on the reference programs
until the greedy validation pass rate reaches 30 %, then one GRPO step), each run is its `grpo_config` recipe
(dapo loss, G = 8, 64 completions of up to 40 tokens a step, lr 2e-4, the sandboxed `code` reward) with the
same COMMON and variant overrides, and the held-out number is the pass rate on its 100 held-out problems.

A run whose summary.json says it reached --steps is not run again, so the command can be re-issued after an
interruption (a run cut short restarts, `resume=auto` without checkpoints); a run that fails is reported with
its stderr tail (the whole of it in OUT/runs/<variant>-s<seed>.log) and the others go on. --workers runs that
many trainings side by side (default 1: one at a time, so the timings are not contended).

Writes OUT/results.json after every run (settings, warm start, per run: held-out accuracy at each evaluation
with its step and the training wall time so far, final and best accuracy, median s/step, clip and mask fractions, entropy and reward near the end) and at
the end the page (--page) with its figures next to it (img/<page name>_*.png); page.py writes the page alone.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `benchmarks` as a package

ROOT = Path(__file__).resolve().parents[2]
CODE_SCRIPT = ROOT / "examples" / "code_task.py"
CODE_LR = 2e-4  # examples/code_task.py's default --lr, the learning rate of its runs in docs/sandbox.md
# The tasks --task accepts: the demo's addition (cohort.commands.demo.DEMO_GRPO, its warm start from `cohort demo`)
# and the built-in code task (examples/code_task.py: its SFT warm start and its grpo_config recipe).
TASKS = ("demo", "code")
# The baseline keeps its name on both tasks (the run folders are named after it): on the code task it is the
# code task's own recipe, whose loss is dapo too.
BASELINE = "dapo (the demo)"
# The demo trains once per batch (one optimizer step), where every ratio is exactly 1 and the losses that
# differ only off-policy coincide (cispo and sapo give dapo's and grpo's gradient there). Four minibatches
# make three of every four steps off-policy, as TRL's steps_per_generation does, so the losses can differ.
COMMON: list[str] = ["algo.num_minibatches=4"]
# Dotted `cohort train` overrides on top of DEMO_GRPO + COMMON, one change of recipe per variant. The
# losses without a clip-higher bound (cispo, sapo, gmpo) get eps_high=null so the demo's 0.28 is not carried
# over into their own parameters; gspo uses its paper's sequence-level epsilons (3e-4 / 4e-4).
VARIANTS: dict[str, list[str]] = {
    BASELINE: [],
    "grpo": ["algo.loss_type=grpo"],
    "bnpo": ["algo.loss_type=bnpo"],
    "dr_grpo": ["algo.loss_type=dr_grpo", "algo.scale=none"],
    "gspo": [
        "algo.loss_type=grpo",
        "algo.importance=sequence",
        "algo.eps_low=0.0003",
        "algo.eps_high=0.0004",
    ],
    "cispo": ["algo.loss_type=cispo", "algo.eps_high=null"],
    "sapo": ["algo.loss_type=sapo", "algo.eps_high=null"],
    "gmpo": ["algo.loss_type=gmpo", "algo.eps_high=null"],
    "rloo": ["algo.advantage=rloo"],
    "reinforce++": ["algo.advantage=reinforce_pp"],
    "reinforce++ baseline": ["algo.advantage=reinforce_pp_baseline"],
    "top-20% entropy": ["algo.top_entropy_quantile=0.2"],
    "clip-cov": ["algo.cov_method=clip_cov"],
    "kl-cov": ["algo.cov_method=kl_cov"],
    # The 2026 members (issue 40, docs/algorithms.md "The 2026 family"). luspo is its preset (sequence-level
    # importance) with the demo's clip epsilons 0.2 / 0.28; vespo is its preset (token-level: it weighs whole
    # sequences itself and refuses importance=sequence); dppo_tv / dppo_kl are the losses alone with their
    # default masks (0.15 TV, 0.05 KL) at the pi_old anchor and the demo's dapo aggregation (the dppo preset
    # also switches to dr_grpo's); dppo_tv top-8 is dppo_tv with its TV over the sampler's 8 most likely
    # tokens plus a rest bucket (algo.dppo_topk) in place of the binary one; prime_rl is its preset (binary-TV 0.2 / 0.2 at the sampler anchor + kl_tau
    # 1e-3, dapo aggregation); dro needs kl_tau > 0 (prime-rl's 1e-3); max_rl is its preset. The off-policy
    # mask drops a negative-advantage sequence whose mean log(pi_old / pi) per token exceeds the threshold:
    # the 4 minibatches drift far less than TRL's example 0.5, so 0.01 (the dropped share is on the page).
    # The bias-corrected KL sits next to the same beta without the correction: the difference is the
    # correction alone. otb swaps the group baseline for the Optimal Token Baseline (per-token advantages from
    # pi_old and sum_v pi_old^2), with the demo's dapo loss left as it is.
    "luspo": ["algo.loss_type=luspo", "algo.importance=sequence"],
    "vespo": ["algo.loss_type=vespo", "algo.eps_high=null"],
    "dppo_tv": ["algo.loss_type=dppo_tv", "algo.eps_high=null"],
    "dppo_kl": ["algo.loss_type=dppo_kl", "algo.eps_high=null"],
    "dppo_tv top-8": ["algo.loss_type=dppo_tv", "algo.eps_high=null", "algo.dppo_topk=8"],
    "prime_rl": [
        "algo.loss_type=dppo_tv",
        "algo.loss_kwargs={mask_low: 0.2, mask_high: 0.2, max_ratio: null}",
        "algo.trust_region_anchor=sampler",
        "algo.sampler_correction=none",
        "algo.kl_tau=0.001",
        "algo.eps_high=null",
    ],
    "dro": ["algo.loss_type=dro", "algo.kl_tau=0.001", "algo.eps_high=null"],
    "max_rl": ["algo.advantage=max_rl"],
    "off-policy mask": ["algo.off_policy_mask_threshold=0.01"],
    "beta 0.04": ["algo.beta=0.04"],
    "beta 0.04 bias-corrected": ["algo.beta=0.04", "algo.use_bias_correction_kl=true"],
    "otb": ["algo.advantage=optimal_token_baseline"],
}
NEW_2026 = [
    "luspo",
    "vespo",
    "dppo_tv",
    "dppo_kl",
    "dppo_tv top-8",
    "prime_rl",
    "dro",
    "max_rl",
    "off-policy mask",
    "beta 0.04",
    "beta 0.04 bias-corrected",
    "otb",
]
# Named sets of variants, accepted by --variants in place of names (`--variants 2026`).
GROUPS: dict[str, list[str]] = {
    "2026": [BASELINE, "grpo", "cispo", "gspo", *NEW_2026],
    "classic": [v for v in VARIANTS if v not in NEW_2026],  # the 14 of docs/ablation.md's table
}
# The figures: one panel per family, each with the baseline so every panel reads against the demo.
PANELS: dict[str, list[str]] = {
    "losses": [BASELINE, "grpo", "bnpo", "dr_grpo", "gspo", "cispo", "sapo", "gmpo"],
    "advantages": [BASELINE, "rloo", "reinforce++", "reinforce++ baseline"],
    "entropy": [BASELINE, "top-20% entropy", "clip-cov", "kl-cov"],
    "losses_2026": [
        BASELINE,
        "grpo",
        "cispo",
        "gspo",
        "luspo",
        "vespo",
        "dppo_tv",
        "dppo_kl",
        "dppo_tv top-8",
        "prime_rl",
        "dro",
    ],
    "controls_2026": [
        BASELINE,
        "max_rl",
        "otb",
        "off-policy mask",
        "beta 0.04",
        "beta 0.04 bias-corrected",
    ],
}
PANEL_TITLES = {
    "losses": "policy losses",
    "advantages": "advantage estimators",
    "entropy": "entropy control",
    "losses_2026": "the 2026 losses",
    "controls_2026": "the 2026 advantage, mask and KL",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Returns the command-line options, with --variants checked against VARIANTS."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--out", default="runs/ablation", help="folder of the warm start, the runs and results.json"
    )
    p.add_argument(
        "--task",
        choices=list(TASKS),
        default="demo",
        help="demo: the demo's addition task and recipe; code: examples/code_task.py's warm start and recipe",
    )
    p.add_argument("--steps", type=int, default=1000, help="GRPO steps per run")
    p.add_argument("--eval-every", type=int, default=250, help="held-out evaluation every this many steps")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument(
        "--variants",
        nargs="+",
        default=list(VARIANTS),
        metavar="NAME",
        help=f"variant names or groups {list(GROUPS)} (quote the names with spaces; a comma-separated list also works)",
    )
    p.add_argument(
        "--warm-start", default=None, help="model folder to start from (default: build the task's)"
    )
    p.add_argument("--workers", type=int, default=1, help="trainings run side by side")
    p.add_argument(
        "--threads", type=int, default=None, help="torch threads per training (default: cores / workers)"
    )
    p.add_argument("--page", default="docs/ablation.md", help="the Markdown page (figures go to its img/)")
    p.add_argument("--page-only", action="store_true", help="write the page from the runs already in --out")
    args = p.parse_args(argv)
    args.variants = [
        v.strip() for item in args.variants for v in (item.split(",") if "," in item else [item])
    ]
    args.variants = [v for v in args.variants if v]
    args.variants = list(dict.fromkeys(n for v in args.variants for n in GROUPS.get(v, [v])))
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        p.error(f"unknown variants {unknown}; choose from {list(VARIANTS)} or the groups {list(GROUPS)}")
    if args.threads is None:
        args.threads = max(1, (os.cpu_count() or 1) // max(1, args.workers))
    return args


def slug(name: str) -> str:
    """Returns a folder-safe name for a variant."""
    return "".join(c if c.isalnum() else "_" for c in name).strip("_")


def run_dir(out: Path, name: str, seed: int) -> Path:
    """Returns the run directory of one variant x seed under out."""
    return out / "runs" / f"{slug(name)}-s{seed}"


def warm_start_command(out: Path, task: str = "demo") -> list[str]:
    """Returns the command that builds the task's warm start under out/warm."""
    # Both need at least one GRPO step; the SFT model is saved before that step, as sft-model, and the
    # step-0 evaluation of that step is the warm start's held-out accuracy (summary.json's accuracy_before).
    if task == "code":
        script = str(CODE_SCRIPT.relative_to(ROOT))
        return [sys.executable, script, "--steps", "1", "--seed", "0", "--out", str(out / "warm")]
    return [sys.executable, "-m", "cohort", "demo", "--steps", "1", "--seed", "0", "--out", str(out / "warm")]


def warm_start(out: Path, task: str = "demo") -> Path:
    """Returns the task's SFT warm start under out/warm, building it (warm_start_command) if needed."""
    model = out / "warm" / "sft-model"
    if not (model / "config.json").is_file():
        cmd = warm_start_command(out, task) + (["--no-progress"] if task == "demo" else [])
        print("building the warm start:", shlex.join(cmd), flush=True)
        # The code task's script is named relative to the repository root.
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, cwd=ROOT if task == "code" else None)
    return model


def code_recipe():
    """Returns examples/code_task.py as a module: its grpo_config is the code task's GRPO recipe."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("cohort_example_code_task", CODE_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def base_config(task: str, run: Path, model: Path, steps: int, seed: int):
    """Returns the task's GRPO recipe for one run, before COMMON, the variant and the harness's settings."""
    if task == "code":
        return code_recipe().grpo_config(run, model, steps=steps, seed=seed, lr=CODE_LR)
    from cohort.commands.demo import demo_config

    return demo_config(run, model, steps=steps, seed=seed)


def read_jsonl(path: Path) -> list[dict]:
    """Returns the rows of a JSON-lines file ([] when it is missing)."""
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def finished_steps(run: Path) -> int | None:
    """Returns the step count a run's summary.json says it completed (None: no summary, or interrupted)."""
    path = run / "summary.json"
    if not path.is_file():
        return None
    summary = json.loads(path.read_text())
    return None if summary.get("interrupted") else summary.get("steps")


def write_run_config(out: Path, model: Path, name: str, seed: int, args: argparse.Namespace) -> Path:
    """Returns the path of the run's YAML config, written from the demo recipe plus the variant's overrides."""
    from cohort.config import load_config, save_config

    run = run_dir(out, name, seed)
    base = base_config(args.task, run, model, args.steps, seed)
    # save_every=0 keeps only the final checkpoint; resume=auto lets a re-issued command restart a run that
    # was cut short (its logs are moved aside) instead of cohort refusing a folder that holds logs.
    settings = [
        f"eval_every={args.eval_every}",
        "save_every=0",
        "progress=false",
        "resume=auto",
        f"threads={args.threads}",
    ]
    cfg = load_config(None, [*COMMON, *VARIANTS[name], *settings], base=base)
    path = run.parent / f"{run.name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    save_config(cfg, path)
    return path


def run_one(out: Path, model: Path, name: str, seed: int, args: argparse.Namespace) -> dict:
    """Returns the run's result after training it (or reading it when it already finished)."""
    run = run_dir(out, name, seed)
    done = finished_steps(run)
    if done == args.steps:
        print(f"  {name} seed {seed}: already finished, skipped", flush=True)
        return collect(run, name, seed)
    if done is not None and done > args.steps:
        # cohort would refuse to resume a run past its end; another --out keeps both settings' runs apart.
        msg = f"{run} already holds a {done}-step run, more than --steps {args.steps}: use another --out"
        print(f"  {name} seed {seed}: FAILED\n{msg}", flush=True)
        return {"variant": name, "seed": seed, "failed": msg}
    path = write_run_config(out, model, name, seed, args)
    cmd = [sys.executable, "-m", "cohort", "train", str(path)]
    print(f"  {name} seed {seed}: {shlex.join(cmd)}", flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    (run.parent / f"{run.name}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0 or finished_steps(run) != args.steps:
        tail = proc.stderr[-2000:] or proc.stdout[-2000:]
        print(f"  {name} seed {seed}: FAILED (exit {proc.returncode})\n{tail}", flush=True)
        return {"variant": name, "seed": seed, "failed": tail, "command": shlex.join(cmd)}
    print(f"  {name} seed {seed}: done in {time.perf_counter() - t0:.0f} s", flush=True)
    return collect(run, name, seed)


def collect(run: Path, name: str, seed: int) -> dict:
    """Returns accuracy against step and training wall time, final and best accuracy, median s/step of a run."""
    # Later rows of a step win: a run restarted after an interruption may have logged a step twice.
    step_time = {r["step"]: r["step_time"] for r in read_jsonl(run / "metrics.jsonl") if "step_time" in r}
    evals = {e["step"]: e["accuracy"] for e in read_jsonl(run / "evals.jsonl") if "accuracy" in e}
    # Wall time is the sum of the step times up to the evaluation: the evaluations themselves are excluded,
    # so --eval-every does not change the time axis.
    elapsed, clock = {0: 0.0}, 0.0
    for step in sorted(step_time):
        clock += step_time[step]
        elapsed[step] = clock
    curve = [
        {"step": s, "seconds": round(elapsed.get(s, clock), 3), "accuracy": evals[s]} for s in sorted(evals)
    ]
    # Per-step training metrics, one row per step (the last one logged wins, as above).
    rows = {r["step"]: r for r in read_jsonl(run / "metrics.jsonl") if "step" in r}

    def run_mean(key: str, last: float = 1.0) -> float | None:
        """Returns the mean of a logged metric over the run's last `last` share of steps (None: never logged)."""
        steps = sorted(s for s, r in rows.items() if isinstance(r.get(key), int | float))
        steps = steps[int(len(steps) * (1 - last)) :]
        return statistics.mean(float(rows[s][key]) for s in steps) if steps else None

    return {
        "variant": name,
        "seed": seed,
        "run_dir": str(run),
        "command": shlex.join(["python", "-m", "cohort", "train", str(run.parent / f"{run.name}.yaml")]),
        "curve": curve,
        "accuracy_start": curve[0]["accuracy"] if curve and curve[0]["step"] == 0 else None,
        "final": curve[-1]["accuracy"] if curve else math.nan,
        "best": max(p["accuracy"] for p in curve) if curve else math.nan,
        "s_per_step": statistics.median(step_time.values()) if step_time else math.nan,
        # Share of completion tokens the loss clipped (ratio clip; for dppo its mask) and the off-policy mask
        # dropped, mean over the run; entropy (nats per token) and reward over the last tenth of the steps.
        "clip_frac": run_mean("clip_ratio/region_mean"),
        "mask_frac": run_mean("off_policy_mask/dropped_frac"),
        "entropy_end": run_mean("entropy", 0.1),
        "reward_end": run_mean("reward", 0.1),
        "steps": max(step_time, default=0),
    }


def harness_command(args: argparse.Namespace) -> str:
    """Returns the run.py command line that reproduces these settings (without --page-only)."""
    cmd = ["python", "benchmarks/ablation/run.py", "--out", str(args.out)]
    if args.task != "demo":
        cmd += ["--task", args.task]
    cmd += ["--steps", str(args.steps)]
    cmd += ["--eval-every", str(args.eval_every), "--seeds", *map(str, args.seeds)]
    if args.variants != list(VARIANTS):
        cmd += ["--variants", *args.variants]
    if args.warm_start:
        cmd += ["--warm-start", str(args.warm_start)]
    cmd += ["--workers", str(args.workers), "--threads", str(args.threads), "--page", str(args.page)]
    return shlex.join(cmd)


def write_results(out: Path, args: argparse.Namespace, warm: dict, results: list[dict]) -> Path:
    """Returns the path of OUT/results.json after writing the settings, the warm start and the runs into it."""
    from benchmarks.ablation.page import machine_info

    settings = {
        "command": harness_command(args),
        "task": args.task,
        "steps": args.steps,
        "eval_every": args.eval_every,
        "seeds": args.seeds,
        "variants": args.variants,
        "workers": args.workers,
        "threads": args.threads,
        "common": COMMON,
        "machine": machine_info(),
    }
    path = out / "results.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"settings": settings, "warm_start": warm, "runs": results}, indent=1))
    tmp.replace(path)  # a reader (page.py while the harness runs) never sees half a file
    return path


def warm_start_info(out: Path, args: argparse.Namespace) -> tuple[Path, dict]:
    """Returns the warm-start model folder and its description (how it was made, its held-out accuracy)."""
    if args.warm_start:
        model = Path(args.warm_start)
        if not (model / "config.json").is_file():
            raise SystemExit(f"--warm-start {model}: no config.json there (pass a saved model folder)")
        return model, {"model": str(model), "command": None, "accuracy": None}
    model = warm_start(out, args.task)
    summary = out / "warm" / "summary.json"
    # The trainer's step-0 evaluation of the demo run is the held-out greedy accuracy of the SFT model.
    acc = json.loads(summary.read_text()).get("accuracy_before") if summary.is_file() else None
    return model, {
        "model": str(model),
        "command": shlex.join(["python", *warm_start_command(out, args.task)[1:]]),
        "accuracy": acc,
    }


def main(argv: list[str] | None = None) -> None:
    """Runs (or reads) every variant x seed, then writes results.json and the page."""
    from benchmarks.ablation.page import write_page

    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.page_only:
        write_page(Path(args.page), out)
        print(f"wrote {args.page}")
        return
    model, warm = warm_start_info(out, args)
    jobs = [(name, seed) for seed in args.seeds for name in args.variants]
    print(f"{len(jobs)} runs of {args.steps} steps from {model}, {args.workers} at a time", flush=True)
    results: list[dict] = []
    lock = threading.Lock()

    def job(item: tuple[str, int]) -> dict:
        result = run_one(out, model, item[0], item[1], args)
        with lock:  # results.json grows run by run, so an interrupted ablation still leaves its numbers
            results.append(result)
            write_results(out, args, warm, results)
        return result

    with ThreadPoolExecutor(max_workers=max(1, args.workers)) as pool:
        ordered = list(pool.map(job, jobs))
    write_results(out, args, warm, ordered)
    write_page(Path(args.page), out)
    failed = [r for r in ordered if "failed" in r]
    print(f"wrote {args.page} and {out / 'results.json'}; {len(failed)} of {len(ordered)} runs failed")


if __name__ == "__main__":
    main()
