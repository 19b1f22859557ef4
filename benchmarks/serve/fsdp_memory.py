"""Per-process peak memory of two fsdp training processes: loading, and a training step, with and without the
seed's layout (process 0 reads the checkpoint and sends each process its shard; a rollout worker samples).

    python benchmarks/serve/fsdp_memory.py --out runs/fsdp_memory          # the table in docs/serving.md
    python benchmarks/serve/fsdp_memory.py --out /tmp/m --layers 2 --steps 1   # a quick look
    python benchmarks/serve/fsdp_memory.py --out runs/fsdp_memory_frozen --steps-only --only "process 0 reads" \
        --warm-steps 1 --extra algo.num_iterations=2 algo.beta=0.04   # steps with the pi_old and reference passes
    ... --phases   # also where in a step each process peaks (resident memory sampled every 2 ms, by phase)

Builds a Qwen2 model of about 100 M parameters with save_pretrained (nothing is downloaded), then runs it under
torchrun (2 gloo processes, one torch thread each) four ways: distributed.load every or rank0, sampling in the
training processes or on one local rollout worker (rollout.workers=1, started by process 0). Loading is measured
in runs that only load (cohort.train.build.build_policy: the checkpoint read, the model sharded, the start-up
checks): each process reports its resident memory before and its peak (VmHWM) after. Steps are measured in runs
that train: once the trainer is built (its gradients allocated, the workers connected and sent the weights),
each process hands freed memory back (malloc_trim), resets its peak counter, runs the steps and reports the
peak over them; process 0 also reports the worker's peak. Each run is repeated --repeats times; the tables give
the median and the range.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve()

RUNS = {
    "every process reads, samples in-process": ["distributed.load=every"],
    "process 0 reads, samples in-process": ["distributed.load=rank0"],
    "every process reads, rollout worker": ["distributed.load=every", "rollout.workers=1"],
    "process 0 reads, rollout worker": ["distributed.load=rank0", "rollout.workers=1"],
}
"""The four ways, by what they change from the same run."""


def _vm(field: str, pid: str = "self") -> float:
    """Returns a /proc/PID/status field (VmRSS, VmHWM) in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def load_child(out: Path, overrides: list[str]) -> None:
    """One training process (under torchrun) that only loads: the policy read and sharded as the trainer does it
    (cohort.train.build.build_policy); writes OUT/load-R.json."""
    from cohort.config import load_config
    from cohort.runtime import distributed as dist
    from cohort.runtime.sharding import resolve_strategy
    from cohort.train.build import build_policy, resolve_device, set_threads

    cfg = load_config(None, overrides).validate()
    dist.init_from_env(cfg.distributed.backend)
    set_threads(cfg)
    strategy = resolve_strategy(cfg.distributed.strategy, dist.world_size())
    before = _vm("VmRSS")
    t0 = time.perf_counter()
    _, _, _, loaded = build_policy(cfg, None, None, resolve_device(cfg.model.device), strategy)
    seen = {"before_mib": before, "load_peak_mib": _vm("VmHWM"), "load_s": time.perf_counter() - t0}
    Path(out / f"load-{dist.rank()}.json").write_text(json.dumps({**seen, "loaded": loaded}))
    dist.shutdown()
    dist.exit_without_teardown(0)


class Phases:
    """Resident memory sampled every 2 ms by a thread, its peak kept per phase of the step (the innermost of the
    wrapped calls running; "other" outside them)."""

    def __init__(self) -> None:
        self.stack: list[str] = []
        self.peaks: dict[str, float] = {}
        self.running = True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()

    def _sample(self) -> None:
        while self.running:
            phase = self.stack[-1] if self.stack else "other"
            self.peaks[phase] = max(self.peaks.get(phase, 0.0), _vm("VmRSS"))
            time.sleep(0.002)

    def wrap(self, owner: object, name: str, phase: str) -> None:
        """Returns None after making owner.name run as `phase`."""
        inner: Callable = getattr(owner, name)

        def run(*args, **kwargs):
            self.stack.append(phase)
            try:
                return inner(*args, **kwargs)
            finally:
                self.stack.pop()

        setattr(owner, name, run)

    def stop(self) -> dict[str, float]:
        """Returns each phase's peak resident memory in MiB."""
        self.running = False
        self.thread.join()
        return self.peaks


