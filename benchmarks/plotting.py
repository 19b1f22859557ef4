"""What the run-plotting scripts share: reading a run's .jsonl files and smoothing a curve."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def jsonl_rows(path: Path) -> list[dict]:
    """Returns the JSON objects of a .jsonl file."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def running_mean(values: list[float], window: int) -> list[float]:
    """Returns the mean of each value and the up to `window` - 1 before it."""
    return [
        sum(values[max(0, i - window + 1) : i + 1]) / len(values[max(0, i - window + 1) : i + 1])
        for i in range(len(values))
    ]


def labelled_runs(description: str, default_out: str) -> tuple[list[tuple[Path, str]], Path]:
    """Returns the command line's (run folder, label) pairs and the figure's path (--out)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("runs", nargs="+", help="pairs of run folder and label")
    parser.add_argument("--out", default=default_out)
    args = parser.parse_args()
    if len(args.runs) % 2:
        parser.error("give a label after every run folder")
    return [(Path(folder), label) for folder, label in zip(args.runs[::2], args.runs[1::2])], Path(args.out)


def save_figure(fig: Any, axes: Sequence[Any], out: Path) -> None:
    """Returns None once the figure, with a grid and a legend on every axis, is written to `out` (path printed)."""
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    print(out)
