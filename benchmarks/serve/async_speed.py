"""Rollout workers against in-process sampling on this machine: throughput and time to accuracy.

    python benchmarks/serve/async_speed.py speed   # demo and GSM8K shapes of benchmarks/vs_trl (~15 min)
    python benchmarks/serve/async_speed.py tta     # the demo's GRPO from its SFT warm start, to accuracy
    python benchmarks/serve/async_speed.py report  # tables and the curves' figure from the saved results

Three ways to run the same step, each in fresh processes through benchmarks/vs_trl/run.py (cohort only):
  inprocess   the trainer samples itself, with 2 torch threads (today's default on a 2-core machine);
  worker-s0   one local rollout worker (1 thread) and the trainer (1 thread), rollout.max_staleness 0;
  worker-s1   the same at rollout.max_staleness 1: the worker samples the next step's batch while the
              trainer scores and updates.
The configurations alternate within each pass (passes are repeated) so the machine's drift hits all three.
Results go to runs/bench-serve/<section>-<config>-p<pass>.json; `report` reads them back.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.plotting import save_figure  # noqa: E402

CONFIGS: dict[str, tuple[int, list[str]]] = {
    "inprocess": (2, []),
    "worker-s0": (1, ["rollout.workers=1", "rollout.max_staleness=0"]),
    "worker-s1": (1, ["rollout.workers=1", "rollout.max_staleness=1"]),
}
"""Name -> (torch threads of the trainer, cohort config overrides)."""

MILESTONES = (0.40, 0.50, 0.60)
"""Held-out greedy accuracies whose first crossing the time-to-accuracy table reports (warm start ~34 %)."""


def parse_args(argv=None) -> argparse.Namespace:
    """Returns the command-line options."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("section", choices=["speed", "tta", "report"])
    p.add_argument("--workdir", default="runs/bench-serve", help="results and scratch (models are reused)")
    p.add_argument("--passes", type=int, default=2, help="passes over the configurations (speed)")
    p.add_argument("--first-pass", type=int, default=0, help="number of the first pass (to add passes later)")
    p.add_argument("--workloads", default="a_demo:14m,b_gsm8k:14m", help="vs_trl workloads (speed)")
    p.add_argument("--seeds", default="0,1", help="seeds of the time-to-accuracy runs (tta)")
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma list of configurations")
    p.add_argument("--tta-max-seconds", type=float, default=300.0, help="training-time budget per tta run")
    p.add_argument("--tta-eval-every", type=int, default=25, help="evaluate every this many steps (tta)")
    p.add_argument("--tta-target", type=float, default=MILESTONES[-1], help="stop a tta run at this accuracy")
    p.add_argument(
        "--idle-wait",
        type=float,
        default=300.0,
        help="before each run, wait up to this long for an idle machine",
    )
    p.add_argument("--figure", default="docs/img/async_tta.png", help="the report's curves figure")
    return p.parse_args(argv)


def run_vs_trl(args, section: str, config: str, tag: str, extra: list[str]) -> None:
    """Runs one benchmarks/vs_trl/run.py section for one configuration, writing its results JSON."""
    threads, overrides = CONFIGS[config]
    out = Path(args.workdir) / f"{tag}.json"
    command = [
        sys.executable, str(ROOT / "benchmarks/vs_trl/run.py"), "--sections", section, "--frameworks", "cohort",
        "--threads", str(threads), "--workdir", str(Path(args.workdir) / "vs_trl"), "--out", str(out),
        "--idle-wait", str(args.idle_wait), *extra,
    ]  # fmt: skip
    for o in overrides:
        command += ["--override", o]
    print(f"== {tag}: {' '.join(command[2:])}", flush=True)
    subprocess.run(command, check=True, cwd=ROOT)


def speed(args) -> None:
    """Runs the speed section of each configuration, in alternation, `passes` times."""
    for p in range(args.first_pass, args.first_pass + args.passes):
        for config in args.configs.split(","):
            extra = ["--workloads", args.workloads, "--rounds", "1"]
            run_vs_trl(args, "speed", config, f"speed-{config}-p{p}", extra)


