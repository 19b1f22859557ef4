"""The ablation's Markdown page and figures, from the runs in an ablation folder (run.py calls it at the end).

    python benchmarks/ablation/page.py --out runs/ablation --page docs/ablation.md

Reads every finished run under OUT/runs (the run directories are the source of the numbers; OUT/results.json
adds the harness's settings, the warm start and the failed runs), and writes the page: the commands, the
machine and versions, the warm start's held-out accuracy, one table row per variant (final accuracy mean ± sd
over seeds and each seed's value, best accuracy, median s/step, the difference from the demo's recipe and
whether it exceeds the seed noise) and two figures per family of variants (img/<page name>_<panel>.png next to the
page): held-out accuracy against training wall time, the mean over seeds bold and each seed faint; and
(img/<page name>_<panel>_reward.png) the training reward logged at each step (metrics.jsonl's `reward`), the mean
over seeds as a trailing moving average (REWARD_WINDOW steps for the task), in the same colours.

The task (results.json's settings.task, from run.py's --task) names the recipe, the warm start and the
held-out metric in the text and the figures. Only numbers are generated. Text below the line `<!-- hand-written below -->` of an existing page is kept as
it is, so the prose written there survives a redraw.
"""

from __future__ import annotations

import argparse
import collections
import importlib.metadata
import json
import math
import os
import platform
import re
import shlex
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `benchmarks` as a package

from benchmarks.ablation.run import (  # noqa: E402
    BASELINE,
    COMMON,
    PANEL_TITLES,
    PANELS,
    VARIANTS,
    collect,
    finished_steps,
    slug,
)

MARKER = "<!-- hand-written below -->"
# The words the page and its figures use for each task of run.py's --task (results.json's settings.task;
# "demo" when a results.json from before --task does not say).
TASK_TEXT: dict[str, dict[str, str]] = {
    "demo": {
        "title": "the demo task",
        "figure": "Demo task",
        "recipe": "the demo's GRPO recipe (`cohort.commands.demo.DEMO_GRPO`)",
        "baseline": "(the demo's recipe)",
        "note": "",
        "warm": "",
        "metric": "held-out greedy accuracy on the demo's held-out problems",
        "axis": "held-out greedy accuracy (%)",
    },
    "code": {
        "title": "the code task",
        "figure": "Code task",
        "recipe": (
            "the code task's GRPO recipe (`grpo_config` in examples/code_task.py: dapo loss with eps 0.2 / 0.28, "
            "β 0, G = 8, 64 completions a step of up to 40 tokens at temperature 1, lr 2e-4 after 10 warm-up "
            "steps, the `code` reward run in the bubblewrap sandbox)"
        ),
        "baseline": "(the code task's recipe)",
        "note": (
            f"- Baseline: `{BASELINE}` is the harness's name for the recipe without overrides; on this page it is "
            "the code task's recipe, whose loss is dapo too.\n"
        ),
        "warm": (
            " (examples/code_task.py: the demo's tiny Qwen2 model, 0.59 M parameters, after SFT on the reference "
            "programs of the 1,000 training problems until its greedy pass rate on 100 of them reached 30 %)"
        ),
        "metric": "held-out greedy pass rate (every test passed) on the code task's 100 held-out problems",
        "axis": "held-out greedy pass rate (%)",
    },
}
# The trailing moving average of the reward figures, in steps: about 30 points of smoothing on the demo's
# 300-step runs, 16 on the code task's 80 (its steps are slower and fewer).
REWARD_WINDOW: dict[str, int] = {"demo": 10, "code": 5}
NOISE_RULE = (
    "a variant's difference from `{base}` counts as beyond the seed noise when |mean difference| > 2 x its "
    "standard error, sqrt(sd_a² / n_a + sd_b² / n_b), with sd the sample standard deviation of the final "
    "accuracies over seeds (n - 1 in the denominator); it needs at least 2 seeds on both sides"
)


