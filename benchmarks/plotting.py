"""What the run-plotting scripts share: reading a run's .jsonl files and smoothing a curve."""

from __future__ import annotations

import json
from pathlib import Path


def jsonl_rows(path: Path) -> list[dict]:
    """Returns the JSON objects of a .jsonl file."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def running_mean(values: list[float], window: int) -> list[float]:
    """Returns the mean of each value and the up to `window` - 1 before it."""
    return [
        sum(values[max(0, i - window + 1) : i + 1]) / len(values[max(0, i - window + 1) : i + 1])
        for i in range(len(values))
    ]
