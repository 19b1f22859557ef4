"""Plot multiply-task runs of examples/tool_task.py: held-out accuracy and tool use against GRPO steps.

    python benchmarks/episodes/plot_tool_runs.py runs/tool-0 "seed 0" runs/tool-1 "seed 1" --out docs/img/tool_task.png

Reads each run's grpo/evals.jsonl (held-out greedy episodes: accuracy, tool calls per episode) and
grpo/metrics.jsonl (training episodes: the accuracy reward's mean and tools/call_frequency, as 20-step running
means). A run folder is examples/tool_task.py's --out (or its grpo/ folder itself).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `benchmarks` as a package
from benchmarks.plotting import jsonl_rows, running_mean  # noqa: E402


def main() -> None:
    """Writes the figure."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", help="pairs of run folder and label")
    parser.add_argument("--out", default="docs/img/tool_task.png")
    args = parser.parse_args()
    if len(args.runs) % 2:
        parser.error("give a label after every run folder")
    fig, (held, train) = plt.subplots(1, 2, figsize=(10, 3.6))
    for folder, label in zip(args.runs[::2], args.runs[1::2]):
        run = Path(folder) / "grpo" if (Path(folder) / "grpo").is_dir() else Path(folder)
        evals = jsonl_rows(run / "evals.jsonl")
        steps = [e["step"] for e in evals]
        line = held.plot(steps, [100 * e["accuracy"] for e in evals], marker="o", label=f"{label}: accuracy")
        color = line[0].get_color()
        held.plot(
            steps,
            [100 * e["tool_calls"] for e in evals],
            color=color,
            linestyle="--",
            marker="x",
            label=f"{label}: tool calls / episode",
        )
        metrics = jsonl_rows(run / "metrics.jsonl")
        steps = [m["step"] for m in metrics]
        train.plot(
            steps,
            [100 * v for v in running_mean([m["rewards/accuracy_reward/mean"] for m in metrics], 20)],
            color=color,
            label=f"{label}: accuracy reward",
        )
        train.plot(
            steps,
            [100 * v for v in running_mean([m["tools/call_frequency"] for m in metrics], 20)],
            color=color,
            linestyle="--",
            label=f"{label}: tool calls / episode",
        )
    held.set(xlabel="GRPO step", ylabel="% (calls: x100)", title="Held-out problems (50), greedy episodes")
    train.set(xlabel="GRPO step", ylabel="mean over 20 steps (%)", title="Training episodes (32 a step)")
    for ax in (held, train):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(args.out)


if __name__ == "__main__":
    main()
