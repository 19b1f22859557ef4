"""Plot multiply-task runs of examples/tool_task.py: held-out accuracy and tool use against GRPO steps.

    python benchmarks/episodes/plot_tool_runs.py runs/tool-0 "seed 0" runs/tool-1 "seed 1" --out docs/img/tool_task.png

Reads each run's grpo/evals.jsonl (held-out greedy episodes: accuracy, tool calls per episode) and
grpo/metrics.jsonl (training episodes: the accuracy reward's mean and tools/call_frequency, as 20-step running
means). A run folder is examples/tool_task.py's --out (or its grpo/ folder itself).
"""

from __future__ import annotations

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `benchmarks` as a package
from benchmarks.plotting import jsonl_rows, labelled_runs, running_mean, save_figure  # noqa: E402


def main() -> None:
    """Writes the figure."""
    runs, out = labelled_runs(__doc__.split("\n")[0], "docs/img/tool_task.png")
    fig, (held, train) = plt.subplots(1, 2, figsize=(10, 3.6))
    for folder, label in runs:
        run = folder / "grpo" if (folder / "grpo").is_dir() else folder
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
    save_figure(fig, (held, train), out)


if __name__ == "__main__":
    main()
