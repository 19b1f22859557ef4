"""What each loss type and token control costs in one policy update, against the clip loss, in one process.

    python benchmarks/levers/bench_losses.py            # 14 M bench model, workload (b), 5 repeats (~4 min here)
    python benchmarks/levers/bench_losses.py --quick    # smoke test (< 1 min): 0.5 M model, 1 repeat

The model, the fixed rollout and the update are those of bench_switches.py (workload (b): 4 GSM8K-shaped
prompts x G = 8, token-parity rewards so every row has a non-zero advantage, learning rate 0 so nothing
moves). Each variant's update alternates with the baseline's (`loss_type=grpo`, every fast switch at auto),
after one untimed run of each; the table gives the medians and the ratio to the baseline. The controls
that act per token (top-entropy mask, Clip-Cov, KL-Cov, sampler importance weights) reuse the log-prob pass:
entropy comes out of the chunked head, covariance from the detached log-probs, the sampler's log-probs from
the rollout, so no variant runs a second forward. KL-Cov needs several optimizer steps per batch, so its row
and its baseline both split the batch into 2 minibatches.

A second table times `cohort.algo.policy_loss` alone, forward and backward, on random [N, T] tensors, where
the per-token arithmetic is all there is.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `benchmarks` as a package

from benchmarks.common import busy_seconds, others_cpu_share, own_cpu_seconds  # noqa: E402
from benchmarks.levers.bench_switches import Bench  # noqa: E402
from benchmarks.levers.bench_switches import parse_args as switch_args  # noqa: E402

VARIANTS: dict[str, dict] = {
    "dapo": {"loss_type": "dapo"},
    "dr_grpo": {"loss_type": "dr_grpo"},
    "gspo (importance=sequence)": {"importance": "sequence"},
    "cispo": {"loss_type": "cispo"},
    "sapo": {"loss_type": "sapo"},
    "gmpo": {"loss_type": "gmpo"},
    "top_entropy_quantile=0.2": {"top_entropy_quantile": 0.2},
    "clip_cov": {"cov_method": "clip_cov"},
    "kl_cov (2 minibatches)": {"cov_method": "kl_cov", "num_minibatches": 2},
    "sampler_correction=token_tis": {"sampler_correction": "token_tis"},
    "sampler_correction=sequence_mis": {"sampler_correction": "sequence_mis"},
}


def parse_args(argv=None) -> argparse.Namespace:
    """Returns the options: bench_switches' model and workload options plus --variants."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke test: 0.5 M model, 32 tokens, 1 repeat")
    p.add_argument("--model", choices=["0.5m", "14m"], default=None)
    p.add_argument("--repeats", type=int, default=None, help="measured alternations (default 5; quick 1)")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma list of variant names")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--workdir", default="runs/bench")
    p.add_argument("--out", default="benchmark-results-losses.json")
    args = p.parse_args(argv)
    args.variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(args.variants) - set(VARIANTS))
    if unknown:
        p.error(f"--variants {unknown} unknown; choose from {', '.join(VARIANTS)}")
    base = ["--quick"] if args.quick else []
    if args.model:
        base += ["--model", args.model]
    bench_args = switch_args([*base, "--workdir", args.workdir, "--threads", str(args.threads)])
    args.repeats = args.repeats or bench_args.repeats
    args.bench = bench_args
    return args


def timed_update(bench: Bench, algo, batch) -> tuple[float, object]:
    """Returns (seconds, UpdateStats) of one policy update of `batch` under `algo`."""
    from cohort.fastpath import FastConfig
    from cohort.train.update import PolicyUpdater

    updater = PolicyUpdater(
        bench.model,
        bench.optimizer,
        None,
        algo,
        temperature=1.0,
        max_completion_length=bench.args.max_len,
        micro_batch_tokens=bench.micro_batch_tokens,
        max_grad_norm=1.0,
        fast=FastConfig(),
    )
    t0 = time.perf_counter()
    stats = updater.update(batch)
    return time.perf_counter() - t0, stats