def tta(args) -> None:
    """Runs the time-to-accuracy section of each configuration for each seed (the seeds' warm starts are shared)."""
    for seed in args.seeds.split(","):
        for config in args.configs.split(","):
            extra = ["--tta-seeds", seed, "--tta-target", str(args.tta_target), "--tta-warm-threads", "2"]
            extra += [
                "--tta-max-seconds",
                str(args.tta_max_seconds),
                "--tta-eval-every",
                str(args.tta_eval_every),
            ]
            run_vs_trl(args, "tta", config, f"tta-{config}-s{seed}", extra)


def _load(workdir: Path, pattern: str) -> dict[str, dict]:
    return {f.stem: json.loads(f.read_text()) for f in sorted(workdir.glob(pattern))}


def report(args) -> None:
    """Prints the throughput and time-to-accuracy tables (markdown) and saves the curves' figure."""
    workdir = Path(args.workdir)
    speeds = _load(workdir, "speed-*.json")
    by: dict[tuple[str, str], list[dict]] = {}
    for tag, result in speeds.items():
        config = tag.removeprefix("speed-").rsplit("-p", 1)[0]
        for entry in result.get("speed", []):
            by.setdefault((f"{entry['workload']} {entry['model']}", config), []).append(entry["cohort"])
    if by:
        print(
            "| workload | configuration | s/step (each pass) | completions/s | generate s | update s | others' CPU |"
        )
        print("|---|---|---|---|---|---|---|")
        for (workload, config), runs in sorted(by.items()):
            steps = [r["seconds_per_step"] for r in runs]
            step = statistics.median(steps)
            print(
                f"| {workload} | {config} | {step:.3f} ({', '.join(f'{s:.3f}' for s in steps)}) | "
                f"{statistics.median(r['completions_per_s'] for r in runs):.1f} | "
                f"{statistics.median(r['seconds_generate'] for r in runs):.3f} | "
                f"{statistics.median(r['seconds_update'] for r in runs):.3f} | "
                + ", ".join(f"{100 * max(r['others_cpu_during']):.0f} %" for r in runs)
                + " |"
            )
    curves = {}
    for tag, result in _load(workdir, "tta-*.json").items():
        for run in result.get("tta", {}).get("runs", []):
            curves[tag] = run["cohort"]
    if not curves:
        return
    print()
    print("| run | s/step | " + " | ".join(f"s to {m:.0%}" for m in MILESTONES) + " | final accuracy |")
    print("|---|---|" + "---|" * len(MILESTONES) + "---|")
    for tag, c in sorted(curves.items()):
        hits = [next((p for p in c["curve"] if p["accuracy"] >= m), None) for m in MILESTONES]
        cells = [f"{h['seconds']:.0f} (step {h['step']})" if h else "-" for h in hits]
        print(
            f"| {tag} | {c['seconds_per_step']:.3f} | "
            + " | ".join(cells)
            + f" | {c['final_accuracy']:.0%} |"
        )
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    colours = {"inprocess": "tab:blue", "worker-s0": "tab:green", "worker-s1": "tab:red"}
    for tag, c in sorted(curves.items()):
        config = tag.removeprefix("tta-").rsplit("-s", 1)[0]
        xs = [p["seconds"] for p in c["curve"]]
        steps = [p["step"] for p in c["curve"]]
        ys = [p["accuracy"] for p in c["curve"]]
        style = {"color": colours.get(config), "label": tag.removeprefix("tta-"), "marker": "."}
        style["linestyle"] = "-" if tag.endswith("s0") else "--"
        axes[0].plot(xs, ys, **style)
        axes[1].plot(steps, ys, **style)
    axes[0].set_xlabel("training seconds (evaluation excluded)")
    axes[1].set_xlabel("GRPO step")
    for ax in axes:
        ax.set_ylabel("held-out greedy accuracy")
    fig.suptitle("demo GRPO from its SFT warm start: in-process (2 threads) vs one worker + trainer (1 + 1)")
    save_figure(fig, axes, ROOT / args.figure)


def main(argv=None) -> None:
    """Runs the chosen section."""
    args = parse_args(argv)
    Path(args.workdir).mkdir(parents=True, exist_ok=True)
    {"speed": speed, "tta": tta, "report": report}[args.section](args)


if __name__ == "__main__":
    main()
