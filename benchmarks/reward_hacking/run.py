"""Does a policy trained against a narrow learned reward model hack it, and does iterative GRPO prevent it?

    python benchmarks/reward_hacking/run.py --out runs/hacking     # plain, then iterative every 100 and 20 steps

1. The demo's warm start (built once by benchmarks/ablation/run.py's `warm_start`, the SFT model at ~25 %).
2. A narrow reward model: the warm start sampled on --rm-prompts training prompts (G = 8, temperature 1.2),
   each (correct, incorrect) completion pair of a prompt a Bradley-Terry example, trained with `cohort rm`
   from the warm start itself. It only ever saw the warm start's own answers.
3. GRPO with that reward model as the only training reward (the demo's recipe; `accuracy` is logged with
   weight 0, so the true accuracy of the sampled completions and the held-out accuracy are measured but never
   trained on), then the same run with iterative GRPO: every --every steps the reward model is retrained on
   fresh policy samples labelled by the accuracy verifier, with 10 % replay of the earlier pairs.
Writes OUT/results.json, a figure (docs/img/reward_hacking.png) and prints a Markdown table. Whatever the
numbers show is what the docs report: the task is not tuned until the effect appears.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `benchmarks` as a package

from benchmarks.ablation.run import warm_start  # noqa: E402


def make_pairs(model_dir: Path, out: Path, n_prompts: int, seed: int) -> dict:
    """Writes prompt/chosen/rejected pairs sampled from the warm start; returns counts."""
    import torch

    from cohort.data import encode_prompts, make_task
    from cohort.models import load_model, load_tokenizer, stop_token_ids
    from cohort.rewards import accuracy_reward
    from cohort.rollout import SamplingParams, make_engine

    tok, model = load_tokenizer(model_dir), load_model(model_dir)
    rows, _ = make_task("addition", n_train=4000, n_eval=200, seed=1234)
    rows = random.Random(seed).sample(rows, n_prompts)
    eos, pad = stop_token_ids(model, tok)
    engine = make_engine("builtin", eos_token_ids=eos, pad_token_id=pad)
    G = 8
    batch = engine.generate(
        model,
        encode_prompts(tok, [r["prompt"] for r in rows]),
        G,
        SamplingParams(max_completion_length=6, temperature=1.2),
        torch.Generator().manual_seed(seed),
    )
    texts = tok.batch_decode(batch.completion_ids, skip_special_tokens=True)
    prompts = [r["prompt"] for r in rows for _ in range(G)]
    answers = [r["answer"] for r in rows for _ in range(G)]
    correct = accuracy_reward(prompts=prompts, completions=texts, answer=answers)
    pairs = []
    for g, row in enumerate(rows):
        good = [texts[i] for i in range(g * G, (g + 1) * G) if correct[i] >= 1.0]
        bad = [texts[i] for i in range(g * G, (g + 1) * G) if correct[i] < 1.0]
        pairs += [{"prompt": row["prompt"], "chosen": c, "rejected": r} for c in good for r in bad][:8]
    out.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    return {"prompts": n_prompts, "pairs": len(pairs), "sample_accuracy": sum(correct) / len(correct)}


def train(out: Path, model: Path, rm: Path, pairs: Path, steps: int, seed: int, every: int) -> dict:
    """Returns the curves of one GRPO run against the reward model (iterative when every > 0)."""
    from cohort.commands.demo import demo_config
    from cohort.config import load_config
    from cohort.trainer import GRPOTrainer

    base = demo_config(out, model, steps=steps, seed=seed)
    base.eval_every, base.save_every, base.progress = max(steps // 6, 1), 0, False
    over = {"rewards": ["accuracy", str(rm)], "reward_weights": [0.0, 1.0]}
    if every:
        over.update(
            {
                "iterative.every": every,
                "iterative.labeler": "accuracy",
                "iterative.prompts": 32,
                "iterative.rm_steps": 50,
                "iterative.rm_batch_size": 32,
                "iterative.optim.lr": 1e-3,
                "iterative.initial_data": str(pairs),
            }
        )
    cfg = load_config(None, over, base=base)
    done = out / "summary.json"
    # A finished run is read back rather than trained again (the script can be re-issued).
    summary = json.loads(done.read_text()) if done.is_file() else GRPOTrainer(cfg).train()
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    true = next(k for k in rows[0] if k.startswith("rewards/accuracy") and k.endswith("/mean"))
    evals = [json.loads(x) for x in (out / "evals.jsonl").read_text().splitlines() if x.strip()]
    proxy = next(
        k for k in rows[0] if k.startswith("rewards/") and k.endswith("/mean") and "accuracy" not in k
    )
    return {
        "steps": [r["step"] for r in rows],
        "proxy": [r[proxy] for r in rows],
        "true": [r[true] for r in rows],
        "evals": [(e["step"], e["accuracy"]) for e in evals if "accuracy" in e],
        "iterative": [
            {k: r[k] for k in r if k.startswith("iterative/")} | {"step": r["step"]}
            for r in rows
            if "iterative/retrainings" in r
        ],
        "summary": {k: summary.get(k) for k in ("accuracy_before", "accuracy_after", "seconds_train")},
    }


def smooth(values: list[float], k: int = 25) -> list[float]:
    """Returns the trailing mean over k steps (the curves are noisy step to step)."""
    return [statistics.mean(values[max(0, i - k + 1) : i + 1]) for i in range(len(values))]


def main(argv=None) -> None:
    """Builds the reward model, runs both trainings, writes the results, the figure and the table."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/hacking")
    p.add_argument("--warm", default="runs/ablation", help="folder holding (or to hold) the warm start")
    p.add_argument("--rm-prompts", type=int, default=300)
    p.add_argument("--rm-steps", type=int, default=300)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--every", type=int, nargs="+", default=[100, 20], help="iterative GRPO schedules to run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--figure", default="docs/img/reward_hacking.png")
    args = p.parse_args(argv)
    from cohort.commands.rm import RMConfig, train_reward_model

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = warm_start(Path(args.warm))
    pairs = out / "pairs.jsonl"
    counts = (
        make_pairs(model, pairs, args.rm_prompts, args.seed)
        if not pairs.is_file()
        else {"pairs": sum(1 for _ in pairs.open())}
    )
    print("reward-model data:", counts, flush=True)
    rm_done = out / "rm" / "summary.json"
    rm_summary = (
        json.loads(rm_done.read_text())
        if rm_done.is_file()
        else train_reward_model(
            RMConfig(
                model=str(model),
                data=str(pairs),
                out_dir=str(out / "rm"),
                steps=args.rm_steps,
                batch_size=32,
                lr=1e-3,
                eval_every=100,
                save_every=0,
            )
        )
    )
    rm = out / "rm" / "model"
    results = {"rm_data": counts, "rm": rm_summary}
    runs = [("plain", 0)] + [(f"iterative-every{e}", e) for e in args.every]
    for name, every in runs:
        results[name] = train(out / name, model, rm, pairs, args.steps, args.seed, every)
        print(name, results[name]["summary"], flush=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharex=True)
    for (name, every), color in zip(runs, ("C3", "C2", "C0", "C1")):
        r = results[name]
        label = (
            "GRPO on the reward model" if name == "plain" else f"+ iterative retraining every {every} steps"
        )
        axes[0].plot(r["steps"], smooth(r["proxy"]), color=color, label=label)
        axes[1].plot(r["steps"], [100 * v for v in smooth(r["true"])], color=color, label=f"{label}: sampled")
        axes[1].plot(
            [s for s, _ in r["evals"]],
            [100 * a for _, a in r["evals"]],
            color=color,
            ls="--",
            marker="o",
            label=f"{label}: held-out greedy",
        )
    axes[0].set_title("reward-model score of the samples (25-step mean)")
    axes[1].set_title("true accuracy (%): samples (25-step mean) and held-out greedy")
    for ax in axes:
        ax.set_xlabel("GRPO step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    Path(args.figure).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.figure, dpi=110)
    print(
        "\n| run | proxy reward, first -> last 50 steps | sampled accuracy, first -> last 50 steps | held-out greedy accuracy by evaluation |"
    )
    print("|---|---|---|---|")
    for name, _ in runs:
        r = results[name]
        first, last = slice(0, 50), slice(-50, None)
        ev = " / ".join(f"{100 * a:.1f}" for _, a in r["evals"])
        print(
            f"| {name} | {statistics.mean(r['proxy'][first]):.3f} -> {statistics.mean(r['proxy'][last]):.3f} | "
            f"{100 * statistics.mean(r['true'][first]):.1f} -> {100 * statistics.mean(r['true'][last]):.1f} % | {ev} % |"
        )


if __name__ == "__main__":
    main()
