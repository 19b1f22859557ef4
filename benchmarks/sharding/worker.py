"""One process of the sharding benchmark (run under torchrun by benchmarks/sharding/run.py).

Builds the trainer, resets the process's peak-RSS counter (so model loading is not counted), runs the steps and
writes this process's numbers to OUT/rank-R.json.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from cohort.config import load_config
from cohort.runtime import distributed as dist
from cohort.runtime.sharding import local
from cohort.trainer import GRPOTrainer


def _vm(field: str) -> float:
    """Returns a /proc/self/status field (VmRSS, VmHWM) in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _state_mib(trainer: GRPOTrainer) -> dict[str, float]:
    """Returns this process's bytes of parameters, gradients and AdamW state (its shard when sharded), in MiB."""
    params = [p for p in trainer.model.parameters()]
    p_bytes = sum(local(p).numel() * local(p).element_size() for p in params)
    g_bytes = sum(local(p.grad).numel() * local(p.grad).element_size() for p in params if p.grad is not None)
    o_bytes = sum(
        local(v).numel() * local(v).element_size()
        for s in trainer.optimizer.state.values()
        for v in s.values()
        if torch.is_tensor(v) and v.dim() > 0
    )
    mib = 1 << 20
    return {"params_mib": p_bytes / mib, "grads_mib": g_bytes / mib, "adamw_mib": o_bytes / mib}


def main() -> None:
    out, overrides = Path(sys.argv[1]), sys.argv[2:]
    trainer = GRPOTrainer(load_config(None, overrides))
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS: count from here
    times = []
    for _ in range(trainer.cfg.steps):
        t0 = time.perf_counter()
        trainer.step()
        times.append(time.perf_counter() - t0)
    row = {
        "rank": dist.rank(),
        "world": dist.world_size(),
        "strategy": trainer.strategy,
        "step_times": times,
        "peak_rss_mib": _vm("VmHWM"),
        **_state_mib(trainer),
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank-{dist.rank()}.json").write_text(json.dumps(row))


if __name__ == "__main__":
    main()