def machine_info() -> dict[str, str]:
    """Returns this machine's CPU, core count, OS and the torch / transformers / cohort / Python versions."""
    import cohort

    cpu = platform.processor() or platform.machine()
    try:
        names = re.findall(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.M)
        cpu = names[0].strip() if names else cpu
    except OSError:
        pass  # not Linux: platform's answer stands

    def version(dist: str) -> str:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    return {
        "cpu": cpu,
        "cores": str(os.cpu_count()),
        "os": platform.platform(),
        "python": platform.python_version(),
        "torch": version("torch"),
        "transformers": version("transformers"),
        "cohort": cohort.__version__,
    }


def _run_yaml(path: Path) -> dict:
    """Returns the keys of a run's YAML config the page reports (steps, eval_every, threads, seed)."""
    import yaml

    cfg = yaml.safe_load(path.read_text()) or {}
    return {k: cfg.get(k) for k in ("steps", "eval_every", "threads", "seed")}


def load_results(out: Path) -> tuple[dict, dict, list[dict]]:
    """Returns (settings, warm start, runs) of an ablation folder, re-reading every finished run's logs."""
    path = out / "results.json"
    saved = json.loads(path.read_text()) if path.is_file() else {}
    if isinstance(saved, list):  # results.json of the first version of run.py: a bare list of runs
        saved = {"runs": saved}
    settings, warm = dict(saved.get("settings", {})), dict(saved.get("warm_start", {}))
    by_slug = {slug(name): name for name in VARIANTS}
    configs = {}
    for yml in sorted((out / "runs").glob("*.yaml")):
        match = re.fullmatch(r"(.+)-s(\d+)", yml.stem)
        if match and match.group(1) in by_slug:
            configs[(by_slug[match.group(1)], int(match.group(2)))] = _run_yaml(yml)
    # Settings the harness did not record (results.json missing or from the first version): from the configs.
    if "steps" not in settings and configs:
        counts = collections.Counter(c["steps"] for c in configs.values())
        settings["steps"] = counts.most_common(1)[0][0]
    for key in ("eval_every", "threads"):
        if key not in settings and configs:
            settings[key] = collections.Counter(c[key] for c in configs.values()).most_common(1)[0][0]
    if "seeds" not in settings:
        settings["seeds"] = sorted({seed for _, seed in configs})
    runs, seen = [], set()
    for (name, seed), _cfg in sorted(
        configs.items(), key=lambda kv: (list(VARIANTS).index(kv[0][0]), kv[0][1])
    ):
        run = out / "runs" / f"{slug(name)}-s{seed}"
        if finished_steps(run) == settings.get("steps"):
            runs.append(collect(run, name, seed))
            seen.add((name, seed))
    # A failure is reported unless the run has finished since (a later invocation succeeded).
    for r in saved.get("runs", []):
        if "failed" in r and (r["variant"], r["seed"]) not in seen:
            runs.append(r)
            seen.add((r["variant"], r["seed"]))
    if warm.get("accuracy") is None and (out / "warm" / "summary.json").is_file():
        warm["accuracy"] = json.loads((out / "warm" / "summary.json").read_text()).get("accuracy_before")
        warm.setdefault("model", str(out / "warm" / "sft-model"))
        from benchmarks.ablation.run import warm_start_command

        task = settings.get("task", "demo")
        warm.setdefault("command", shlex.join(["python", *warm_start_command(out, task)[1:]]))
    return settings, warm, runs


def _mean_of(rows: list[dict], key: str) -> float | None:
    """Returns the mean of a run-level number over the seeds that have it (None: none has it)."""
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.mean(values) if values else None