def child(out: Path, overrides: list[str]) -> None:
    """One training process (under torchrun): builds the trainer, runs the steps, writes OUT/rank-R.json."""
    from cohort.config import load_config
    from cohort.runtime import distributed as dist
    from cohort.trainer import GRPOTrainer

    trainer = GRPOTrainer(load_config(None, overrides))
    seen = {"built_peak_mib": _vm("VmHWM")}
    # --warm-steps: steps before the measured ones (AdamW's state, made by the first step, then counts as live)
    for _ in range(int(os.environ.get("FSDP_MEMORY_WARM_STEPS", "0"))):
        trainer.step()
    # Freed memory that malloc keeps (loading frees whole tensors) would otherwise count towards the steps' peak.
    ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    seen["built_live_mib"] = _vm("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS: the steps' peak from here
    phases = None
    if os.environ.get("FSDP_MEMORY_PHASES") == "1":
        phases = Phases()
        # the drawer's public rounds: the first draw and dynamic sampling's refills (rollout workers sample, so
        # nothing is gathered around them)
        phases.wrap(trainer.drawer, "draw", "draw (sampling, scoring)")
        phases.wrap(trainer.drawer, "refill", "draw (sampling, scoring)")
        phases.wrap(trainer.updater, "frozen_logprobs", "pi_old / reference passes")
        phases.wrap(trainer.updater, "update", "update (forward, backward)")
        phases.wrap(trainer.optimizer, "step", "optimizer step")
        if trainer.remote is not None:
            phases.wrap(trainer.remote, "push_weights", "weight push")
    times = []
    for _ in range(trainer.cfg.steps):
        t = time.perf_counter()
        trainer.step()
        times.append(time.perf_counter() - t)
    seen.update(step_peak_mib=_vm("VmHWM"), step_s=statistics.median(times))
    if phases is not None:
        seen["phase_peak_mib"] = phases.stop()
    remote = trainer.remote
    if remote is not None and remote.local is not None:
        seen["worker_peak_mib"] = _vm("VmHWM", str(remote.local.processes[0].pid))
    Path(out / f"rank-{dist.rank()}.json").write_text(json.dumps(seen))
    if remote is not None:
        remote.close()
    dist.shutdown()
    dist.exit_without_teardown(0)


def _run(model: Path, out: Path, port: int, mode: str, extra: list[str], args) -> list[dict]:
    """Returns each process's numbers of one torchrun run: `mode` --load (it only loads) or --train."""
    out.mkdir(parents=True, exist_ok=True)
    overrides = [
        f"model.name_or_path={model}",
        "data.task=addition",
        "data.n_train=64",
        "data.n_eval=0",
        "rollout.group_size=2",
        f"rollout.batch_size={args.batch}",
        f"rollout.max_completion_length={args.completion}",
        "optim.lr=1e-5",
        f"steps={args.steps}",
        "eval_at_ends=false",
        "save_every=0",
        "progress=false",
        "threads=1",
        "model.device=cpu",
        "distributed.strategy=fsdp",
        f"out_dir={out / 'run'}",
        *args.extra,
        *extra,
    ]
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port),
        str(HERE), mode, str(out), *overrides,
    ]  # fmt: skip
    env = {
        **os.environ,
        "CUDA_VISIBLE_DEVICES": "",
        "FSDP_MEMORY_WARM_STEPS": str(args.warm_steps),
        "FSDP_MEMORY_PHASES": "1" if args.phases else "0",
    }
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"{mode} {' '.join(extra)} failed:\n{proc.stderr[-3000:]}")
    name = "load" if mode == "--load" else "rank"
    return [json.loads((out / f"{name}-{r}.json").read_text()) for r in range(2)]


def _cell(runs: list[list[dict]], rank: int, key: str) -> str:
    """Returns a table cell: the median of one process's number over the repeats, and their range (how much of
    its freed memory malloc keeps after the sharded model's first forwards varies from run to run)."""
    values = [run[rank][key] for run in runs if key in run[rank]]
    if not values:
        return ""
    return f"{statistics.median(values):.0f} ({min(values):.0f}-{max(values):.0f})"


def _print_phases(results: dict[str, list]) -> None:
    """Prints, for each way, each phase's peak resident memory over the live memory once built (MiB, median of
    the repeats; process 0 / process 1)."""
    print(
        "\nWhere a step peaks: each phase's peak over the live memory once built (process 0 / process 1):\n"
    )
    for name, runs in results.items():
        phases = sorted({p for run in runs for r in run for p in r.get("phase_peak_mib", {})})
        print(f"{name}: live {_cell(runs, 0, 'built_live_mib')} / {_cell(runs, 1, 'built_live_mib')}\n")
        print("| phase | process 0 | process 1 |")
        print("|---|---:|---:|")
        for phase in phases:
            cells = []
            for rank in (0, 1):
                over = [
                    run[rank]["phase_peak_mib"][phase] - run[rank]["built_live_mib"]
                    for run in runs
                    if phase in run[rank].get("phase_peak_mib", {})
                ]
                cells.append(f"+{statistics.median(over):.0f}" if over else "")
            print(f"| {phase} | {cells[0]} | {cells[1]} |")
        print()


