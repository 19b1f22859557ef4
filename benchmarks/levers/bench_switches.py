"""Every `cohort.fastpath` switch at its default (auto) against off, on workload (b), alternating in one process.

    python benchmarks/levers/bench_switches.py                 # 14 M bench model, 5 repeats (~5 min here)
    python benchmarks/levers/bench_switches.py --quick         # smoke test (< 1 min): 0.5 M model, 1 repeat
    python benchmarks/levers/bench_switches.py --switches segments,shared_prefix --repeats 7

Workload (b) of docs/performance.md: 4 GSM8K-shaped prompts of 100-150 tokens, G = 8, completions of
up to 128 tokens ending at EOS (mean about 60), on the bench model the TRL comparison uses
(`benchmarks/common.py`, built under --workdir on first use). For each switch, one side runs
`FastConfig()` (every switch at auto) and the other `FastConfig().replace(<switch>="off")`, so only
that switch differs; the two alternate (auto first in even repeats, off first in odd ones) after one
untimed run of each configuration (which also runs the once-per-model checks), and the table gives
the medians.

The part each switch affects is what is timed:
- grouped, segments, chunked_head: one policy update (`PolicyUpdater.update`: log-probs forward and
  backward, AdamW) of one fixed rollout of the bench model, with token-parity rewards (every row has
  a non-zero advantage, as in the TRL table); learning rate 0 so the model, and every later rollout,
  stays the same;
- skip_zero_advantage: the same update with --zero-groups of the groups at zero advantage (their
  rewards all equal, as for problems every sample solves or fails; a third to two thirds of the rows
  late in the demo);
- shared_prefix, packed_weights, preallocated_kv: one rollout (`BuiltinEngine.generate`) with the same
  sampling seed on both sides.

The path column is what each side actually ran, as cohort reports it (UpdateStats.paths and
rows_computed_frac, RolloutBatch.paths): "auto" may take the plain path where a threshold says the
fast one does not pay at this size (e.g. packed weights on the 0.5 M model, whose matrices are
below `fast.pack_min_elements`).

heap_bound is not measured: it acts on the whole process (its memory, not a part's time). Prints a
markdown table and writes the JSON (--out), with the share of the CPU other processes used while
each switch was measured (`others_cpu`; a warning above 5 %: with 2 threads on 2 cores, a busy
neighbour stalls every parallel region and the times mean nothing).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `benchmarks` as a package

from benchmarks.common import (  # noqa: E402
    WORKLOADS,
    build_models,
    busy_seconds,
    model_key,
    others_cpu_share,
    own_cpu_seconds,
    workload_rows,
)

UPDATE_SWITCHES = ("grouped", "segments", "chunked_head", "skip_zero_advantage")
ROLLOUT_SWITCHES = ("shared_prefix", "packed_weights", "preallocated_kv")
MEASURED = UPDATE_SWITCHES + ROLLOUT_SWITCHES
PARTS = {
    "grouped": "policy update (log-probs fwd + bwd, AdamW)",
    "segments": "policy update (log-probs fwd + bwd, AdamW)",
    "chunked_head": "policy update (log-probs fwd + bwd, AdamW)",
    "skip_zero_advantage": "policy update, {zero} of the groups at zero advantage",
    "shared_prefix": "rollout (prefill + decode)",
    "packed_weights": "rollout (prefill + decode)",
    "preallocated_kv": "rollout (prefill + decode)",
}


def parse_args(argv=None) -> argparse.Namespace:
    """Returns the command-line options (--quick fills in the small settings it implies)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--quick", action="store_true", help="smoke test (< 1 min): 0.5 M model, 32 tokens, 1 repeat"
    )
    p.add_argument(
        "--model", choices=["0.5m", "14m"], default=None, help="bench model (default 14m; quick 0.5m)"
    )
    p.add_argument("--switches", default=",".join(MEASURED), help=f"comma list of {', '.join(MEASURED)}")
    p.add_argument("--prompts", type=int, default=4, help="prompts per batch (workload (b): 4)")
    p.add_argument("--group-size", type=int, default=8, help="G (workload (b): 8)")
    p.add_argument("--max-len", type=int, default=None, help="max completion tokens (default 128; quick 32)")
    p.add_argument(
        "--repeats", type=int, default=None, help="measured alternations per switch (default 5; quick 1)"
    )
    p.add_argument(
        "--zero-groups",
        type=float,
        default=0.5,
        help="share of groups at zero advantage for skip_zero_advantage",
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--workdir", default="runs/bench", help="bench models (shared with benchmarks/vs_trl/run.py)"
    )
    p.add_argument("--out", default="benchmark-results-switches.json", help="results JSON path")
    args = p.parse_args(argv)
    args.model = args.model or ("0.5m" if args.quick else "14m")
    args.max_len = args.max_len or (32 if args.quick else 128)
    args.repeats = args.repeats or (1 if args.quick else 5)
    args.switches = [s for s in args.switches.split(",") if s]
    unknown = sorted(set(args.switches) - set(MEASURED))
    if unknown:
        p.error(f"--switches {unknown} are not measured here; choose from {', '.join(MEASURED)}")
    if not 0.0 <= args.zero_groups <= 1.0:
        p.error("--zero-groups must be in [0, 1]")
    return args


