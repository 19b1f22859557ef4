"""Where does a cohort step spend its time? Phase timings, RSS per phase, and the top torch operators.

    python benchmarks/levers/profile_cohort.py --workload b_gsm8k --model 14m [--steps 3] [--torch-profile]
    python benchmarks/levers/profile_cohort.py --override fast.segments=off   # a step without one fast path

Uses the bench models and prompts of the TRL comparison (`benchmarks/common.py`; built under --workdir
on first use, reused afterwards). The trainer's own metrics give generation, scoring and the update;
inside them, phases are timed with torch's module and optimizer hooks (generation's prefill and
decode steps, the update's decoder forward and LM-head chunks, the optimizer step) and by timing
torch's `Tensor.backward` and `clip_grad_norm_` (restored afterwards). Nested phases are timed
inside their parents, so only the three top-level parts add up to the step. The fast paths the steps
took are printed from the trainer's `fast/*` metrics. --torch-profile adds torch.profiler's top
operators for one rollout and one update, run through the trainer's own engine and updater.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `benchmarks` as a package

from benchmarks.common import (  # noqa: E402
    MODEL_SHAPES,
    WORKLOADS,
    build_models,
    model_key,
    peak_rss_mib,
    rss_mib,
    workload_rows,
)


class Phases:
    """Wall time, call counts and peak RSS per labelled phase; the innermost open phase owns the RSS."""

    def __init__(self) -> None:
        self.clock: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)
        self.peak: dict[str, float] = defaultdict(
            float
        )  # MiB: highest RSS seen while the phase was innermost
        self.stack: list[tuple[str | None, float]] = [("other", 0.0)]
        self.segments: list[list] = []  # [phase, RSS when entered, max RSS inside] while recording
        self.recording = threading.Event()
        self.stopping = threading.Event()
        self.sampler = threading.Thread(target=self.sample_rss, daemon=True)

    def label(self) -> str:
        return next(tag for tag, _ in reversed(self.stack) if tag)

    def enter(self, tag: str | None) -> None:
        self.stack.append((tag, time.perf_counter()))

    def leave(self) -> None:
        tag, t0 = self.stack.pop()
        if tag:
            self.clock[tag] += time.perf_counter() - t0
            self.counts[tag] += 1

    def reset(self) -> None:
        self.clock.clear()
        self.counts.clear()

    def sample_rss(self) -> None:
        while not self.stopping.is_set():
            label, rss = self.label(), rss_mib()
            self.peak[label] = max(self.peak[label], rss)
            if self.recording.is_set():
                if self.segments and self.segments[-1][0] == label:
                    self.segments[-1][2] = max(self.segments[-1][2], rss)
                else:
                    self.segments.append([label, rss, rss])
            time.sleep(0.002)

    def start(self) -> None:
        self.sampler.start()

    def stop(self) -> None:
        self.stopping.set()


def hook_module(module, phases: Phases, label) -> list:
    """Times every call of `module` under label(grad_enabled, kwargs) (None: not a phase of its own)."""
    import torch

    def pre(_module, _args, kwargs):
        phases.enter(label(torch.is_grad_enabled(), kwargs))

    def post(_module, _args, _kwargs, _out):
        phases.leave()

    return [
        module.register_forward_pre_hook(pre, with_kwargs=True),
        module.register_forward_hook(post, with_kwargs=True, always_call=True),
    ]


@contextlib.contextmanager
def timed_torch_function(owner, name: str, phases: Phases, tag: str):
    """Times calls of torch's `owner.name` under `tag` inside the block and restores it afterwards."""
    original = getattr(owner, name)

    def timed(*args, **kwargs):
        phases.enter(tag)
        try:
            return original(*args, **kwargs)
        finally:
            phases.leave()

    setattr(owner, name, timed)
    try:
        yield
    finally:
        setattr(owner, name, original)