def main() -> None:
    if sys.argv[1:2] in (["--load"], ["--train"]):  # a process under torchrun: the rest are config overrides
        (load_child if sys.argv[1] == "--load" else child)(Path(sys.argv[2]), sys.argv[3:])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4, help="completions per process per step")
    parser.add_argument("--completion", type=int, default=16, help="max new tokens")
    parser.add_argument("--repeats", type=int, default=4, help="runs of each way (the tables give medians)")
    parser.add_argument("--port", type=int, default=29661)
    parser.add_argument("--extra", nargs="*", default=[], help="config overrides added to every run")
    parser.add_argument("--steps-only", action="store_true", help="skip the loading table")
    parser.add_argument("--only", default="", help="train only the ways whose name contains this")
    parser.add_argument(
        "--warm-steps",
        type=int,
        default=0,
        help="steps run before the peak is measured (AdamW's state then live)",
    )
    parser.add_argument(
        "--phases",
        action="store_true",
        help="also each phase's peak over the live memory (sampled every 2 ms)",
    )
    args = parser.parse_args()
    from cohort.models import build_tiny_model, count_parameters, load_model

    model = args.out / "model"
    if not (model / "config.json").is_file():
        build_tiny_model(
            model,
            hidden_size=args.hidden,
            num_layers=args.layers,
            num_heads=8,
            intermediate_size=3 * args.hidden,
            vocab_size=args.vocab,
        )
    n = count_parameters(load_model(model))
    if args.extra:
        print(f"Every run with: {' '.join(args.extra)}")
    print(
        f"Model: {n / 1e6:.1f} M parameters ({n * 4 / 2**20:.0f} MiB float32; Qwen2, hidden {args.hidden}, "
        f"{args.layers} layers, vocabulary {args.vocab}), 2 fsdp processes, {args.batch} completions of up to "
        f"{args.completion} tokens per process per step, {args.steps} steps. Peak RSS (VmHWM) in MiB: the median "
        f"of {args.repeats} runs (lowest-highest).\n"
    )
    results: dict[str, list] = {}
    port = iter(range(args.port, args.port + 1000))
    if not args.steps_only:
        print("Loading (the checkpoint read, the model sharded, the start-up checks):\n")
        print("| distributed.load | before loading | peak: process 0 | peak: process 1 | seconds |")
        print("|---|---:|---:|---:|---:|")
    for load in () if args.steps_only else ("every", "rank0"):
        extra = [f"distributed.load={load}"]
        runs = [
            _run(model, args.out / f"load-{load}-{k}", next(port), "--load", extra, args)
            for k in range(args.repeats)
        ]
        results[f"load {load}"] = runs
        seconds = statistics.median(max(r["load_s"] for r in run) for run in runs)
        print(
            f"| {load} | {_cell(runs, 0, 'before_mib')} | {_cell(runs, 0, 'load_peak_mib')} | "
            f"{_cell(runs, 1, 'load_peak_mib')} | {seconds:.1f} |",
            flush=True,
        )
    print("\nTraining steps (from the trainer's live memory once built, freed memory handed back):\n")
    print("| run | peak: process 0 | peak: process 1 | worker | step s |")
    print("|---|---:|---:|---:|---:|")
    for i, (name, extra) in enumerate(RUNS.items()):
        if args.only not in name:
            continue
        runs = [
            _run(model, args.out / f"train{i}-{k}", next(port), "--train", extra, args)
            for k in range(args.repeats)
        ]
        results[name] = runs
        print(
            f"| {name} | {_cell(runs, 0, 'step_peak_mib')} | {_cell(runs, 1, 'step_peak_mib')} | "
            f"{_cell(runs, 0, 'worker_peak_mib')} | "
            f"{statistics.median(max(r['step_s'] for r in run) for run in runs):.2f} |",
            flush=True,
        )
    if args.phases:
        _print_phases({k: v for k, v in results.items() if not k.startswith("load")})
    (args.out / "results.json").write_text(json.dumps({"parameters": n, "runs": results}, indent=1))


if __name__ == "__main__":
    main()
