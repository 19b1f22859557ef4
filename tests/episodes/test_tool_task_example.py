"""examples/tool_task.py's GRPO stage runs as documented: the multiply tool, held-out greedy episodes logged."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from cohort.models import build_tiny_model

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.slow
def test_the_grpo_stage_trains_with_the_tool_and_measures_held_out_episodes(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    import tool_task

    model = build_tiny_model(
        tmp_path / "model", tool_format="hermes", max_position_embeddings=1024, **tool_task.MODEL
    )
    out = tool_task.grpo_stage(model, tmp_path / "run", steps=2, seed=0)
    assert out["steps"] == 2 and [e["step"] for e in out["held_out"]] == [0, 1, 2]
    for e in out["held_out"]:
        assert 0 <= e["accuracy"] <= 1 and e["tool_calls"] >= 0 and e["mean_length"] > 0
    rows = [
        json.loads(line) for line in (tmp_path / "run" / "grpo" / "metrics.jsonl").read_text().splitlines()
    ]
    assert all("tools/call_frequency" in r and "rewards/accuracy_reward/mean" in r for r in rows)
    sys.modules.pop("tool_task", None)
