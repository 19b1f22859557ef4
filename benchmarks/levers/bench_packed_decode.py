"""Generation time with and without oneDNN-packed decode weights (CPU), alternating in one process.

    python benchmarks/levers/bench_packed_decode.py --model runs/bench/models/14m_mean60
    python benchmarks/levers/bench_packed_decode.py --width 896 --layers 4 --group 4 --max-new 32
    python benchmarks/levers/bench_packed_decode.py --width 896 --setting on   # pack whatever the thresholds say

Both sides are cohort's builtin sampler with the same seeds; the only difference is the switch
`fast.packed_weights`: --setting (auto, the default, or on) against off. The reorder of the weights
is inside the timed call, as in training, where it is redone for every rollout; whether a rollout
packed is RolloutBatch.paths["packed_weights"] (printed). --width builds a random Qwen2 model of that
hidden size in memory (Qwen2.5-0.5B's proportions: 14 heads, 2 KV heads, MLP 5.43 x width, 151,936-token vocabulary
unless --vocab), so a model too large to train here can still be timed. Prints seconds per rollout
and the ratio, and how many of the sampled completions were identical (float32 rounding differs
between the two kernels, so a sample that sits on a boundary may differ; the distribution does not).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from cohort.fastpath import FastConfig
from cohort.fastpath.memory import bound_heap
from cohort.rollout import BuiltinEngine, SamplingParams


def build(args) -> torch.nn.Module:
    """Returns the model to time: loaded from --model, or a random Qwen2 of --width built in memory."""
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

    if args.model:
        return AutoModelForCausalLM.from_pretrained(args.model).eval()
    torch.manual_seed(0)
    config = Qwen2Config(
        hidden_size=args.width,
        num_hidden_layers=args.layers,
        num_attention_heads=14,
        num_key_value_heads=2,
        intermediate_size=round(args.width * 4864 / 896),
        vocab_size=args.vocab,
        tie_word_embeddings=True,
        max_position_embeddings=2048,
    )
    return Qwen2ForCausalLM(config).eval()


def main(argv: list[str] | None = None) -> None:
    """Prints seconds per rollout with fast.packed_weights at --setting and off, and their ratio."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="a local model directory or hub name")
    src.add_argument("--width", type=int, help="build a random Qwen2 of this hidden size (a multiple of 14)")
    ap.add_argument("--layers", type=int, default=4, help="layers of the --width model")
    ap.add_argument("--vocab", type=int, default=151936, help="vocabulary of the --width model")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=150, help="prompt lengths are in [2/3, 1] x this")
    ap.add_argument("--group", type=int, default=8, help="G samples per prompt")
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument(
        "--setting", choices=["auto", "on"], default="auto", help="fast.packed_weights against off"
    )
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    bound_heap(FastConfig().heap_mmap_threshold_mib)
    model = build(args)
    vocab = model.config.vocab_size
    eos = model.config.eos_token_id if isinstance(model.config.eos_token_id, int) else 1
    rng = random.Random(0)
    prompts = [
        [
            rng.randrange(3, min(vocab, 5000))
            for _ in range(rng.randint(args.prompt_len * 2 // 3, args.prompt_len))
        ]
        for _ in range(args.prompts)
    ]
    params = SamplingParams(max_completion_length=args.max_new)
    engines = {
        setting: BuiltinEngine(eos_token_ids=[eos], pad_token_id=0, fast=FastConfig(packed_weights=setting))
        for setting in (args.setting, "off")
    }
    times: dict[str, list[float]] = {setting: [] for setting in engines}
    packed: dict[str, bool] = {}
    same = total = 0
    for rnd in range(args.rounds + 1):  # round 0 warms up
        outs = {}
        for setting, engine in engines.items():
            start = time.perf_counter()
            outs[setting] = engine.generate(
                model, prompts, args.group, params, torch.Generator().manual_seed(rnd)
            )
            if rnd:
                times[setting].append(time.perf_counter() - start)
            packed[setting] = outs[setting].paths.get("packed_weights", False)
        a, b = (outs[setting].completion_ids for setting in engines)
        same += sum(x == y for x, y in zip(a, b))
        total += len(a)
    med = {k: statistics.median(v) for k, v in times.items()}
    params_m = sum(p.numel() for p in model.parameters()) / 1e6
    print(
        f"{params_m:.1f} M parameters, {args.prompts} prompts x G={args.group}, {args.max_new} new tokens: "
        f"off {med['off']:.3f} s, {args.setting} {med[args.setting]:.3f} s per rollout "
        f"-> {med['off'] / med[args.setting]:.2f}x (medians of {args.rounds}; packed: {args.setting} "
        f"{packed[args.setting]}, off {packed['off']}; identical completions {same}/{total})"
    )


if __name__ == "__main__":
    main()
