"""Update and generation time per model family, with cohort's fast paths at auto and off, alternating.

    python benchmarks/levers/bench_families.py --families llama,qwen2,phi3 --rounds 3

Each family gets a random model of the benchmark's 14 M shape (hidden 384, 8 layers, 6 heads,
intermediate 1024, 258-token vocabulary) built from its transformers config, and workload (b)'s
batch: 4 prompts of 100-150 tokens, G = 8, completions of exponential length (mean 60, at most 128).
"auto" is cohort as shipped (`FastConfig()`: segment attention in the update, shared-prefix decoding
in the sampler, where each family's once-per-model check accepts them); "off" is
`FastConfig(segments="off", shared_prefix="off")`: the dense block mask in the update and the
repeated prompt cache in decoding, which is what families other than Qwen2 got before the plans were
handed over on a 4-D carrier mask. For a sliding-window model whose sequences outrun the window
(`mistral_w64`) the dense mask is not exact, so "off" is the padded layout, what it got before
segment attention applied windows. The update is forward + backward + AdamW over the batch;
generation samples --max-new tokens per completion (EOS unreachable). The paths each side actually
took (LogProbs.path, RolloutBatch.paths) and the once-per-model verdicts (cohort.fastpath.probes) are
printed with the times.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
import transformers as tf

from cohort.fastpath import FastConfig, probes
from cohort.fastpath.memory import bound_heap
from cohort.logprobs import completion_logprobs
from cohort.rollout import BuiltinEngine, SamplingParams

VOCAB = 258
SHAPE = {
    "hidden_size": 384,
    "intermediate_size": 1024,
    "num_hidden_layers": 8,
    "num_attention_heads": 6,
    "num_key_value_heads": 6,
}
TOKENS = {"vocab_size": VOCAB, "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": None}
FAMILIES = {
    "qwen2": lambda: tf.Qwen2ForCausalLM(tf.Qwen2Config(**SHAPE, **TOKENS)),
    "llama": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**SHAPE, **TOKENS)),
    "phi3": lambda: tf.Phi3ForCausalLM(tf.Phi3Config(**SHAPE, **TOKENS)),
    "olmo2": lambda: tf.Olmo2ForCausalLM(tf.Olmo2Config(**SHAPE, **TOKENS)),
    "gpt_neox": lambda: tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(**SHAPE, **TOKENS)),
    # A 64-token sliding window, which every sequence of the batch outruns: segments apply the window.
    "mistral_w64": lambda: tf.MistralForCausalLM(tf.MistralConfig(**SHAPE, **TOKENS, sliding_window=64)),
}


SETTINGS = {
    "auto": FastConfig(),
    "off": FastConfig(segments="off", shared_prefix="off"),
}
"""The two sides compared: cohort as shipped, and without segment attention and shared-prefix decoding."""


def _measure(family, prompts, comps, G, params, rounds):
    """Returns ({(phase, setting): [seconds]}, {setting: paths taken}, the model's probe verdicts)."""
    torch.manual_seed(0)
    model = FAMILIES[family]()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-7)
    engines = {
        name: BuiltinEngine(eos_token_ids=[VOCAB + 1], pad_token_id=0, fast=fast)
        for name, fast in SETTINGS.items()
    }
    taken: dict[str, dict] = {name: {} for name in SETTINGS}

    def update(name):
        model.train()
        out = completion_logprobs(model, prompts, comps, G, fast=SETTINGS[name])
        (out.logp * out.mask).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        taken[name]["update"] = out.path

    def generate(name):
        batch = engines[name].generate(model, prompts, G, params, torch.Generator().manual_seed(0))
        taken[name]["shared_prefix"] = batch.paths.get("shared_prefix")

    times: dict[tuple[str, str], list[float]] = {}
    for rnd in range(rounds + 1):  # round 0 warms up (and runs the once-per-model checks)
        for name in SETTINGS:
            for phase, fn in (("update", update), ("generate", generate)):
                start = time.perf_counter()
                fn(name)
                if rnd:
                    times.setdefault((phase, name), []).append(time.perf_counter() - start)
    return times, taken, probes.results(model)


def _describe(taken: dict) -> str:
    return f"update {taken.get('update')}, " + (
        "shared prefix" if taken.get("shared_prefix") else "repeated prompt cache"
    )


def main(argv: list[str] | None = None) -> None:
    """Prints, per family, median seconds of the update and of generation with fast paths at auto and off."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", default="llama,qwen2", help=f"comma list of {sorted(FAMILIES)}")
    ap.add_argument("--max-new", type=int, default=64, help="tokens generated per completion")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    bound_heap(16)
    rng = random.Random(0)
    G = 8
    prompts = [[rng.randrange(2, VOCAB) for _ in range(rng.randint(100, 150))] for _ in range(4)]
    comps = [
        [rng.randrange(2, VOCAB) for _ in range(min(128, max(1, int(rng.expovariate(1 / 60)))))]
        for _ in range(4 * G)
    ]
    params = SamplingParams(max_completion_length=args.max_new)
    print(
        f"{'family':12s} {'phase':10s} {'auto s':>7s} {'off s':>7s} {'off/auto':>8s}  paths taken (auto | off); checks"
    )
    for family in args.families.split(","):
        times, taken, verdicts = _measure(family, prompts, comps, G, params, args.rounds)
        paths = f"{_describe(taken['auto'])} | {_describe(taken['off'])}; {verdicts}"
        for phase in ("update", "generate"):
            auto_s, off_s = (statistics.median(times[(phase, name)]) for name in SETTINGS)
            print(f"{family:12s} {phase:10s} {auto_s:7.2f} {off_s:7.2f} {off_s / auto_s:7.2f}x  {paths}")


if __name__ == "__main__":
    main()
