"""Plot code-task runs of examples/code_task.py: held-out pass rate and training reward against GRPO steps.

    python benchmarks/sandbox/plot_code_runs.py runs/code-a "seed 0" runs/code-b "seed 1" --out docs/img/code_task.png

Reads each run folder's evals.jsonl (held-out greedy pass rate) and metrics.jsonl (the code reward's mean and
the share of completions that passed every test, as 20-step running means).
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
    runs, out = labelled_runs(__doc__.split("\n")[0], "docs/img/code_task.png")
    fig, (held, train) = plt.subplots(1, 2, figsize=(10, 3.6))
    for folder, label in runs:
        run = folder
        evals = jsonl_rows(run / "evals.jsonl")
        line = held.plot(
            [e["step"] for e in evals], [100 * e["accuracy"] for e in evals], marker="o", label=label
        )
        metrics = jsonl_rows(run / "metrics.jsonl")
        steps = [m["step"] for m in metrics]
        color = line[0].get_color()
        train.plot(
            steps,
            running_mean([m["rewards/code_reward/mean"] for m in metrics], 20),
            color=color,
            label=f"{label}: reward",
        )
        passed = running_mean([m["rewards/code_reward/passed"] for m in metrics], 20)
        train.plot(steps, passed, color=color, linestyle="--", label=f"{label}: all tests passed")
    held.set(xlabel="GRPO step", ylabel="held-out greedy pass rate (%)", title="Held-out problems (100)")
    train.set(xlabel="GRPO step", ylabel="mean over 20 steps", title="Training completions (64 a step)")
    save_figure(fig, (held, train), out)


if __name__ == "__main__":
    main()