def summarise(runs: list[dict]) -> dict[str, dict]:
    """Returns, per variant with a finished run, its seeds' final accuracies, their mean, sd and the comparison."""
    stats: dict[str, dict] = {}
    for name in VARIANTS:
        rows = sorted(
            (r for r in runs if r["variant"] == name and "failed" not in r), key=lambda r: r["seed"]
        )
        if not rows:
            continue
        finals = [r["final"] for r in rows]
        stats[name] = {
            "seeds": [r["seed"] for r in rows],
            "finals": finals,
            "n": len(finals),
            "mean": statistics.mean(finals),
            "sd": statistics.stdev(finals) if len(finals) > 1 else None,
            "best": statistics.mean(r["best"] for r in rows),
            "best_max": max(r["best"] for r in rows),
            "s_per_step": statistics.median(r["s_per_step"] for r in rows),
            "train_seconds": statistics.mean(
                r["curve"][-1]["seconds"] if r["curve"] else math.nan for r in rows
            ),
            **{key: _mean_of(rows, key) for key in ("clip_frac", "mask_frac", "entropy_end", "reward_end")},
        }
    base = stats.get(BASELINE)
    for name, s in stats.items():
        s["diff"] = s["se"] = s["beyond_noise"] = None
        if base is None or name == BASELINE:
            continue
        s["diff"] = s["mean"] - base["mean"]
        if s["sd"] is not None and base["sd"] is not None:
            s["se"] = math.sqrt(s["sd"] ** 2 / s["n"] + base["sd"] ** 2 / base["n"])
            s["beyond_noise"] = abs(s["diff"]) > 2 * s["se"]
    return stats


def mean_curve(runs: list[dict]) -> tuple[list[float], list[float]]:
    """Returns (mean seconds, mean accuracy in %) over runs at the evaluation steps every run has."""
    common = set.intersection(*({p["step"] for p in r["curve"]} for r in runs))
    xs, ys = [], []
    for step in sorted(common):
        points = [next(p for p in r["curve"] if p["step"] == step) for r in runs]
        xs.append(statistics.mean(p["seconds"] for p in points))
        ys.append(100 * statistics.mean(p["accuracy"] for p in points))
    return xs, ys


def reward_rows(run: dict) -> dict[int, float]:
    """Returns a run's logged training reward per step (metrics.jsonl's `reward`; the last row of a step wins)."""
    path = Path(run.get("run_dir", "")) / "metrics.jsonl"
    if "run_dir" not in run or not path.is_file():
        return {}
    rows = (json.loads(line) for line in path.read_text().splitlines() if line.strip())
    return {
        r["step"]: float(r["reward"])
        for r in rows
        if "step" in r and isinstance(r.get("reward"), int | float)
    }


def mean_reward_curve(runs: list[dict], window: int) -> tuple[list[int], list[float]]:
    """Returns (steps, reward) for runs: the mean over runs at the steps every run logged, then the trailing
    moving average over `window` steps (fewer at the start, where fewer steps exist)."""
    series = [reward_rows(r) for r in runs]
    series = [s for s in series if s]
    if not series:
        return [], []
    steps = sorted(set.intersection(*(set(s) for s in series)))
    means = [statistics.mean(s[step] for s in series) for step in steps]
    smooth = [statistics.mean(means[max(0, i + 1 - window) : i + 1]) for i in range(len(means))]
    return steps, smooth


