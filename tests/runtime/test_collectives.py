"""The collectives cohort itself issues in a training step of two gloo processes: few, and none per micro-batch."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
from _rank_workers import collectives_case, reductions_case


@pytest.fixture(autouse=True)
def _processes_on_the_cpu(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


def test_a_default_two_process_step_makes_at_most_five_collectives(tmp_path, tiny_model_dir):
    """Counts the collectives on the wire that cohort's own code asks for (see collectives_case: an
    all_gather_object is two, FSDP's and DTensor's own are not counted) from the second step() of a run to
    the third: the step and the loop's bookkeeping after it (stop signals, health, callbacks), no checkpoint
    or evaluation. The default config (loss grpo, beta 0, one minibatch, mu 1, replicated model) makes at most 5;
    so do dapo (two global normalisers) and a sharded model; many micro-batches make as many as one (none
    inside the micro-batch loop)."""
    cases = {
        "default": ["distributed.strategy=auto"],
        "micro_batches": ["distributed.strategy=auto", "micro_batch_tokens=8"],
        "fsdp": ["distributed.strategy=fsdp"],
        "dapo": ["distributed.strategy=auto", "algo.loss_type=dapo"],
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
    assert seen["default", 0]["micro_batches"] == 1 and seen["micro_batches", 0]["micro_batches"] > 2
    default = seen["default", 0]["cohort"]
    assert len(default) <= 5, default
    assert all(len(got["cohort"]) == len(default) for got in seen.values()), seen


@pytest.mark.parametrize("world", [2, 3])
def test_batched_reductions_give_the_bits_of_one_value_collectives(tmp_path, world):
    mp.spawn(reductions_case, args=(world, str(tmp_path / "store"), str(tmp_path)), nprocs=world, join=True)
    for r in range(world):
        seen = torch.load(tmp_path / f"reductions-{r}.pt")
        # a float64 all-reduce of a vector sums each element as an all-reduce of that value alone
        assert [seen["sums"][f"f{k}"] for k in range(6)] == seen["alone"]
        assert seen["ints"] == {"tokens": sum(1000 + p for p in range(world)), "micro": seen["most"]}
        assert isinstance(seen["ints"]["tokens"], int) and isinstance(seen["ints"]["micro"], int)
        assert seen["mixed"] == {"loss": seen["alone"][-1], "flag": 1.0}
        parts, heads = seen["table"]
        assert [p.shape[0] for p in parts] == [5 if p == 1 else 2 for p in range(world)]
        for p, part in enumerate(parts):
            assert torch.equal(part, torch.arange(part.numel(), dtype=torch.float64).reshape(-1, 3) + 100 * p)
            assert heads[p] == [p + 0.5, 2**40 + p]
        assert seen["objects"] == [{"rank": p, "pad": "x" * (10 if p else 100)} for p in range(world)]
        assert seen["objects_small"] == [("r", p) for p in range(world)]
