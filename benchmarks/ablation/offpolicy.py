"""Off-policy by precision: sample from a bfloat16 copy of the policy, train in float32, with and without TIS / MIS.

    python benchmarks/ablation/offpolicy.py --out runs/offpolicy --steps 200

From the demo's warm start (built by run.py under --warm), the demo's recipe with 4 minibatches (as the
ablation) runs four ways: the float32 sampler (on-policy up to rounding), a bfloat16 sampler without
correction, with token-level TIS (C = 2) and with sequence-level MIS ([0.5, 2]). Prints, per run, the sampler
gap the `logprob_gap` health check watches (median and largest over steps), the raw importance ratios'
extremes, the share of tokens the correction changed, held-out accuracy and s/step, as a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `benchmarks` as a package

from benchmarks.ablation.run import COMMON, warm_start  # noqa: E402

RUNS = {
    "float32 sampler": {},
    "bfloat16 sampler, no correction": {"rollout.sampler_dtype": "bfloat16"},
    "bfloat16 sampler + token_tis (C = 2)": {
        "rollout.sampler_dtype": "bfloat16",
        "algo.sampler_correction": "token_tis",
    },
    "bfloat16 sampler + sequence_mis [0.5, 2]": {
        "rollout.sampler_dtype": "bfloat16",
        "algo.sampler_correction": "sequence_mis",
        "algo.sampler_is_min": 0.5,
    },
}


def main(argv=None) -> None:
    """Runs the four trainings and prints the table."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/offpolicy")
    p.add_argument("--warm", default="runs/ablation", help="folder holding (or to hold) the warm start")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    from cohort.commands.demo import demo_config
    from cohort.config import load_config, to_dict
    from cohort.trainer import GRPOTrainer

    model = warm_start(Path(args.warm))
    rows = []
    for name, over in RUNS.items():
        run = Path(args.out) / "".join(c if c.isalnum() else "_" for c in name)
        base = demo_config(run, model, steps=args.steps, seed=args.seed)
        base.eval_every, base.save_every, base.progress = args.steps, 0, False
        cfg = load_config(None, over, base=load_config(None, COMMON, base=base))
        assert to_dict(cfg)["rollout"]["sampler_dtype"] == over.get("rollout.sampler_dtype")
        summary = GRPOTrainer(cfg).train()
        metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
        gaps = [m["sampler/logprob_gap"] for m in metrics if "sampler/logprob_gap" in m]
        rows.append(
            {
                "run": name,
                "gap_median": statistics.median(gaps),
                "gap_max": max(gaps),
                "ratio_min": min(
                    (m["sampler/is_ratio_min"] for m in metrics if "sampler/is_ratio_min" in m), default=None
                ),
                "ratio_max": max(
                    (m["sampler/is_ratio_max"] for m in metrics if "sampler/is_ratio_max" in m), default=None
                ),
                "corrected": statistics.mean(m.get("sampler/is_ratio_corrected_frac", 0.0) for m in metrics),
                "before": summary.get("accuracy_before"),
                "after": summary.get("accuracy_after"),
                "s_per_step": statistics.median(m["step_time"] for m in metrics),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    (Path(args.out) / "results.json").write_text(json.dumps(rows, indent=1))
    print(
        "\n| run | sampler gap, median / max (nats) | raw ratio min / max | tokens corrected | held-out before -> after | s/step |"
    )
    print("|---|---|---|---|---|---|")
    for r in rows:
        ratio = "—" if r["ratio_max"] is None else f"{r['ratio_min']:.3f} / {r['ratio_max']:.3f}"
        print(
            f"| {r['run']} | {r['gap_median']:.2e} / {r['gap_max']:.2e} | {ratio} | {100 * r['corrected']:.2f} % | "
            f"{100 * (r['before'] or 0):.1f} % -> {100 * (r['after'] or 0):.1f} % | {r['s_per_step']:.3f} |"
        )


if __name__ == "__main__":
    main()
