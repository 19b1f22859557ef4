"""What the TRL comparison and the micro-benchmarks share: workloads, model shapes, bench models, prompts,
and memory readings of the current process.

Importing this module imports neither torch nor cohort (the TRL worker imports it, and its peak RSS
must be TRL's alone); what needs them imports them when called.

Workloads (docs/performance.md describes them):
- (a) `a_demo`: the demo's addition prompts (5-6 tokens), 8 new tokens, G = 8, 128 completions a step;
- (b) `b_gsm8k`: GSM8K-shaped prompts of 100-150 tokens, completions up to 128 tokens ending at EOS
  (mean about 60), G = 8, 4 prompts a step;
- (c) `c_vocab`: workload (b) on Qwen2.5's 151,936-token vocabulary with hidden size 64 (memory).
"""

from __future__ import annotations

import os
import resource
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
"""The repository root (scripts run from there)."""

MODEL_SHAPES: dict[str, dict[str, int]] = {
    # cohort.models.TINY_SIZES, written out so that importing this module stays light (checked in build_models)
    "0.5m": {"hidden_size": 128, "num_layers": 2, "num_heads": 4, "intermediate_size": 416},
    "14m": {"hidden_size": 384, "num_layers": 8, "num_heads": 6, "intermediate_size": 1024},
    # Qwen2.5's vocabulary on the demo's small hidden size: nearly all parameters are embeddings.
    "vocab152k": {
        "hidden_size": 64,
        "num_layers": 2,
        "num_heads": 4,
        "intermediate_size": 256,
        "vocab_size": 151936,
    },
}
"""Model shapes of the benchmarks: cohort's TINY_SIZES and, for memory, a 152k-token vocabulary."""

WORKLOADS: dict[str, dict] = {
    "a_demo": {
        "about": "demo shape: addition prompts (~5-6 tokens), 8 new tokens, G=8, 128 completions/step",
        "prompts": "addition",
        "group_size": 8,
        "batch_size": 128,
        "max_completion_length": 8,
        "mean_length": None,  # EOS unreachable: every completion is 8 tokens
        "models": ["0.5m", "14m"],
        "steps": 3,
        "quick": {},
    },
    "b_gsm8k": {
        "about": "GSM8K shape: 100-150-token prompts, completions up to 128 tokens ending at EOS (mean ~60)",
        "prompts": "gsm8k",
        "group_size": 8,
        "batch_size": 32,
        "max_completion_length": 128,
        "mean_length": 60,
        "models": ["0.5m", "14m"],
        "steps": 3,
        "quick": {"batch_size": 16, "max_completion_length": 64},
    },
    "c_vocab": {
        "about": "workload (b) on a 151,936-token vocabulary with hidden size 64 (memory)",
        "prompts": "gsm8k",
        "group_size": 8,
        "batch_size": 32,
        "max_completion_length": 128,
        "mean_length": 60,
        "models": ["vocab152k"],
        "steps": 1,  # for memory; a TRL step takes minutes here, and the peak comes in the first one
        "rounds": 1,
        "quick": {"batch_size": 8, "max_completion_length": 32},
    },
}
"""Prompts, G, completions per step, max completion length and EOS behaviour of each workload."""


def model_key(shape: str, mean_length) -> str:
    """Returns the bench model's name for a shape and EOS behaviour: '14m@exact', '14m@mean60'."""
    return f"{shape}@exact" if mean_length is None else f"{shape}@mean{int(mean_length)}"


def build_models(workdir: Path, names: set[str], seed: int) -> dict[str, dict]:
    """Returns {name: model facts} for every model named by `model_key`, built under workdir/models
    (reused when a previous run built the same one)."""
    from transformers.utils import logging as hf_logging

    from benchmarks import bench_models, bench_tasks
    from cohort.models import TINY_SIZES

    for size, shape in TINY_SIZES.items():
        if size in MODEL_SHAPES and MODEL_SHAPES[size] != shape:
            raise RuntimeError(
                f"MODEL_SHAPES[{size!r}] differs from cohort.models.TINY_SIZES[{size!r}]; update it"
            )
    hf_logging.disable_progress_bar()
    prompts = bench_tasks.gsm8k_like_rows(16, seed=seed + 99)  # not the benchmark's own prompts
    out = {}
    for name in sorted(names):
        shape, _, eos = name.partition("@")
        mean_len = None if eos == "exact" else float(eos.removeprefix("mean"))
        rate = 0.0 if mean_len is None else bench_models.rate_for_mean_length(mean_len, 128)
        out[name] = bench_models.build_bench_model(
            Path(workdir) / "models" / name.replace("@", "_"),
            **MODEL_SHAPES[shape],
            eos_rate=rate,
            seed=seed,
            calibration_prompts=[r["prompt"] for r in prompts[:8]],
        )
    return out


def workload_rows(kind: str, n: int = 512, seed: int = 0) -> list[dict]:
    """Returns n prompt rows {"prompt", "answer"} of a workload's kind ("addition" or "gsm8k").

    The addition rows always use seed 1234 (the demo task's own draw); the GSM8K-shaped rows use `seed`.
    """
    from benchmarks import bench_tasks

    if kind == "addition":
        return bench_tasks.addition_rows(n, seed=1234)
    if kind == "gsm8k":
        return bench_tasks.gsm8k_like_rows(n, seed=seed)
    raise ValueError(f"prompt kind {kind!r} is not known; use addition or gsm8k")


def busy_seconds() -> float:
    """Returns the CPU seconds all processes of the machine have spent busy since boot (from /proc/stat)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    """Returns the CPU seconds this process has used (user + system)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def others_cpu_share(busy0: float, own0: float, t0: float) -> float:
    """Returns the share of the machine's CPU that other processes used since (busy_seconds(),
    own_cpu_seconds(), time.time()) were (busy0, own0, t0): above 0.05, timings taken meanwhile are
    contended (with 2 threads on 2 cores, every parallel region then waits for a preempted thread)."""
    import time

    wall = max(time.time() - t0, 1e-9)
    others = busy_seconds() - busy0 - (own_cpu_seconds() - own0)
    return max(0.0, others / (wall * (os.cpu_count() or 1)))


def rss_mib() -> float:
    """Returns this process's current resident set size in MiB (from /proc)."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mib() -> float:
    """Returns this process's peak resident set size so far in MiB (VmHWM).

    Not ``ru_maxrss``: Linux keeps that across ``exec``, so a worker would inherit the high-water
    mark of the runner that forked it; VmHWM belongs to the worker's own address space.
    """
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
