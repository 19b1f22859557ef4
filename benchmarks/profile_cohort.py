"""Where does a cohort step spend its time? Phase timings plus the top torch operators.

    python benchmarks/profile_cohort.py --workload b_gsm8k --model 14m [--steps 3] [--torch-profile]

Uses the models and prompts `run.py` builds (run it once first, or pass --workdir of a previous run).
Phases: generation split into prefill and decode steps, log-prob forward, backward, optimizer; each
timed by wrapping the function that owns it, so the numbers add up to the step time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def main(argv=None) -> None:
    """Profile cohort on one workload and print the phase table (and optionally torch's operator table)."""
    import run as bench

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="b_gsm8k", choices=sorted(bench.WORKLOADS))
    p.add_argument("--model", default="14m", choices=sorted(bench.MODEL_SHAPES))
    p.add_argument("--workdir", default="runs/bench")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--group-size", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--max-len", type=int, default=None)
    p.add_argument("--torch-profile", action="store_true", help="also print torch.profiler's top operators")
    p.add_argument("--rows", type=int, default=15, help="operators per torch.profiler table")
    args = p.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    import bench_tasks

    from cohort.config import load_config
    from cohort.trainer import GRPOTrainer

    w = bench.WORKLOADS[args.workload]
    workdir = Path(args.workdir).resolve()
    key = bench.model_key(args.model, w["mean_length"])
    meta = bench.build_models(workdir, {key}, 0)[key]
    rows = (
        bench_tasks.addition_rows(512, seed=1234)
        if w["prompts"] == "addition"
        else bench_tasks.gsm8k_like_rows(512, seed=0)
    )
    G = args.group_size or w["group_size"]
    cfg = load_config(
        None,
        {
            "model": {"name_or_path": meta["path"], "device": "cpu"},
            "data": {"task": "addition"},
            "rollout": {
                "group_size": G,
                "batch_size": args.batch_size or w["batch_size"],
                "max_completion_length": args.max_len or w["max_completion_length"],
                "temperature": 1.0,
                "engine": "builtin",
            },
            "algo": {"loss_type": "grpo", "beta": 0.0},
            "optim": {"lr": 1e-6},
            "steps": args.steps + 1,
            "out_dir": str(workdir / "scratch" / "profile"),
            "progress": False,
            "eval_at_ends": False,
            "save_every": 0,
            "threads": args.threads,
        },
    )
    trainer = GRPOTrainer(cfg, reward_funcs=[bench_tasks.token_parity], train_rows=rows, eval_rows=[])
    model = trainer.model
    clock: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    peak: dict[str, float] = defaultdict(float)  # MiB: highest RSS seen while the phase was innermost
    stack: list[str] = ["other"]

    def sample_rss() -> None:
        from worker import rss_mib

        while not stop.is_set():
            label, rss = stack[-1], rss_mib()
            peak[label] = max(peak[label], rss)
            if recording.is_set():
                if segments and segments[-1][0] == label:
                    segments[-1][2] = max(segments[-1][2], rss)
                else:
                    segments.append([label, rss, rss])
            time.sleep(0.002)

    import threading

    stop, recording = threading.Event(), threading.Event()
    segments: list[list] = []  # [phase, RSS when entered, max RSS while in it] over the first step
    sampler = threading.Thread(target=sample_rss, daemon=True)
    sampler.start()

    def wrap(obj, name, label):
        """Time obj.name under `label`, or under label(kwargs) when it is a function (None: not timed)."""
        fn = getattr(obj, name)

        def timed(*a, **k):
            tag = label(k) if callable(label) else label
            t0 = time.perf_counter()
            stack.append(tag or stack[-1])
            try:
                return fn(*a, **k)
            finally:
                stack.pop()
                if tag:
                    clock[tag] += time.perf_counter() - t0
                    counts[tag] += 1

        setattr(obj, name, timed)

    def forward_label(k):
        # Generation: a model call with more than one input position is a prefill, else a decode step.
        if torch.is_grad_enabled():
            return "forward with grad"
        ids = k.get("input_ids")
        return "generate: prefill" if ids is not None and ids.shape[1] > 1 else "generate: decode steps"

    import cohort.update as upd

    wrap(model, "forward", forward_label)
    wrap(trainer.engine, "generate", "generate (total)")
    wrap(upd, "completion_logprobs", "logprobs (total, incl. layout + LM head)")
    wrap(model.model, "forward", lambda k: "logprobs: decoder forward" if torch.is_grad_enabled() else None)
    wrap(trainer.optimizer, "step", "optimizer step")
    wrap(torch.Tensor, "backward", "backward")
    wrap(torch.nn.utils, "clip_grad_norm_", "clip_grad_norm")

    recording.set()
    trainer.step()  # warm-up (the first step of a fresh process: where the peak RSS is set)
    recording.clear()
    print("RSS over the first step (MiB): phase, at entry -> max inside, for phases that grew it by > 8 MiB")
    for label, entry, top in segments:
        if top - entry > 8:
            print(f"  {label:45} {entry:7.0f} -> {top:7.0f}  (+{top - entry:.0f})")
    clock.clear()
    counts.clear()
    step_times, lengths = [], []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        m = trainer.step().metrics
        step_times.append(time.perf_counter() - t0)
        lengths.append(m["completions/mean_length"])
    n = args.steps
    print(
        f"cohort on {args.workload} / {args.model}: G={G}, N={cfg.rollout.batch_size}, L={cfg.rollout.max_completion_length}, "
        f"mean length {statistics.mean(lengths):.1f}, median step {statistics.median(step_times):.3f} s"
    )
    stop.set()
    print(f"{'phase':45} {'s/step':>8} {'calls/step':>10} {'% step':>7} {'peak RSS MiB':>12}")
    total = statistics.mean(step_times)
    for label, s in sorted(clock.items(), key=lambda kv: -kv[1]):
        print(
            f"{label:45} {s / n:8.3f} {counts[label] / n:10.1f} {100 * s / n / total:6.1f}% {peak.get(label, 0):12.0f}"
        )
    from worker import peak_rss_mib

    print(
        f"process peak RSS {peak_rss_mib():.0f} MiB; innermost-phase peaks: {dict((k, round(v)) for k, v in peak.items())}"
    )
    if args.torch_profile:
        # One more step, with torch.profiler around generation and around the update separately.
        tables = {}

        def profiled(obj, name, label):
            fn = getattr(obj, name)

            def run(*a, **k):
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                    out = fn(*a, **k)
                tables[label] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows)
                return out

            setattr(obj, name, run)

        profiled(trainer.engine, "generate", "generation")
        profiled(trainer.updater, "update", "policy update")
        trainer.step()
        for label, table in tables.items():
            print(f"torch.profiler, one step, {label}:")
            print(table)
    print(
        json.dumps(
            {
                "step_times": step_times,
                "phases": {k: v / n for k, v in clock.items()},
                "peak_rss_mib": dict(peak),
            }
        )
    )


if __name__ == "__main__":
    main()
