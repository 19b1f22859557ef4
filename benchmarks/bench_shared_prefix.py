"""Generation time with and without shared-prefix decoding, alternating in one process.

    python benchmarks/bench_shared_prefix.py --model runs/bench/models/14m_exact --prompt-len 600 --group 16

Both paths are cohort's builtin sampler (`BuiltinEngine._decode`) with the same seed, so they sample the
same tokens (asserted); the only difference is whether the G samples of a prompt read one copy of its
prefill cache or G repeated copies. Prompts are random token ids with lengths in [3/4, 1] x --prompt-len.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from transformers import AutoModelForCausalLM

from cohort.memory import bound_heap
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
    bound_heap(16)
    model = AutoModelForCausalLM.from_pretrained(args.model).eval()
    vocab = model.config.vocab_size
    rng = random.Random(0)
    prompts = [
        [rng.randrange(3, vocab) for _ in range(rng.randint(args.prompt_len * 3 // 4, args.prompt_len))]
        for _ in range(args.prompts)
    ]
    eng = BuiltinEngine(eos_token_ids=[model.config.eos_token_id or 1], pad_token_id=0)
    params = SamplingParams(max_completion_length=args.max_new)
    times: dict[bool, list[float]] = {True: [], False: []}
    with torch.inference_mode():
        for rnd in range(args.rounds + 1):  # round 0 warms up
            outs = {}
            for shared in (True, False):
                gen = torch.Generator().manual_seed(rnd)
                start = time.perf_counter()
                outs[shared] = eng._decode(
                    model, prompts, args.group, params, gen, torch.device("cpu"), shared=shared
                )
                if rnd:
                    times[shared].append(time.perf_counter() - start)
            assert torch.equal(outs[True][0], outs[False][0]), "the two paths sampled different tokens"
    med = {k: statistics.median(v) for k, v in times.items()}
    print(
        f"prompts {args.prompts} x G {args.group}, prompt <= {args.prompt_len} tokens, {args.max_new} new tokens: "
        f"shared {med[True]:.2f} s, repeated {med[False]:.2f} s, speed-up {med[False] / med[True]:.2f}x"
    )


if __name__ == "__main__":
    main()
