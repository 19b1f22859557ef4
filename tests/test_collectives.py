"""The collectives cohort itself issues in a training step of two gloo processes: few, and none per micro-batch."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
from _rank_workers import collectives_case


@pytest.fixture(autouse=True)
def _processes_on_the_cpu(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


def test_a_default_two_process_step_makes_at_most_five_collectives(tmp_path, tiny_model_dir):
    """Counts the collectives on the wire that cohort's own code asks for (see collectives_case: an
    all_gather_object is two, FSDP's and DTensor's own are not counted) from the second step() of a run to
    the third: the step and the loop's bookkeeping after it (stop signals, health, callbacks), no checkpoint
    or evaluation. The default config (dapo, beta 0, one minibatch, mu 1, replicated model) makes at most 5;
    many micro-batches make as many as one (none inside the micro-batch loop)."""
    cases = {
        "default": ["distributed.strategy=auto"],
        "micro_batches": ["distributed.strategy=auto", "micro_batch_tokens=8"],
        "fsdp": ["distributed.strategy=fsdp"],
    }
    mp.spawn(
        collectives_case,
        args=(2, str(tmp_path / "store"), str(tmp_path), str(tiny_model_dir), cases),
        nprocs=2,
        join=True,
    )
    seen = {(c, r): torch.load(tmp_path / f"{c}-{r}.pt") for c in cases for r in range(2)}
    for (case, r), got in seen.items():
        print(case, r, len(got["cohort"]), *got["cohort"], sep="\n  ")
    default = seen["default", 0]["cohort"]
    assert len(default) <= 5, default
    assert all(len(got["cohort"]) == len(default) for got in seen.values()), seen
