"""Update and generation time per model family, with cohort's fast paths on and off, alternating.

    python benchmarks/bench_families.py --families llama,qwen2,phi3 --rounds 3

Each family gets a random model of the benchmark's 14 M shape (hidden 384, 8 layers, 6 heads,
intermediate 1024, 258-token vocabulary) built from its transformers config, and workload (b)'s
batch: 4 prompts of 100-150 tokens, G = 8, completions of exponential length (mean 60, at most 128).
"on" is cohort as shipped (segment attention in the update, shared-prefix decoding in the sampler,
where each family's once-per-model check accepts them); "off" forces the fallbacks (dense block mask,
repeated prompt cache), which is what families other than Qwen2 got before the plans were handed over
on a 4-D carrier mask; for a sliding-window model whose sequences outrun the window (`mistral_w64`)
"off" is the padded layout, what it got before segment attention applied windows. The update is forward + backward + AdamW over the batch; generation samples
--max-new tokens per completion (EOS unreachable).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
import transformers as tf

import cohort.logprobs as lp_module
import cohort.rollout.builtin as builtin
from cohort.logprobs import completion_logprobs
from cohort.memory import bound_heap
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


_SEGMENTS_OK = lp_module._segments_ok


def _set_fast_paths(on: bool) -> None:
    lp_module._segments_ok = _SEGMENTS_OK if on else (lambda model, window=None: False)
    builtin.PREFIX_SHARING_MIN = 1 << 18 if on else 1 << 60


def _measure(family, prompts, comps, G, engine, params, rounds):
    """Returns ({(phase, on): [seconds]}, which paths the family's checks accepted)."""
    torch.manual_seed(0)
    model = FAMILIES[family]()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-7)

    def update():
        model.train()
        out = completion_logprobs(model, prompts, comps, G)
        (out.logp * out.mask).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    def generate():
        engine.generate(model, prompts, G, params, torch.Generator().manual_seed(0))

    times: dict[tuple[str, bool], list[float]] = {}
    for rnd in range(rounds + 1):  # round 0 warms up (and runs the once-per-model checks)
        for on in (True, False):
            _set_fast_paths(on)
            for phase, fn in (("update", update), ("generate", generate)):
                start = time.perf_counter()
                fn()
                if rnd:
                    times.setdefault((phase, on), []).append(time.perf_counter() - start)
    _set_fast_paths(True)
    taken = f"segments {lp_module._SEGMENTS_OK.get(model)}, shared prefix {builtin._PREFIX_OK.get(model)}"
    if model in lp_module._SEGMENTS_WINDOW_OK:
        taken += f", windowed segments {lp_module._SEGMENTS_WINDOW_OK[model]}"
    return times, taken


def main(argv: list[str] | None = None) -> None:
    """Prints, per family, median seconds of the update and of generation with fast paths on and off."""
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
    comps = [[rng.randrange(2, VOCAB) for _ in range(min(128, max(1, int(rng.expovariate(1 / 60)))))] for _ in range(4 * G)]
    engine = BuiltinEngine(eos_token_ids=[VOCAB + 1], pad_token_id=0)
    params = SamplingParams(max_completion_length=args.max_new)
    print(f"{'family':10s} {'phase':10s} {'on s':>7s} {'off s':>7s} {'off/on':>7s}  paths taken")
    for family in args.families.split(","):
        times, taken = _measure(family, prompts, comps, G, engine, params, args.rounds)
        for phase in ("update", "generate"):
            on_s, off_s = (statistics.median(times[(phase, on)]) for on in (True, False))
            print(f"{family:10s} {phase:10s} {on_s:7.2f} {off_s:7.2f} {off_s / on_s:6.2f}x  {taken}")


if __name__ == "__main__":
    main()