class Bench:
    """The model, one fixed rollout of it, and the two measured parts under any FastConfig."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        from benchmarks.bench_tasks import token_parity
        from cohort.algo import group_advantages
        from cohort.config import AlgoConfig, TrainConfig
        from cohort.data import encode_prompts
        from cohort.fastpath import FastConfig
        from cohort.models import load_model, load_tokenizer, stop_token_ids
        from cohort.rollout import SamplingParams
        from cohort.runtime.optim import make_adamw
        from cohort.train.update import PolicyBatch

        self.args = args
        workload = WORKLOADS["b_gsm8k"]
        key = model_key(args.model, workload["mean_length"])
        self.meta = build_models(Path(args.workdir).resolve(), {key}, args.seed)[key]
        self.tokenizer = load_tokenizer(self.meta["path"])
        self.model = load_model(self.meta["path"]).eval()  # float32, sdpa: as the trainer loads it
        rows = workload_rows(workload["prompts"], args.prompts, args.seed)
        self.prompts = encode_prompts(self.tokenizer, [r["prompt"] for r in rows])
        self.eos, self.pad = stop_token_ids(self.model, self.tokenizer)
        self.G = args.group_size
        self.params = SamplingParams(max_completion_length=args.max_len, temperature=1.0)
        # One rollout with every switch at auto: the completions every update below trains on.
        reference = self.rollout(FastConfig())
        G, n = self.G, len(reference.completion_ids)
        reward = torch.tensor(token_parity(None, reference.completion_ids), dtype=torch.float32)  # [N]
        algo = AlgoConfig(loss_type="grpo", beta=0.0)
        adv = group_advantages(reward, G, scale=algo.scale, std=algo.std, eps=algo.adv_eps)  # [N]
        # Zero-variance groups (all rewards equal) get advantage exactly 0, as the trainer computes it.
        zeroed = reward.clone()
        n_zero = round(args.zero_groups * len(self.prompts))
        zeroed[: n_zero * G] = 1.0
        adv_zero = group_advantages(zeroed, G, scale=algo.scale, std=algo.std, eps=algo.adv_eps)  # [N]
        everyone = torch.ones(n, dtype=torch.bool)
        self.batches = {
            "full": PolicyBatch(reference.prompt_ids, reference.completion_ids, G, adv, everyone),
            "zero": PolicyBatch(reference.prompt_ids, reference.completion_ids, G, adv_zero, everyone),
        }
        self.zero_groups = f"{n_zero}/{len(self.prompts)}"
        self.lengths = [len(c) for c in reference.completion_ids]
        self.algo = algo
        self.micro_batch_tokens = TrainConfig().micro_batch_tokens
        # lr 0: AdamW does all its work but the weights stay put, so every rollout samples the same tokens.
        self.optimizer = make_adamw([p for p in self.model.parameters() if p.requires_grad], lr=0.0)

    def rollout(self, fast):
        """Returns one rollout of the prompts under `fast` (the same sampling seed every time)."""
        import torch

        from cohort.rollout import BuiltinEngine

        engine = BuiltinEngine(eos_token_ids=self.eos, pad_token_id=self.pad, fast=fast)
        return engine.generate(
            self.model, self.prompts, self.G, self.params, torch.Generator().manual_seed(1)
        )

    def update(self, fast, batch: str):
        """Returns the UpdateStats of one policy update of the fixed rollout under `fast`."""
        from cohort.train.update import PolicyUpdater

        updater = PolicyUpdater(
            self.model,
            self.optimizer,
            None,
            self.algo,
            temperature=1.0,
            max_completion_length=self.args.max_len,
            micro_batch_tokens=self.micro_batch_tokens,
            max_grad_norm=1.0,
            fast=fast,
        )
        return updater.update(self.batches[batch])


def update_path(switch: str, stats) -> str:
    """Returns what an update ran, for the switch's own lever (from UpdateStats)."""
    if switch == "chunked_head":
        return "chunked head" if stats.paths.get("chunked_head", 0.0) > 0.5 else "full logits"
    if switch == "skip_zero_advantage":
        on = "skip" if stats.paths.get("skip_zero_advantage") else "no skip"
        return f"{on}, {stats.rows_computed_frac:.0%} of rows computed"
    shares = {k: stats.paths.get(k, 0.0) for k in ("segments", "dense_mask", "padded")}
    taken = [k for k, v in shares.items() if v > 0]
    if len(taken) == 1:
        return taken[0]
    return " + ".join(f"{k} {v:.0%}" for k, v in shares.items() if v > 0)


ROLLOUT_WORDS = {
    "shared_prefix": ("shared prompt cache", "repeated prompt cache"),
    "packed_weights": ("packed weights", "plain weights"),
    "preallocated_kv": ("preallocated cache", "DynamicCache"),
}


def rollout_path(switch: str, batch) -> str:
    """Returns what a rollout ran, for the switch's own lever (from RolloutBatch.paths)."""
    yes, no = ROLLOUT_WORDS[switch]
    return yes if batch.paths.get(switch) else no


