"""Every loss type, advantage estimator and entropy control on the demo task, from one warm start, several seeds.

    python benchmarks/ablation/run.py --out runs/ablation                    # 14 variants x 3 seeds x 800 steps
    python benchmarks/ablation/run.py --out runs/ablation --variants cispo,sapo --seeds 0 --steps 100
    python benchmarks/ablation/run.py --out runs/ablation --page-only        # redraw the page from the runs

The warm start is the demo's (`cohort demo --seed 0`: the tiny Qwen2 model after its SFT cold start), built
once under OUT/warm. Each variant is the demo's GRPO recipe (dapo loss, clip-higher, dynamic sampling,
temperature 1.2, lr 1.5e-4) split into 4 minibatches (COMMON below: why) with only the listed options changed, trained with `cohort train` for --steps
steps at each seed (the seed changes sampling and shuffling, not the warm start), evaluated on the 200
held-out problems every --eval-every steps. A run already finished is not run again, so the command can be
re-issued after an interruption. --workers runs that many trainings side by side, each on
--threads threads. Writes OUT/results.json and the page (--page, default docs/ablation.md) with its figures
next to it (img/ablation_*.png): held-out accuracy against training wall time (the sum of step times, evaluation
excluded), the mean over seeds bold and each seed faint.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

BASELINE = "dapo (the demo)"
# The demo trains once per batch (one optimizer step), where every ratio is exactly 1 and the losses that
# differ only off-policy coincide (cispo and sapo give dapo's and grpo's gradient there). Four minibatches
# make three of every four steps off-policy, as TRL's steps_per_generation does, so the losses can differ.
COMMON: dict[str, object] = {"algo.num_minibatches": 4}
VARIANTS: dict[str, dict[str, object]] = {
    BASELINE: {},
    "grpo": {"algo.loss_type": "grpo"},
    "bnpo": {"algo.loss_type": "bnpo"},
    "dr_grpo": {"algo.loss_type": "dr_grpo", "algo.scale": "none"},
    "gspo": {
        "algo.loss_type": "grpo",
        "algo.importance": "sequence",
        "algo.eps_low": 3e-4,
        "algo.eps_high": 4e-4,
    },
    "cispo": {"algo.loss_type": "cispo", "algo.eps_high": None},
    "sapo": {"algo.loss_type": "sapo", "algo.eps_high": None},
    "gmpo": {"algo.loss_type": "gmpo", "algo.eps_high": None},
    "rloo": {"algo.advantage": "rloo"},
    "reinforce++": {"algo.advantage": "reinforce_pp"},
    "reinforce++ baseline": {"algo.advantage": "reinforce_pp_baseline"},
    "top-20% entropy": {"algo.top_entropy_quantile": 0.2},
    "clip-cov": {"algo.cov_method": "clip_cov"},
    "kl-cov": {"algo.cov_method": "kl_cov"},
}
PANELS = {
    "losses": [BASELINE, "grpo", "bnpo", "dr_grpo", "gspo", "cispo", "sapo", "gmpo"],
    "advantages": [BASELINE, "rloo", "reinforce++", "reinforce++ baseline"],
    "entropy": [BASELINE, "top-20% entropy", "clip-cov", "kl-cov"],
}


def parse_args(argv=None) -> argparse.Namespace:
    """Returns the command-line options."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/ablation")
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma list of variant names")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--page", default="docs/ablation.md")
    p.add_argument("--page-only", action="store_true")
    args = p.parse_args(argv)
    args.variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        p.error(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    return args


def slug(name: str) -> str:
    """Returns a folder-safe name for a variant."""
    return "".join(c if c.isalnum() else "_" for c in name).strip("_")


def warm_start(out: Path) -> Path:
    """Returns the demo's SFT warm start under out/warm, building it with `cohort demo --steps 1` if needed."""
    model = out / "warm" / "sft-model"
    if not (model / "config.json").is_file():
        cmd = [
            sys.executable,
            "-m",
            "cohort",
            "demo",
            "--steps",
            "1",
            "--seed",
            "0",
            "--out",
            str(out / "warm"),
        ]
        print("building the warm start:", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return model


def run_one(out: Path, model: Path, name: str, seed: int, args) -> dict:
    """Returns the run's result after training it (or reading it when it already finished)."""
    from cohort.config import save_config
    from cohort.demo import demo_config

    run = out / "runs" / f"{slug(name)}-s{seed}"
    done = run / "summary.json"
    if not done.is_file():
        cfg = demo_config(run, model, steps=args.steps, seed=seed)
        cfg.eval_every, cfg.save_every, cfg.progress = args.eval_every, 0, False
        cfg.threads = args.threads
        run.mkdir(parents=True, exist_ok=True)
        path = run.parent / f"{run.name}.yaml"
        save_config(cfg, path)
        text = yaml.safe_load(path.read_text())
        for key, value in {**COMMON, **VARIANTS[name]}.items():
            node = text
            *parents, last = key.split(".")
            for part in parents:
                node = node.setdefault(part, {})
            node[last] = value
        path.write_text(yaml.safe_dump(text, sort_keys=False))
        cmd = [sys.executable, "-m", "cohort", "train", str(path)]
        t0 = time.time()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"  {name} seed {seed}: FAILED\n{proc.stderr[-2000:]}", flush=True)
            return {"variant": name, "seed": seed, "failed": proc.stderr[-2000:]}
        print(f"  {name} seed {seed}: {time.time() - t0:.0f} s", flush=True)
    return collect(run, name, seed)


def collect(run: Path, name: str, seed: int) -> dict:
    """Returns accuracy against step and training wall time from a finished run's logs."""
    steps = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    evals = [json.loads(x) for x in (run / "evals.jsonl").read_text().splitlines() if x.strip()]
    elapsed, clock = {0: 0.0}, 0.0
    for row in steps:
        clock += row["step_time"]
        elapsed[row["step"]] = clock
    curve = [(e["step"], elapsed.get(e["step"], clock), e["accuracy"]) for e in evals if "accuracy" in e]
    return {
        "variant": name,
        "seed": seed,
        "curve": curve,
        "final": curve[-1][2] if curve else math.nan,
        "best": max(a for _, _, a in curve) if curve else math.nan,
        "s_per_step": statistics.median(r["step_time"] for r in steps),
    }


def summarise(results: list[dict]) -> dict[str, dict]:
    """Returns, per variant, the mean and spread of the final accuracies over seeds."""
    out: dict[str, dict] = {}
    for name in VARIANTS:
        rows = [r for r in results if r["variant"] == name and "failed" not in r]
        if not rows:
            continue
        finals = [r["final"] for r in rows]
        out[name] = {
            "seeds": [r["seed"] for r in rows],
            "finals": finals,
            "mean": statistics.mean(finals),
            "sd": statistics.stdev(finals) if len(finals) > 1 else 0.0,
            "best": statistics.mean(r["best"] for r in rows),
            "s_per_step": statistics.median(r["s_per_step"] for r in rows),
        }
    base = out.get(BASELINE)
    for stats in out.values():
        if base is None or len(stats["finals"]) < 2 or len(base["finals"]) < 2:
            stats["diff"], stats["beyond_noise"] = None, None
            continue
        diff = stats["mean"] - base["mean"]
        se = math.sqrt(stats["sd"] ** 2 / len(stats["finals"]) + base["sd"] ** 2 / len(base["finals"]))
        stats["diff"], stats["se"] = diff, se
        stats["beyond_noise"] = abs(diff) > 2 * se
    return out


def plot(results: list[dict], folder: Path) -> list[Path]:
    """Returns the PNG files written: one panel per family, accuracy against training wall time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    files = []
    for panel, names in PANELS.items():
        fig, ax = plt.subplots(figsize=(7, 4.2))
        for i, name in enumerate(names):
            runs = [r for r in results if r["variant"] == name and r.get("curve")]
            if not runs:
                continue
            color = f"C{i}"
            for r in runs:
                ax.plot(
                    [t for _, t, _ in r["curve"]],
                    [100 * a for _, _, a in r["curve"]],
                    color=color,
                    alpha=0.25,
                    lw=1,
                )
            n = min(len(r["curve"]) for r in runs)
            xs = [statistics.mean(r["curve"][k][1] for r in runs) for k in range(n)]
            ys = [100 * statistics.mean(r["curve"][k][2] for r in runs) for k in range(n)]
            ax.plot(xs, ys, color=color, lw=2.2 if name == BASELINE else 1.8, label=name, marker="o", ms=3)
        ax.set_xlabel("training wall time (s, evaluation excluded)")
        ax.set_ylabel("held-out greedy accuracy (%)")
        ax.set_title(f"demo task: {panel} (mean over seeds bold, each seed faint)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
        fig.tight_layout()
        path = folder / f"ablation_{panel}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        files.append(path)
    return files


def write_page(page: Path, results: list[dict], args, warm_acc: float | None) -> None:
    """Writes the Markdown page: commands, setting, the table and the figures."""
    import torch
    import transformers

    import cohort

    stats = summarise(results)
    files = plot(results, page.parent / "img")
    lines = [
        "# Ablation: the GRPO family on the demo task",
        "",
        "<!-- generated by benchmarks/ablation/run.py; the prose below the table is written by hand -->",
        "",
        f"Command: `python benchmarks/ablation/run.py --out {args.out} --steps {args.steps} --eval-every "
        f"{args.eval_every} --seeds {' '.join(map(str, args.seeds))} --workers {args.workers} --threads {args.threads}`",
        "",
        f"Setting: the demo's warm start (seed 0 SFT, held-out accuracy {'%.1f %%' % (100 * warm_acc) if warm_acc is not None else 'n/a'}), "
        f"the demo's GRPO recipe split into 4 minibatches per batch (so that 3 of 4 optimizer steps are off-policy) "
        f"with one change per row, {args.steps} steps, held-out greedy accuracy on 200 "
        f"problems every {args.eval_every} steps, seeds {', '.join(map(str, args.seeds))}. "
        f"{time.strftime('%Y-%m-%d')}, {platform.machine()} CPU ({args.workers} runs side by side, {args.threads} "
        f"thread each), torch {torch.__version__}, transformers {transformers.__version__}, cohort {cohort.__version__}.",
        "",
        f"Noise rule: a difference from `{BASELINE}` counts when |mean difference| > 2 x its standard error "
        "(sqrt(sd_a^2 / n_a + sd_b^2 / n_b) over seeds).",
        "",
        "| variant | options | final accuracy, mean ± sd | per seed | best (mean) | s/step | vs the demo |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, s in stats.items():
        opts = ", ".join(f"`{k}={v}`" for k, v in VARIANTS[name].items()) or "(the demo's recipe)"
        if s.get("diff") is None or name == BASELINE:
            versus = "—"
        else:
            versus = f"{100 * s['diff']:+.1f} pts ({'beyond' if s['beyond_noise'] else 'within'} noise)"
        per_seed = " / ".join(f"{100 * f:.1f}" for f in s["finals"])
        lines.append(
            f"| {name} | {opts} | {100 * s['mean']:.1f} ± {100 * s['sd']:.1f} % | {per_seed} | "
            f"{100 * s['best']:.1f} % | {s['s_per_step']:.3f} | {versus} |"
        )
    failed = [r for r in results if "failed" in r]
    if failed:
        lines += ["", "Failed runs: " + ", ".join(f"{r['variant']} (seed {r['seed']})" for r in failed)]
    lines += [""]
    for f in files:
        lines += [f"![{f.stem}](img/{f.name})", ""]
    marker = "<!-- hand-written below -->"
    old = page.read_text().split(marker, 1)[1] if page.is_file() and marker in page.read_text() else "\n"
    page.write_text("\n".join(lines) + "\n" + marker + old)


def main(argv=None) -> None:
    """Runs (or reads) every variant x seed, then writes results.json and the page."""
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = warm_start(out)
    warm = out / "warm" / "summary.json"
    warm_acc = json.loads(warm.read_text()).get("accuracy_before") if warm.is_file() else None
    jobs = [(name, seed) for seed in args.seeds for name in args.variants]
    if args.page_only:
        results = [
            collect(out / "runs" / f"{slug(n)}-s{s}", n, s)
            for n, s in jobs
            if (out / "runs" / f"{slug(n)}-s{s}" / "summary.json").is_file()
        ]
    else:
        with ThreadPoolExecutor(max_workers=args.workers) as pool:
            results = list(pool.map(lambda job: run_one(out, model, job[0], job[1], args), jobs))
    (out / "results.json").write_text(json.dumps(results, indent=1))
    write_page(Path(args.page), results, args, warm_acc)
    print(f"wrote {args.page} and {out / 'results.json'}")


if __name__ == "__main__":
    main()
