"""Per-process memory and step time of a ~100 M-parameter policy on 2 gloo processes: fsdp against replicate.

    python benchmarks/sharding/run.py --out runs/sharding            # the table in docs/usage.md
    python benchmarks/sharding/run.py --out /tmp/s --hidden 256 --layers 4 --steps 2   # a quick look

Each strategy runs the same short training (same model folder, prompts, batch, seeds) under
torchrun; each process reports the bytes of its parameters, gradients and AdamW state (its shard under
fsdp), its peak resident memory from the first step on (model loading is excluded by resetting the peak
counter; benchmarks/serve/fsdp_memory.py measures it), and its step times. One process
(no strategy) runs the same steps for the step-time reference.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from cohort.models import build_tiny_model

HERE = Path(__file__).parent


def _run(model: Path, out: Path, nproc: int, strategy: str, args) -> list[dict]:
    overrides = [
        f"model.name_or_path={model}",
        "data.task=addition",
        "data.n_train=64",
        "data.n_eval=0",
        "rollout.group_size=2",
        f"rollout.batch_size={args.batch}",
        f"rollout.max_completion_length={args.completion}",
        "algo.beta=0",
        "optim.lr=1e-5",
        f"steps={args.steps}",
        "eval_at_ends=false",
        "save_every=0",
        "progress=false",
        "threads=1",
        f"out_dir={out / 'run'}",
        f"distributed.strategy={strategy}",
    ]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        "--master-port",
        str(29600 + nproc + (strategy == "fsdp")),
        str(HERE / "worker.py"),
        str(out / "ranks"),
        *overrides,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE.parent.parent / "src")}
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return [json.loads(p.read_text()) for p in sorted((out / "ranks").glob("rank-*.json"))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=4, help="completions per process per step")
    ap.add_argument("--completion", type=int, default=8, help="rollout.max_completion_length")
    args = ap.parse_args()
    model = build_tiny_model(
        args.out / "model",
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=12 if args.hidden % 12 == 0 else 4,
        num_kv_heads=4,
        seed=0,
        max_position_embeddings=256,
    )
    from transformers import AutoConfig, AutoModelForCausalLM

    with __import__("torch").device("meta"):
        n_params = sum(
            p.numel()
            for p in AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model)).parameters()
        )
    results = {}
    for name, nproc, strategy in (
        ("one process", 1, "auto"),
        ("replicate", 2, "replicate"),
        ("fsdp", 2, "fsdp"),
    ):
        rows = _run(model, args.out / name.replace(" ", "_"), nproc, strategy, args)
        results[name] = rows
        print(name, json.dumps(rows), flush=True)
    lines = [
        f"Model: {n_params / 1e6:.1f} M parameters (Qwen2, hidden {args.hidden}, {args.layers} layers, float32), "
        f"{args.batch} completions of up to {args.completion} tokens per process per step, {args.steps} steps; "
        "per process (max over processes), median step time after the first step.",
        "",
        "| run | params MiB | grads MiB | AdamW MiB | state total MiB | peak RSS MiB | step s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, rows in results.items():
        st = max(r["params_mib"] + r["grads_mib"] + r["adamw_mib"] for r in rows)
        step = statistics.median(t for r in rows for t in r["step_times"][1:] or r["step_times"])
        lines.append(
            f"| {name} | {max(r['params_mib'] for r in rows):.0f} | {max(r['grads_mib'] for r in rows):.0f} | "
            f"{max(r['adamw_mib'] for r in rows):.0f} | {st:.0f} | {max(r['peak_rss_mib'] for r in rows):.0f} | "
            f"{step:.2f} |"
        )
    table = "\n".join(lines)
    (args.out / "table.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
