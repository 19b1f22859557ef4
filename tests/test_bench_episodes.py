"""benchmarks/episodes/run.py on its smallest shape: KV-cache extension and re-encoding sample the same tokens
(the benchmark asserts it), and results.json / results.md are written; the other sections run end to end."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SMALL = "--shapes tiny --lengths 128 --prompts 2 --group 2 --repeats 1 --threads 1".split()


@pytest.fixture(scope="module")
def bench():
    """Returns benchmarks/episodes/run.py as a module (the repository root on sys.path, as the script puts it)."""
    spec = importlib.util.spec_from_file_location(
        "bench_episodes_run", ROOT / "benchmarks" / "episodes" / "run.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)
    spec.loader.exec_module(module)
    return module


def test_the_rollout_section_samples_the_same_tokens_both_ways_and_writes_its_results(bench, tmp_path):
    results = bench.main(
        [*SMALL, "--sections", "rollout", "--out", str(tmp_path / "out"), "--workdir", str(tmp_path)]
    )
    (row,) = results["rollout"]
    assert row["same_tokens"] and row["shape"] == "tiny" and row["episodes"] == 4
    assert row["sampled_tokens"]["median"] > 0 and row["turns"]["median"] >= 4
    assert row["inserted_tokens"]["median"] > 0  # some episode went past its first turn
    # all four modes (extension / re-encoding, preallocated / dynamic cache) sampled the same tokens
    assert row["modes"] == list(bench.MODES) and set(row["tokens_per_s"]) == set(bench.MODES)
    assert row["speedup"]["reencode"]["median"] == 1.0 and row["speedup"]["extend"]["median"] > 0
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert saved["rollout"][0]["rounds"] == row["rounds"]
    assert "| tiny (" in (tmp_path / "out" / "results.md").read_text()


def test_two_different_samplings_are_told_apart(bench):
    import torch

    from cohort.rollout import RolloutBatch

    def batch(tokens):
        return RolloutBatch([[1]], [tokens], torch.tensor([False]), 1)

    bench.same_tokens(batch([3, 4, 5]), batch([3, 4, 5]), "equal")
    with pytest.raises(AssertionError, match="rollout 0 differs from token 1"):
        bench.same_tokens(batch([3, 4, 5]), batch([3, 6, 5]), "unequal")


def test_the_overlap_and_update_sections_run_end_to_end(bench, tmp_path):
    argv = [
        *SMALL,
        "--sections",
        "overlap,update",
        "--overlap-shape",
        "tiny",
        "--update-shapes",
        "tiny",
        "--tool-seconds",
        "0.01",
        "--overlap-repeats",
        "1",
    ]
    argv += ["--update-length", "32", "--update-prompts", "1", "--out", str(tmp_path / "out")]
    results = bench.main([*argv, "--workdir", str(tmp_path / "models")])
    tools, environment = results["overlap"]
    # every scripted episode made its calls (the benchmark checks each episode too)
    assert tools["calls"] == 4 * bench.TOOL_CALLS
    assert tools["tool_seconds"]["overlapped"]["median"] >= 4 * bench.TOOL_CALLS * 0.01
    assert (
        0
        < tools["waited_seconds"]["after_decoding"]["median"]
        <= tools["tool_seconds"]["after_decoding"]["max"]
    )
    assert set(tools["seconds"]) == {"decode_only", "overlapped", "after_decoding"}
    assert environment["tool_seconds"]["overlapped"]["median"] > 0
    (update,) = results["update"]
    assert update["policy_tokens"] == {
        "episodes": 32,
        "single_same_length": 64,
        "single_same_policy_tokens": 32,
    }
    assert "Update: cost per masked-in" in (tmp_path / "out" / "results.md").read_text()