def plot_rewards(
    runs: list[dict], colours: dict[str, str | None], path: Path, title: str, window: int
) -> Path | None:
    """Returns path after drawing the training reward against step of the variants in colours (in that order,
    in those colours), or None when no run logged a reward."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8.6, 4.4))
    drawn = 0
    for name, colour in colours.items():
        mine = [r for r in runs if r["variant"] == name]
        steps, reward = mean_reward_curve(mine, window)
        if not steps:
            continue
        drawn += 1
        ax.plot(
            steps, reward, color=colour, lw=2.4 if name == BASELINE else 1.4, label=f"{name} (n={len(mine)})"
        )
    if not drawn:
        plt.close(fig)
        return None
    ax.set_xlabel("step", fontsize=9)
    ax.set_ylabel(f"training reward, moving average over {window} steps", fontsize=9)
    ax.set_title(title, fontsize=10)
    ax.tick_params(labelsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot(runs: list[dict], folder: Path, stem: str = "ablation", task: str = "demo") -> list[Path]:
    """Returns the PNG files written: per family, folder/<stem>_<panel>.png (held-out accuracy against training
    wall time) followed by folder/<stem>_<panel>_reward.png (training reward against step, same colours)."""
    words = TASK_TEXT[task]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from cohort.report.plots import COLOURS

    folder.mkdir(parents=True, exist_ok=True)
    panels = dict(PANELS)
    # A variant added to VARIANTS but to no panel still gets drawn, with the baseline, in an extra panel.
    loose = [n for n in VARIANTS if n != BASELINE and not any(n in names for names in PANELS.values())]
    if loose:
        panels["other"] = [BASELINE, *loose]
    files = []
    drawn_by = {
        panel: [n for n in names if any(r["variant"] == n and r.get("curve") for r in runs)]
        for panel, names in panels.items()
    }
    for panel, drawn in drawn_by.items():
        if not any(n != BASELINE for n in drawn):
            continue  # a subset of the variants: a panel with the baseline alone compares nothing
        if any(set(drawn) < set(other) for other in drawn_by.values()):
            continue  # every line of it is in a larger panel already (a subset of the variants was run)
        fig, ax = plt.subplots(figsize=(8.6, 4.4))
        # The report's 8 colours, then tab10's other two: a panel of 9 members gets no repeated colour.
        others = iter([*COLOURS, "#bcbd22", "#7f7f7f"])
        # The baseline is black and thicker in every panel, so each panel reads against the same line.
        colours = {name: "black" if name == BASELINE else next(others, None) for name in drawn}
        for name in drawn:
            mine = [r for r in runs if r["variant"] == name and r.get("curve")]
            colour = colours[name]
            for r in mine:
                ax.plot(
                    [p["seconds"] for p in r["curve"]],
                    [100 * p["accuracy"] for p in r["curve"]],
                    color=colour,
                    alpha=0.22,
                    lw=0.9,
                )
            xs, ys = mean_curve(mine)
            label = f"{name} (n={len(mine)})"
            ax.plot(xs, ys, color=colour, lw=2.4 if name == BASELINE else 1.7, marker="o", ms=3, label=label)
        ax.set_xlabel("training wall time (s): the sum of step times, evaluations excluded", fontsize=9)
        ax.set_ylabel(words["axis"], fontsize=9)
        title = PANEL_TITLES.get(panel, "other variants")
        ax.set_title(f"{words['figure']}, {title}: mean over seeds (bold) and each seed (faint)", fontsize=10)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
        fig.tight_layout()
        path = folder / f"{stem}_{panel}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        files.append(path)
        window = REWARD_WINDOW.get(task, 10)
        reward_title = f"{words['figure']}, {title}: training reward\n(mean over seeds, moving average over {window} steps)"
        reward = plot_rewards(runs, colours, folder / f"{stem}_{panel}_reward.png", reward_title, window)
        if reward is not None:
            files.append(reward)
    return files


def pct(x: float | None, digits: int = 1) -> str:
    """Returns a share as a percentage string ('n/a' for None or NaN)."""
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.{digits}f}"


def run_dates(runs: list[dict]) -> str:
    """Returns the dates the finished runs' summary.json files were written, as 'first to last'."""
    stamps = sorted(
        (Path(r["run_dir"]) / "summary.json").stat().st_mtime
        for r in runs
        if "run_dir" in r and (Path(r["run_dir"]) / "summary.json").is_file()
    )
    if not stamps:
        return "n/a"
    first, last = (time.strftime("%Y-%m-%d", time.localtime(t)) for t in (stamps[0], stamps[-1]))
    return first if first == last else f"{first} to {last}"