def main(argv=None) -> None:
    """Profile cohort on one workload and print the phase table (and optionally torch's operator tables)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="b_gsm8k", choices=sorted(WORKLOADS))
    p.add_argument("--model", default="14m", choices=sorted(MODEL_SHAPES))
    p.add_argument("--workdir", default="runs/bench")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--group-size", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--max-len", type=int, default=None)
    p.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="cohort config override (repeatable), e.g. fast.segments=off",
    )
    p.add_argument("--torch-profile", action="store_true", help="also print torch.profiler's top operators")
    p.add_argument("--rows", type=int, default=15, help="operators per torch.profiler table")
    args = p.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    from benchmarks.bench_tasks import token_parity
    from cohort.config import load_config
    from cohort.trainer import GRPOTrainer

    w = WORKLOADS[args.workload]
    workdir = Path(args.workdir).resolve()
    key = model_key(args.model, w["mean_length"])
    meta = build_models(workdir, {key}, 0)[key]
    rows = workload_rows(w["prompts"], 512, 0)
    G = args.group_size or w["group_size"]
    cfg = load_config(
        None,
        {
            "model": {"name_or_path": meta["path"], "device": "cpu"},
            "data": {"task": "addition"},  # placeholder: the rows are passed in directly
            "rollout": {
                "group_size": G,
                "batch_size": args.batch_size or w["batch_size"],
                "max_completion_length": args.max_len or w["max_completion_length"],
                "temperature": 1.0,
                "engine": "builtin",
            },
            "algo": {"loss_type": "grpo", "beta": 0.0},
            "optim": {"lr": 1e-6},
            "steps": args.steps + 2,
            "out_dir": str(workdir / "scratch" / "profile"),
            "progress": False,
            "eval_at_ends": False,
            "save_every": 0,
            "threads": args.threads,
        },
    )
    if args.override:
        cfg = load_config(None, args.override, base=cfg)
    trainer = GRPOTrainer(cfg, reward_funcs=[token_parity], train_rows=rows, eval_rows=[])
    model = trainer.model
    phases = Phases()
    phases.start()

    def model_label(grad: bool, kwargs) -> str:
        # Without grad a model call is generation: a prefill when it feeds more than one position.
        if grad:
            return "update: whole-model forward (no head split)"
        ids = kwargs.get("input_ids")
        return "generate: prefill" if ids is not None and ids.shape[1] > 1 else "generate: decode steps"

    handles = hook_module(model, phases, model_label)
    handles += hook_module(
        model.get_decoder(), phases, lambda grad, kw: "update: decoder forward" if grad else None
    )
    head = model.get_output_embeddings()
    if head is not None:
        handles += hook_module(
            head, phases, lambda grad, kw: "update: LM head (chunks, recompute too)" if grad else None
        )
    handles.append(
        trainer.optimizer.register_step_pre_hook(lambda *a: phases.enter("update: optimizer step"))
    )
    handles.append(trainer.optimizer.register_step_post_hook(lambda *a: phases.leave()))

    with contextlib.ExitStack() as scope:
        scope.enter_context(timed_torch_function(torch.Tensor, "backward", phases, "update: backward"))
        scope.enter_context(
            timed_torch_function(torch.nn.utils, "clip_grad_norm_", phases, "update: clip_grad_norm")
        )
        phases.recording.set()
        trainer.step()  # warm-up (the first step of a fresh process: where the peak RSS is set)
        phases.recording.clear()
        print(
            "RSS over the first step (MiB): phase, at entry -> max inside, for phases that grew it by > 8 MiB"
        )
        for label, entry, top in phases.segments:
            if top - entry > 8:
                print(f"  {label:45} {entry:7.0f} -> {top:7.0f}  (+{top - entry:.0f})")
        phases.reset()
        step_times, lengths, tops, fast = [], [], defaultdict(float), defaultdict(float)
        for _ in range(args.steps):
            t0 = time.perf_counter()
            m = trainer.step().metrics
            step_times.append(time.perf_counter() - t0)
            lengths.append(m["completions/mean_length"])
            for part in ("generate", "score", "update"):
                tops[f"{part} (total)"] += m[f"time/{part}"]
            for k, v in m.items():
                if k.startswith("fast/") and v is not None:
                    fast[k.removeprefix("fast/")] += float(v) / args.steps
    for h in handles:
        h.remove()
    phases.stop()
    n = args.steps
    total = statistics.mean(step_times)
    print(
        f"cohort on {args.workload} / {args.model}: G={G}, N={cfg.rollout.batch_size}, "
        f"L={cfg.rollout.max_completion_length}, mean length {statistics.mean(lengths):.1f}, "
        f"median step {statistics.median(step_times):.3f} s"
    )
    print(f"{'phase':45} {'s/step':>8} {'calls/step':>10} {'% step':>7} {'peak RSS MiB':>12}")
    for label, s in sorted(tops.items(), key=lambda kv: -kv[1]):
        print(f"{label:45} {s / n:8.3f} {1.0:10.1f} {100 * s / n / total:6.1f}% {'':>12}")
    for label, s in sorted(phases.clock.items(), key=lambda kv: -kv[1]):
        print(
            f"  {label:43} {s / n:8.3f} {phases.counts[label] / n:10.1f} {100 * s / n / total:6.1f}% "
            f"{phases.peak.get(label, 0):12.0f}"
        )
    print("fast paths taken (mean over the measured steps; layouts: share of log-prob computations):")
    print("  " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(fast.items())))
    print(
        f"process peak RSS {peak_rss_mib():.0f} MiB; innermost-phase peaks: "
        f"{ {k: round(v) for k, v in phases.peak.items()} }"
    )
    if args.torch_profile:
        print_operator_tables(trainer, G, args.rows)
    print(
        json.dumps(
            {
                "step_times": step_times,
                "parts": {k: v / n for k, v in tops.items()},
                "phases": {k: v / n for k, v in phases.clock.items()},
                "peak_rss_mib": dict(phases.peak),
                "fast_paths": dict(fast),
            }
        )
    )


def print_operator_tables(trainer, G: int, rows: int) -> None:
    """Prints torch.profiler's top operators of one rollout and one update of the trainer's own engine and
    updater, on the first prompts of its data (rewards: token parity, advantages as the trainer computes them)."""
    import torch

    from benchmarks.bench_tasks import token_parity
    from cohort.algo import group_advantages
    from cohort.train.build import sampling_params
    from cohort.train.update import PolicyBatch

    cfg = trainer.cfg
    prompts = trainer.train_prompt_ids[: cfg.prompts_per_step]

    def profiled(label, fn):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            out = fn()
        print(f"torch.profiler, {label}:")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows))
        return out

    rollout = profiled(
        "one rollout",
        lambda: trainer.engine.generate(
            trainer.model, prompts, G, sampling_params(trainer.cfg), trainer.generator
        ),
    )
    reward = torch.tensor(token_parity(None, rollout.completion_ids), dtype=torch.float32)
    adv = group_advantages(reward, G, scale=cfg.algo.scale, std=cfg.algo.std, eps=cfg.algo.adv_eps)
    batch = PolicyBatch(
        rollout.prompt_ids, rollout.completion_ids, G, adv, torch.ones_like(adv, dtype=torch.bool)
    )
    profiled("one policy update", lambda: trainer.updater.update(batch))


if __name__ == "__main__":
    main()