def measure(bench: Bench, switch: str, repeats: int, warmed: set) -> dict:
    """Returns the times and paths of one switch at auto and off (medians over `repeats` alternations).

    warmed: (part, settings) already run once in this process; the others get one untimed run first.
    """
    from cohort.fastpath import FastConfig

    settings = {"auto": FastConfig(), "off": FastConfig().replace(**{switch: "off"})}
    times: dict[str, list[float]] = {name: [] for name in settings}
    paths: dict[str, str] = {}
    reported: dict[str, dict] = {}
    part = "update" if switch in UPDATE_SWITCHES else "rollout"
    busy0, own0, t0_all = busy_seconds(), own_cpu_seconds(), time.time()
    for rnd in range(repeats + 1):  # round 0 warms up the sides not run before
        order = list(settings) if rnd % 2 == 0 else list(reversed(settings))
        for name in order:
            fast = settings[name]
            if rnd == 0:
                if (part, repr(fast)) in warmed:
                    continue
                warmed.add((part, repr(fast)))
            t0 = time.perf_counter()
            if switch in UPDATE_SWITCHES:
                out = bench.update(fast, "zero" if switch == "skip_zero_advantage" else "full")
                seconds = time.perf_counter() - t0
                paths[name] = update_path(switch, out)
                reported[name] = {"paths": dict(out.paths), "rows_computed_frac": out.rows_computed_frac}
            else:
                out = bench.rollout(fast)
                seconds = time.perf_counter() - t0
                paths[name] = rollout_path(switch, out)
                reported[name] = {
                    "paths": dict(out.paths),
                    "completion_tokens": sum(len(c) for c in out.completion_ids),
                }
            if rnd:
                times[name].append(seconds)
    others = others_cpu_share(busy0, own0, t0_all)
    auto_s, off_s = statistics.median(times["auto"]), statistics.median(times["off"])
    return {
        "switch": switch,
        "part": PARTS[switch].format(zero=bench.zero_groups),
        "auto_seconds": auto_s,
        "off_seconds": off_s,
        "off_over_auto": off_s / auto_s,
        "auto_all": [round(t, 4) for t in times["auto"]],
        "off_all": [round(t, 4) for t in times["off"]],
        "path_auto": paths["auto"],
        "path_off": paths["off"],
        "others_cpu": others,
        "reported": reported,
    }


def print_table(rows: list[dict]) -> None:
    """Prints the results as a markdown table."""
    print("| switch | part measured | auto (s) | off (s) | off / auto | path at auto | path at off |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| `{r['switch']}` | {r['part']} | {r['auto_seconds']:.3f} | {r['off_seconds']:.3f} | "
            f"{r['off_over_auto']:.2f}× | {r['path_auto']} | {r['path_off']} |"
        )


def main(argv=None) -> None:
    """Measures every chosen switch, prints the table and writes the JSON."""
    args = parse_args(argv)
    import torch
    import transformers
    from transformers.utils import logging as hf_logging

    from cohort.fastpath import FastConfig, probes
    from cohort.fastpath.memory import bound_heap

    hf_logging.disable_progress_bar()
    torch.set_num_threads(args.threads)
    bound_heap(FastConfig().heap_mmap_threshold_mib)  # as the trainer does (fast.heap_bound=auto)
    t_start = time.time()
    bench = Bench(args)
    lengths = bench.lengths
    print(
        f"workload (b) on the {args.model} bench model: {len(bench.prompts)} prompts of "
        f"{min(map(len, bench.prompts))}-{max(map(len, bench.prompts))} tokens x G={args.group_size}, "
        f"completions of {min(lengths)}-{max(lengths)} tokens (mean {statistics.mean(lengths):.1f}, max "
        f"{args.max_len}); {args.repeats} alternations per switch, {args.threads} threads",
        flush=True,
    )
    rows, warmed = [], {("rollout", repr(FastConfig()))}  # Bench's own rollout ran at auto
    for switch in args.switches:
        rows.append(measure(bench, switch, args.repeats, warmed))
        r = rows[-1]
        print(
            f"  {switch:20} auto {r['auto_seconds']:.3f} s ({r['path_auto']}), "
            f"off {r['off_seconds']:.3f} s ({r['path_off']}); other processes {r['others_cpu']:.0%} of the CPU",
            flush=True,
        )
    print()
    print_table(rows)
    busiest = max(r["others_cpu"] for r in rows)
    if busiest > 0.05:
        print(
            f"\nwarning: other processes used up to {busiest:.0%} of the CPU while this ran; the times are "
            "contended (run it on an otherwise idle machine)"
        )
    results = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t_start)),
        "seconds_total": time.time() - t_start,
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "threads": torch.get_num_threads(),
        },
        "options": vars(args),
        "model": bench.meta,
        "prompt_lengths": [len(p) for p in bench.prompts],
        "completion_lengths": lengths,
        "checks": {"model": probes.results(bench.model), "torch_build": probes.results(None)},
        "switches": rows,
    }
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(f"\nwrote {args.out} in {results['seconds_total']:.0f} s")


if __name__ == "__main__":
    main()