def table(stats: dict[str, dict], task: str = "demo") -> list[str]:
    """Returns the Markdown lines of the results table, one row per variant with a finished run."""
    lines = [
        f"| variant | overrides | final accuracy (%), mean ± sd | per seed | best (%), mean / max | "
        f"median s/step | training time (s), mean | vs `{BASELINE}` (points ± se) | beyond noise | "
        "clipped / masked tokens (%) | entropy, reward (end) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in stats.items():
        opts = ", ".join(f"`{o}`" for o in VARIANTS[name]) or TASK_TEXT[task]["baseline"]
        spread = f"{pct(s['mean'])} ± {pct(s['sd'])}" if s["sd"] is not None else f"{pct(s['mean'])} (1 seed)"
        per_seed = ", ".join(f"s{seed}: {pct(f)}" for seed, f in zip(s["seeds"], s["finals"], strict=True))
        if name == BASELINE:
            versus, beyond = "(baseline)", "—"
        elif s["diff"] is None:
            versus, beyond = "n/a (no baseline run)", "n/a"
        else:
            se = f" ± {100 * s['se']:.1f}" if s["se"] is not None else ""
            versus = f"{100 * s['diff']:+.1f}{se}"
            beyond = (
                "n/a (< 2 seeds)" if s["beyond_noise"] is None else ("yes" if s["beyond_noise"] else "no")
            )
        clip = pct(s.get("clip_frac"), 2)
        if s.get("mask_frac") is not None:
            clip += f" / {pct(s['mask_frac'], 2)}"
        ent, rew = s.get("entropy_end"), s.get("reward_end")
        end = "n/a" if ent is None or rew is None else f"{ent:.3f}, {rew:.3f}"
        lines.append(
            f"| {name} | {opts} | {spread} | {per_seed} | {pct(s['best'])} / {pct(s['best_max'])} | "
            f"{s['s_per_step']:.3f} | {s['train_seconds']:.0f} | {versus} | {beyond} | {clip} | {end} |"
        )
    return lines


def write_page(page: Path, out: Path) -> list[Path]:
    """Returns the figure files after writing the page for the ablation folder `out` (the hand-written part kept)."""
    settings, warm, runs = load_results(out)
    task = settings.get("task", "demo")
    words = TASK_TEXT[task]
    done = [r for r in runs if "failed" not in r]
    failed = [r for r in runs if "failed" in r]
    stats = summarise(runs)
    # The figures are named after the page, so two pages in one folder (docs/ablation.md and
    # docs/ablation-2026.md) keep their own.
    files = plot(done, page.parent / "img", page.stem, task)
    machine = settings.get("machine") or machine_info()
    # results.json of the first version of run.py did not record the machine: this one's is the best guess.
    where = (
        "Machine"
        if settings.get("machine")
        else "Machine (where this page was written; not recorded with the runs)"
    )

    starts = sorted({r["accuracy_start"] for r in done if r.get("accuracy_start") is not None})
    warm_acc = warm.get("accuracy")
    if warm_acc is None and starts:
        warm_acc = starts[0]
    if not starts:
        agree = ""
    elif len(starts) == 1:
        agree = f"; every run's own step-0 evaluation gives {pct(starts[0])} % too"
    else:
        agree = f"; the runs' own step-0 evaluations range {pct(starts[0])} to {pct(starts[-1])} %"
    command = settings.get("command") or (
        f"python benchmarks/ablation/run.py --out {out}{' --task ' + task if task != 'demo' else ''} "
        f"--steps {settings.get('steps')} "
        f"--eval-every {settings.get('eval_every')} --seeds {' '.join(map(str, settings.get('seeds', [])))}"
    )
    seeds = settings.get("seeds", [])
    lines = [
        f"# Ablation: the GRPO family on {words['title']}",
        "",
        f"<!-- generated by benchmarks/ablation/page.py from {out}; the text under the hand-written marker at "
        "the end is kept on a redraw -->",
        "",
        "## Commands",
        "",
        "```",
        f"{command}   # every variant x seed, then this page",
        f"{warm.get('command') or '# warm start given with --warm-start: ' + str(warm.get('model'))}"
        + ("   # the warm start (run.py does it first)" if warm.get("command") else ""),
        f"python -m cohort train {out}/runs/<variant>-s<seed>.yaml   # one run (run.py writes the YAML)",
        f"python benchmarks/ablation/page.py --out {out} --page {page}   # this page and its figures",
        "```",
        "",
        "## Setting",
        "",
        f"- Warm start: `{warm.get('model')}`{words['warm']}, {words['metric'].split(' on ')[0]} "
        f"{pct(warm_acc)} %{agree}.",
        f"- Each run: {words['recipe']} with "
        f"{', '.join(f'`{c}`' for c in settings.get('common', COMMON))} and the variant's overrides, "
        f"{settings.get('steps')} steps, {words['metric']} every "
        f"{settings.get('eval_every')} steps and at the end, seeds {', '.join(map(str, seeds))}.",
        *([words["note"].rstrip("\n")] if words["note"] else []),
        f"- {where}: {machine['cpu']}, {machine['cores']} cores, {machine['os']}; "
        f"{settings.get('workers', 'n/a')} run(s) at a time, {settings.get('threads')} torch thread(s) each.",
        f"- Versions: torch {machine['torch']}, transformers {machine['transformers']}, cohort {machine['cohort']}, "
        f"Python {machine['python']}.",
        f"- Runs finished: {run_dates(done)}; page written {time.strftime('%Y-%m-%d')}.",
        "- Wall time: the sum of the logged `step_time` of the steps before an evaluation (evaluations excluded).",
        "",
        "## Results",
        "",
        f"Noise rule: {NOISE_RULE.format(base=BASELINE)}.",
        "",
        "Clipped / masked tokens: the share of completion tokens the loss clipped (`clip_ratio/region_mean`: the "
        "ratio clip, or the tokens dppo's trust-region mask drops) and, where it is on, the share the off-policy "
        "mask dropped (`off_policy_mask/dropped_frac`), each the mean over the run's steps. Entropy (nats per "
        "token, at the sampling temperature) and training reward: the mean over the last tenth of the steps.",
        "",
        "Figures: per family, held-out accuracy against training wall time, then the training reward (the mean "
        "`reward` of each step's completions, from metrics.jsonl) against step, the mean over seeds as a "
        f"trailing moving average over {REWARD_WINDOW.get(task, 10)} steps, in the same colours.",
        "",
        *table(stats, task),
        "",
    ]
    missing = [
        (name, seed)
        for name in settings.get("variants", list(VARIANTS))
        for seed in seeds
        if not any(r["variant"] == name and r["seed"] == seed for r in runs)
    ]
    if failed:
        lines += [
            "Failed runs (the last line of stderr; the whole of it in the run's .log next to its YAML):",
            "",
        ]
        for r in failed:
            last = next((x for x in reversed(r["failed"].strip().splitlines()) if x.strip()), "")
            last = last.strip().replace("`", "'")  # a backtick would end the inline code span
            lines.append(f"- {r['variant']}, seed {r['seed']}: `{last}`")
        lines.append("")
    if missing:
        lines += ["Not run (or not finished) yet: " + ", ".join(f"{n} (seed {s})" for n, s in missing), ""]
    for f in files:
        rel = os.path.relpath(f, page.parent)
        lines += [f"![{f.stem}]({rel})", ""]
    old = page.read_text() if page.is_file() else ""
    kept = old.split(MARKER, 1)[1] if MARKER in old else "\n"
    page.parent.mkdir(parents=True, exist_ok=True)
    page.write_text("\n".join(lines) + "\n" + MARKER + kept)
    return files


def main(argv: list[str] | None = None) -> None:
    """Writes the page and its figures from an ablation folder."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/ablation", help="the ablation folder run.py wrote")
    p.add_argument("--page", default="docs/ablation.md")
    args = p.parse_args(argv)
    files = write_page(Path(args.page), Path(args.out))
    print(f"wrote {args.page} and {len(files)} figures in {Path(args.page).parent / 'img'}")


if __name__ == "__main__":
    main()