def measure_update(bench: Bench, batch, name: str, over: dict, repeats: int) -> dict:
    """Returns the median update time of one variant and of its baseline, alternating."""
    base_over = {"num_minibatches": over["num_minibatches"]} if "num_minibatches" in over else {}
    sides = {
        "baseline": dataclasses.replace(bench.algo, **base_over),
        "variant": dataclasses.replace(bench.algo, **over),
    }
    times: dict[str, list[float]] = {k: [] for k in sides}
    busy0, own0, t0 = busy_seconds(), own_cpu_seconds(), time.time()
    controls = {}
    for rnd in range(repeats + 1):  # round 0 is untimed
        for side in sides if rnd % 2 == 0 else reversed(list(sides)):
            seconds, stats = timed_update(bench, sides[side], batch)
            if rnd:
                times[side].append(seconds)
            if side == "variant":
                controls = dict(stats.controls)
    base, var = statistics.median(times["baseline"]), statistics.median(times["variant"])
    return {
        "variant": name,
        "baseline_seconds": base,
        "variant_seconds": var,
        "ratio": var / base,
        "controls": controls,
        "others_cpu": others_cpu_share(busy0, own0, t0),
    }


def measure_loss_only(n: int, t: int, repeats: int) -> list[dict]:
    """Returns the median forward + backward time of policy_loss per loss type on random [n, t] tensors."""
    import torch

    from cohort.algo import LOSS_TYPES, policy_loss

    g = torch.Generator().manual_seed(0)
    old = -torch.rand(n, t, generator=g) * 3
    logp0 = old + (torch.rand(n, t, generator=g) - 0.5) * 0.4
    adv = torch.randn(n, generator=g)
    mask = torch.rand(n, t, generator=g) < 0.8
    out = []
    for loss_type in LOSS_TYPES:
        times = []
        for rnd in range(repeats + 2):
            logp = logp0.clone().requires_grad_()
            t0 = time.perf_counter()
            loss, _ = policy_loss(logp, old, adv, mask, loss_type=loss_type, max_completion_length=t)
            loss.backward()
            if rnd >= 2:
                times.append(time.perf_counter() - t0)
        out.append({"loss_type": loss_type, "seconds": statistics.median(times)})
    base = out[0]["seconds"]
    for row in out:
        row["ratio"] = row["seconds"] / base
    return out


def main(argv=None) -> None:
    """Measures every variant, prints both tables and writes the JSON."""
    args = parse_args(argv)
    import torch
    from transformers.utils import logging as hf_logging

    from cohort.fastpath import FastConfig
    from cohort.train.update import PolicyBatch

    hf_logging.disable_progress_bar()
    torch.set_num_threads(args.threads)
    t_start = time.time()
    bench = Bench(args.bench)
    full = bench.batches["full"]
    rollout = bench.rollout(
        FastConfig()
    )  # the same seed as Bench's: the same completions, with sampler log-probs
    batch = PolicyBatch(
        full.prompt_ids,
        full.completion_ids,
        full.group_size,
        full.advantages,
        full.in_loss,
        rollout.sampling_logprobs,
    )
    rows = []
    for name in args.variants:
        rows.append(measure_update(bench, batch, name, VARIANTS[name], args.repeats))
        r = rows[-1]
        print(
            f"  {name:34} {r['variant_seconds']:.3f} s vs {r['baseline_seconds']:.3f} s ({r['ratio']:.2f}x)",
            flush=True,
        )
    print("\n| variant | update (s) | baseline grpo (s) | ratio |\n|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['variant']} | {r['variant_seconds']:.3f} | {r['baseline_seconds']:.3f} | {r['ratio']:.2f}x |"
        )
    n, t = (256, 512) if not args.bench.quick else (64, 128)
    loss_rows = measure_loss_only(n, t, args.repeats + 2)
    print(
        f"\npolicy_loss alone, forward + backward on [{n}, {t}] float32:\n| loss_type | ms | ratio to grpo |\n|---|---|---|"
    )
    for r in loss_rows:
        print(f"| {r['loss_type']} | {1000 * r['seconds']:.2f} | {r['ratio']:.2f}x |")
    busiest = max(r["others_cpu"] for r in rows) if rows else 0.0
    if busiest > 0.05:
        print(
            f"\nwarning: other processes used up to {busiest:.0%} of the CPU while this ran; the times are contended"
        )
    Path(args.out).write_text(
        json.dumps(
            {
                "command": " ".join([Path(sys.executable).name, *sys.argv]),
                "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t_start)),
                "update": rows,
                "loss_only": loss_rows,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
