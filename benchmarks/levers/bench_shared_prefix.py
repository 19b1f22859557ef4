"""Generation time with and without shared-prefix decoding, alternating in one process.

    python benchmarks/levers/bench_shared_prefix.py --model runs/bench/models/14m_exact --prompt-len 600 --group 16

Both sides are cohort's builtin sampler with the same seeds: `fast.shared_prefix="on"` (the G samples
of a prompt read one copy of its prefill cache, whatever the size threshold says) against "off" (G
repeated copies). They sample the same tokens (asserted), and each side's RolloutBatch.paths says which
path it took. Prompts are random token ids with lengths in [3/4, 1] x --prompt-len.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from transformers import AutoModelForCausalLM

from cohort.fastpath import FastConfig
from cohort.fastpath.memory import bound_heap
from cohort.rollout import BuiltinEngine, SamplingParams


def main(argv: list[str] | None = None) -> None:
    """Prints seconds per generation for shared and repeated prompt caches, and their ratio."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a local model directory or hub name")
    ap.add_argument("--prompt-len", type=int, default=600)
    ap.add_argument("--group", type=int, default=16, help="G samples per prompt")
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    bound_heap(FastConfig().heap_mmap_threshold_mib)
    model = AutoModelForCausalLM.from_pretrained(args.model).eval()
    vocab = model.config.vocab_size
    rng = random.Random(0)
    prompts = [
        [rng.randrange(3, vocab) for _ in range(rng.randint(args.prompt_len * 3 // 4, args.prompt_len))]
        for _ in range(args.prompts)
    ]
    eos = model.config.eos_token_id or 1
    engines = {
        setting: BuiltinEngine(eos_token_ids=[eos], pad_token_id=0, fast=FastConfig(shared_prefix=setting))
        for setting in ("on", "off")
    }
    params = SamplingParams(max_completion_length=args.max_new)
    times: dict[str, list[float]] = {setting: [] for setting in engines}
    shared: dict[str, bool] = {}
    for rnd in range(args.rounds + 1):  # round 0 warms up (and runs the once-per-model check)
        outs = {}
        for setting, engine in engines.items():
            start = time.perf_counter()
            outs[setting] = engine.generate(
                model, prompts, args.group, params, torch.Generator().manual_seed(rnd)
            )
            if rnd:
                times[setting].append(time.perf_counter() - start)
            shared[setting] = outs[setting].paths["shared_prefix"]
        assert outs["on"].completion_ids == outs["off"].completion_ids, (
            "the two paths sampled different tokens"
        )
    med = {k: statistics.median(v) for k, v in times.items()}
    print(
        f"prompts {args.prompts} x G {args.group}, prompt <= {args.prompt_len} tokens, {args.max_new} new tokens: "
        f"shared {med['on']:.2f} s, repeated {med['off']:.2f} s, speed-up {med['off'] / med['on']:.2f}x "
        f"(paths taken: on {shared['on']}, off {shared['off']})"
    )


if __name__ == "__main__":
    main()
