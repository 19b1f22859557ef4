"""Milliseconds per decode step: cohort's builtin engine eager, captured (fast.graph_decode) and captured after
torch.compile (`compiled`: fast.compile_decode) against transformers' `generate` with its compiled static cache and
with its eager dynamic cache.

    python benchmarks/gpu/decode.py --out decode.json                        # on a GPU: the 0.5b shape
    python benchmarks/gpu/decode.py --shapes 0.5b,14L1024 --out decode.json  # and a second shape
    python benchmarks/gpu/decode.py --device cpu --tiny --out decode.json    # dry run on a CPU

Workload: a randomly initialised model of the shape (benchmarks/gpu/models.py, built from its config), 8 prompts
of 120-200 random tokens, G = 8 samples each (64 rows), 256 new tokens at temperature 1 with an EOS id that is
never sampled, so every row decodes every step. Each precision runs on its own model: bfloat16 weights
(`bf16`) and float32 weights under bf16 autocast (`fp32-autocast`, cohort's CUDA default).

A rollout's time is measured end to end (CUDA synchronised, `time.perf_counter`), one warm-up rollout (of
WARMUP_TOKENS for the eager engines, which capture and compile nothing) then the median of --repeats. ms per decode step = (rollout - prefill) / (new tokens - 1): a rollout of T tokens runs
T - 1 decode forwards after its prefill. cohort's prefill is the median eager rollout of one new token (the same
prompts, so the same prefill and setup); the captured engine's capture therefore counts in its decode steps,
as it does in every rollout (the compiled engine's compilation falls in its warm-up rollout, `warmup_s`: a
trace for the probe, without autocast, and one for the run). transformers' prefill ends where its first logits processor call starts (one sync
there), so its prefill of 64 expanded rows is not counted against it.

Also an equality check: greedy decoding of 4 prompts x G = 2 x 32 tokens in float32 without autocast, captured
against eager: the tokens must be equal and the log-probs within 1e-3.

Writes one JSON file (--out), rewritten after every measurement, so a run stopped by a timeout keeps what it had.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `benchmarks` as a package

from benchmarks.gpu.models import SHAPES, random_model, random_prompts  # noqa: E402

ENGINES = ("captured", "hf-static", "compiled", "eager", "hf-eager")
"""Measured engines in the order they run: the captured step and its target first, should the time run out."""
COHORT = {
    "captured": {"graph_decode": "on", "compile_decode": "off"},
    "compiled": {"graph_decode": "on", "compile_decode": "on"},
    "eager": {"graph_decode": "off", "compile_decode": "off"},
    "eager-nocast": {"graph_decode": "off", "compile_decode": "off", "cast_once": "off"},
}
"""cohort's engines: their fast switches. `eager-nocast` (asked for by name only) is the eager engine with autocast
casting every weight at every step, as before fast.cast_once: under fp32-autocast, against `eager`."""
EXTRA_ENGINES = ("eager-nocast", "episodes", "episodes-eager")
EPISODES = {"episodes": True, "episodes-eager": False}
"""Multi-turn episodes (asked for by name): each turn captured (fast.graph_decode) or eager. The same rows, up to
EPISODE_TURNS turns each with an EPISODE_BLOCK-token insertion after every ended turn, in a budget of --tokens; an
end-of-turn id the head is biased towards (about one token in EPISODE_TURN_LENGTH)."""
EPISODE_TURNS, EPISODE_BLOCK, EPISODE_TURN_LENGTH = 4, 30, 32
SHORT_WARMUP = ("eager", "eager-nocast", "hf-eager")
"""Engines with nothing to capture or compile: a warm-up rollout of WARMUP_TOKENS new tokens is enough to load their
kernels and fill the allocator (a full one costs 6-9 s at the 0.5b shape on an H200, for nothing measured)."""
WARMUP_TOKENS = 16
PRECISIONS = ("bf16", "fp32-autocast")


def parse_args(argv=None) -> argparse.Namespace:
    """Returns the command-line options."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (a dry run: with --tiny)")
    p.add_argument("--tiny", action="store_true", help="a tiny shape and few tokens: prove the script runs")
    p.add_argument("--shapes", default="0.5b", help=f"comma list of shapes ({', '.join(SHAPES)}); the first")
    p.add_argument(
        "--second-shape-engines",
        default="captured,hf-static,compiled,eager",
        help="engines for shapes after the first (bf16 only), comma list",
    )
    p.add_argument("--precisions", default=",".join(PRECISIONS), help="comma list of bf16, fp32-autocast")
    p.add_argument(
        "--engines", default=",".join(ENGINES), help=f"comma list of {', '.join(ENGINES + EXTRA_ENGINES)}"
    )
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=8, help="G: samples per prompt")
    p.add_argument("--tokens", type=int, default=256, help="new tokens per row")
    p.add_argument("--prompt-len", default="120,200", help="min,max prompt tokens")
    p.add_argument("--repeats", type=int, default=3, help="measured rollouts after one warm-up")
    p.add_argument("--budget-s", type=float, default=0, help="start no new measurement after this (0: none)")
    p.add_argument("--skip-equality", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="decode.json")
    args = p.parse_args(argv)
    if args.tiny:
        args.shapes, args.tokens, args.prompt_len = "tiny", 16, "12,20"
    return args


class Run:
    """The JSON result being built, written to disk after every change."""

    def __init__(self, path: str, header: dict) -> None:
        self.path = Path(path)
        self.data: dict = {"header": header, "equality": None, "results": [], "notes": []}
        self.t0 = time.perf_counter()
        self.write()

    def write(self) -> None:
        """Writes the result so far."""
        self.data["seconds"] = round(time.perf_counter() - self.t0, 1)
        self.path.write_text(json.dumps(self.data, indent=1))

    def add(self, rec: dict) -> None:
        """Records one measurement, updates the summary and prints it."""
        self.data["results"].append(rec)
        summarise(self)
        if "error" in rec:
            print(
                f"{rec['shape']:8s} {rec['precision']:14s} {rec['engine']:10s} FAILED: {rec['error']}"
                + (f" probe: {json.dumps(rec['probe'])}" if "probe" in rec else ""),
                flush=True,
            )
        elif "skipped" in rec:
            print(
                f"{rec['shape']:8s} {rec['precision']:14s} {rec['engine']:10s} skipped: {rec['skipped']}",
                flush=True,
            )
        elif "tokens_per_s" in rec:
            print(
                f"{rec['shape']:8s} {rec['precision']:14s} {rec['engine']:10s} {rec['tokens_per_s']:8.0f} sampled "
                f"tokens/s (rollout {rec['rollout_s']:.3f} s, turns {rec['episode_turns']}, captured turns "
                f"{rec['static_turns']})",
                flush=True,
            )
        else:
            print(
                f"{rec['shape']:8s} {rec['precision']:14s} {rec['engine']:10s} {rec['ms_per_step']:8.2f} ms/step "
                f"(rollout {rec['rollout_s']:.3f} s, prefill {rec['prefill_s']:.3f} s)",
                flush=True,
            )

    def note(self, text: str) -> None:
        """Records a note."""
        self.data["notes"].append(text)
        self.write()
        print(f"note: {text}", flush=True)


def syncer(device: str):
    """Returns a function that waits for the device's queued work (a no-op on a CPU)."""
    import torch

    if device.startswith("cuda"):
        return torch.cuda.synchronize
    return lambda: None


def timed(fn, sync) -> tuple[float, object]:
    """Returns (seconds, result) of fn(), the device synchronised before and after."""
    sync()
    t0 = time.perf_counter()
    out = fn()
    sync()
    return time.perf_counter() - t0, out


def precision_scope(precision: str, device: str):
    """Returns the autocast context a precision runs under (none for bf16 weights)."""
    import torch

    if precision == "fp32-autocast":
        return torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def cohort_rollout(
    model,
    prompts,
    args,
    graph: str,
    tokens: int,
    greedy: bool = False,
    compile_step: str = "off",
    cast_once: str = "auto",
):
    """Returns a function running one cohort rollout of `tokens` new tokens (graph_decode `graph`, compile_decode
    `compile_step`, cast_once `cast_once`)."""
    import torch

    from cohort.fastpath import FastConfig
    from cohort.rollout import BuiltinEngine, SamplingParams

    vocab = model.config.vocab_size
    fast = FastConfig(graph_decode=graph, compile_decode=compile_step, cast_once=cast_once)
    engine = BuiltinEngine(eos_token_ids=[vocab], pad_token_id=0, fast=fast)
    params = SamplingParams(max_completion_length=tokens, temperature=1.0, greedy=greedy)

    def run():
        gen = torch.Generator(device=args.device).manual_seed(args.seed)
        return engine.generate(model, prompts, args.group, params, generator=gen)

    return run


class FirstLogits:
    """A transformers logits processor that notes when generate first asks for a token (its prefill done)."""

    def __init__(self, sync) -> None:
        self.sync, self.t, self.calls = sync, None, 0

    def __call__(self, input_ids, scores):
        self.calls += 1
        if self.t is None:
            self.sync()
            self.t = time.perf_counter()
        return scores


def hf_rollout(model, prompts, args, static: bool, sync):
    """Returns a function running one transformers generate of --tokens new tokens, returning the seconds after
    its prefill and the decode forwards it ran."""
    import torch
    from transformers import LogitsProcessorList

    from cohort.rollout.base import left_pad

    ids, mask = left_pad(prompts, 0, torch.device(args.device))
    vocab = model.config.vocab_size
    kwargs = {
        "do_sample": True,
        "temperature": 1.0,
        "top_k": 0,
        "top_p": 1.0,
        "max_new_tokens": args.tokens,
        "min_new_tokens": args.tokens,  # with an EOS id: every row decodes every step
        "num_return_sequences": args.group,
        "pad_token_id": 0,
        "eos_token_id": vocab - 1,
    }
    if static:
        kwargs["cache_implementation"] = "static"

    def run():
        hook = FirstLogits(sync)
        torch.manual_seed(args.seed)
        out = model.generate(
            input_ids=ids, attention_mask=mask, logits_processor=LogitsProcessorList([hook]), **kwargs
        )
        sync()
        after_prefill = time.perf_counter() - hook.t
        return after_prefill, hook.calls - 1, out.shape

    return run


def warmup_tokens(args) -> int:
    """Returns the new tokens of a short warm-up rollout (SHORT_WARMUP's engines)."""
    return min(WARMUP_TOKENS, args.tokens)


def measure_cohort(model, prompts, args, engine: str, prefill: float, sync) -> dict:
    """Returns one cohort engine's ms per decode step and what its rollouts took."""
    switches = COHORT[engine]
    graph, compile_step = switches["graph_decode"], switches["compile_decode"]
    cast = switches.get("cast_once", "auto")
    run = cohort_rollout(model, prompts, args, graph, args.tokens, compile_step=compile_step, cast_once=cast)
    warm = (
        run
        if engine not in SHORT_WARMUP
        else cohort_rollout(model, prompts, args, graph, warmup_tokens(args), cast_once=cast)
    )
    warm_s, batch = timed(warm, sync)
    times, paths, compiled = [], [], []
    for _ in range(args.repeats):
        t, batch = timed(run, sync)
        times.append(t)
        paths.append(batch.paths.get("graph_decode"))
        compiled.append(batch.paths.get("compile_decode"))
    rollout = statistics.median(times)
    lengths = [len(c) for c in batch.completion_ids]
    return {
        "ms_per_step": 1000 * (rollout - prefill) / (args.tokens - 1),
        "rollout_s": rollout,
        "rollouts_s": times,
        "warmup_s": warm_s,
        "warmup_tokens": args.tokens if engine not in SHORT_WARMUP else warmup_tokens(args),
        "prefill_s": prefill,
        "graph_decode": paths,
        "compile_decode": compiled,
        "paths": dict(batch.paths),
        "mean_length": statistics.mean(lengths),
    }


class _Inserting:
    """A TurnAgent inserting the same block after every ended turn, for at most EPISODE_TURNS turns."""

    def __init__(self, block: list[int]) -> None:
        self.block, self.turns = block, {}

    def turn_ended(self, row, turn, *, truncated):
        self.turns[row] = self.turns.get(row, 0) + 1
        return self.turns[row] < EPISODE_TURNS

    def continuation(self, row, room):
        return self.block if len(self.block) < room else None


@contextlib.contextmanager
def _turns_end(model, eot: int):
    """Yields with the model's head given a bias towards `eot` (the weight kept, tied or not), restored after."""
    import math

    import torch

    head = model.lm_head
    biased = torch.nn.Linear(head.in_features, head.out_features, bias=True, device=head.weight.device)
    biased.weight = head.weight
    with torch.no_grad():
        biased.bias = torch.nn.Parameter(
            torch.zeros(head.out_features, device=head.weight.device, dtype=head.weight.dtype)
        )
        biased.bias[eot] = math.log(head.out_features / EPISODE_TURN_LENGTH)
    model.lm_head = biased
    try:
        yield
    finally:
        model.lm_head = head


def measure_episodes(model, prompts, args, static: bool, sync) -> dict:
    """Returns multi-turn episodes' sampled tokens per second, each turn captured (`static`) or eager."""
    import torch

    from cohort.episodes.decoding import StaticTurns, decode_episodes
    from cohort.fastpath import FastConfig
    from cohort.rollout import SamplingParams
    from cohort.rollout.casts import CastForward, cast_once

    device = torch.device(args.device)
    vocab = model.config.vocab_size
    eot, block = vocab - 1, list(range(10, 10 + EPISODE_BLOCK))
    rows = [p for p in prompts for _ in range(args.group)]
    params = SamplingParams(max_completion_length=args.tokens, temperature=1.0)

    def run():
        gen = torch.Generator(device=args.device).manual_seed(args.seed)
        with torch.inference_mode(), cast_once(model, device, FastConfig()) as forward:
            turns = None
            if static:
                turns = StaticTurns(
                    capture=device.type == "cuda",
                    weights=forward.weights if isinstance(forward, CastForward) else None,
                )
            out = decode_episodes(
                model, rows, params, gen, _Inserting(block), end_of_turn_ids=[eot], pad_token_id=0,
                device=device, forward=forward, static=turns,
            )  # fmt: skip
        if turns is not None and turns.failed:
            raise RuntimeError("a turn's capture failed: the episodes decoded eagerly")
        return out, (turns.turns if turns is not None else 0)

    with _turns_end(model, eot):
        warm_s, _ = timed(run, sync)
        times, sampled, turns, static_turns = [], [], [], []
        for _ in range(args.repeats):
            t, (out, n_static) = timed(run, sync)
            times.append(t)
            sampled.append(sum(sum(m) for m in out.masks))
            turns.append(sum(out.turns))
            static_turns.append(n_static)
    return {
        "tokens_per_s": statistics.median(s / t for s, t in zip(sampled, times)),
        "rollout_s": statistics.median(times),
        "rollouts_s": times,
        "warmup_s": warm_s,
        "sampled_tokens": sampled,
        "episode_turns": turns,
        "static_turns": static_turns,
    }


def measure_hf(model, prompts, args, static: bool, sync) -> dict:
    """Returns transformers generate's ms per decode step (static: its compiled static cache on CUDA)."""
    run = hf_rollout(model, prompts, args, static, sync)
    # on CUDA with a static cache the warm-up compiles the decode forward for the cache's length: a full rollout
    short = argparse.Namespace(**{**vars(args), "tokens": warmup_tokens(args)})
    warm_s, _ = timed(run if static else hf_rollout(model, prompts, short, static, sync), sync)
    times, after = [], []
    for _ in range(args.repeats):
        t, (decode_s, steps, shape) = timed(run, sync)
        times.append(t)
        after.append(decode_s / steps)
    rollout = statistics.median(times)
    return {
        "ms_per_step": 1000 * statistics.median(after),
        "rollout_s": rollout,
        "rollouts_s": times,
        "warmup_s": warm_s,
        "warmup_tokens": args.tokens if static else warmup_tokens(args),
        "prefill_s": rollout - statistics.median(after) * steps,
        "decode_steps": steps,
        "output_shape": list(shape),
        "compiled": hasattr(model, "_compiled_call"),
    }


def equality_check(args, run: Run, sync) -> None:
    """Records whether captured and eager greedy decoding agree in float32 (tokens equal, log-probs to 1e-3)."""
    import torch

    shape = args.shapes.split(",")[0]
    if not args.device.startswith("cuda"):
        run.data["equality"] = {"skipped": "CUDA graphs need a CUDA GPU; graph_decode cannot run on a CPU"}
        run.write()
        print("equality: skipped on a CPU", flush=True)
        return
    model = random_model(shape, torch.float32, args.device, args.seed)
    lo, hi = (int(x) for x in args.prompt_len.split(","))
    prompts = random_prompts(4, lo, hi, model.config.vocab_size, args.seed + 7)
    sub = argparse.Namespace(**{**vars(args), "group": 2})
    eager = cohort_rollout(model, prompts, sub, "off", 32, greedy=True)()
    captured = cohort_rollout(model, prompts, sub, "on", 32, greedy=True)()
    same = eager.completion_ids == captured.completion_ids
    gaps = [
        float((a - b).abs().max()) if len(a) == len(b) and len(a) else float("inf")
        for a, b in zip(eager.sampling_logprobs, captured.sampling_logprobs)
    ]
    first_diff = None
    if not same:
        for r, (a, b) in enumerate(zip(eager.completion_ids, captured.completion_ids)):
            if a != b:
                k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                first_diff = {"row": r, "position": k}
                break
    max_gap = max(gaps)
    rec = {
        "shape": shape,
        "rows": len(prompts) * 2,
        "tokens": 32,
        "tokens_equal": same,
        "first_difference": first_diff,
        "max_logprob_gap": max_gap,
        "logprobs_within_1e-3": max_gap <= 1e-3,
        "captured_graph_decode": captured.paths.get("graph_decode"),
        "ok": bool(same and max_gap <= 1e-3 and captured.paths.get("graph_decode")),
    }
    run.data["equality"] = rec
    run.write()
    print(f"equality: {json.dumps(rec)}", flush=True)
    del model
    torch.cuda.empty_cache()


def run_shape(shape: str, precision: str, engines: list[str], args, run: Run, sync) -> None:
    """Measures every engine on one (shape, precision), each failure recorded and the next engine run."""
    import torch

    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    model = random_model(shape, dtype, args.device, args.seed)
    model.generation_config.pad_token_id = 0
    lo, hi = (int(x) for x in args.prompt_len.split(","))
    prompts = random_prompts(args.prompts, lo, hi, model.config.vocab_size, args.seed)
    base = {"shape": shape, "precision": precision, "rows": len(prompts) * args.group, "tokens": args.tokens}
    cuda = args.device.startswith("cuda")
    with precision_scope(precision, args.device):
        prefill = None
        for engine in engines:
            rec = {**base, "engine": engine}
            if args.budget_s and time.perf_counter() - run.t0 > args.budget_s:
                run.add({**rec, "skipped": f"past the {args.budget_s:.0f} s budget"})
                continue
            if engine in ("captured", "compiled") and not cuda:
                run.add({**rec, "skipped": "CUDA graphs need a CUDA GPU (graph_decode stays off on a CPU)"})
                continue
            try:
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
                if engine in COHORT and prefill is None:
                    one = cohort_rollout(model, prompts, args, "off", 1)
                    timed(one, sync)
                    prefill = statistics.median(timed(one, sync)[0] for _ in range(3))
                t0 = time.perf_counter()
                if engine in COHORT:
                    rec.update(measure_cohort(model, prompts, args, engine, prefill, sync))
                    for path in ("graph_decode", "compile_decode"):
                        if COHORT[engine][path] == "on" and not all(rec[path]):
                            rec["error"] = f"batch.paths[{path!r}] was {rec[path]}, not all True"
                elif engine in EPISODES:
                    rec.update(measure_episodes(model, prompts, args, EPISODES[engine], sync))
                elif engine in ("hf-static", "hf-eager"):
                    rec.update(measure_hf(model, prompts, args, engine == "hf-static", sync))
                    if engine == "hf-static" and not cuda:
                        rec["note"] = (
                            "transformers compiles the static-cache forward on CUDA only: eager here"
                        )
                else:
                    raise ValueError(f"unknown engine {engine!r}")
                rec["wall_s"] = round(time.perf_counter() - t0, 1)
                if cuda:
                    rec["peak_allocated_mib"] = torch.cuda.max_memory_allocated() / 2**20
            except Exception as e:  # noqa: BLE001 - one engine failing leaves the others' figures
                rec["error"] = f"{type(e).__name__}: {e}"[:2000]
                rec["traceback"] = traceback.format_exc()[-3000:]
                if engine in ("captured", "compiled"):
                    rec["probe"] = probe_detail(model, torch.device(args.device))
            run.add(rec)
    del model
    if cuda:
        torch.cuda.empty_cache()


def probe_detail(model, device) -> dict:
    """Returns the graph_decode probe's figures on `model` (each decoding's log-prob gap to a plain forward over its
    own tokens, the chosen tokens' distance from that forward's best, the logits' rounding allowance): why a
    probe refused the captured step."""
    import torch

    from cohort.rollout import builtin
    from cohort.rollout.base import SamplingParams
    from cohort.rollout.graph import static_decode

    try:
        vocab, prompts = builtin._probe_prompts(model)
        params = SamplingParams(max_completion_length=6, greedy=True)
        kw = {"eos_token_ids": [vocab], "pad_token_id": 0, "shared": True, "check_every": 2}
        with torch.no_grad(), torch.autocast(device.type, enabled=False):
            captured = static_decode(model, prompts, 2, params, None, device, capture=True, **kw)
            uncaptured = static_decode(model, prompts, 2, params, None, device, capture=False, **kw)
            eager = builtin.BuiltinEngine(eos_token_ids=[vocab], pad_token_id=0)._decode(
                model, prompts, 2, params, None, device, shared=False
            )
            return {
                name: builtin._forward_gaps(model, prompts, 2, out)
                for name, out in (("captured", captured), ("uncaptured", uncaptured), ("eager", eager))
            }
    except Exception as e:  # noqa: BLE001 - a diagnosis, not a measurement
        return {"error": f"{type(e).__name__}: {e}"[:500]}


def summarise(run: Run) -> None:
    """Adds the ratios per (shape, precision): captured and compiled / HF static, captured / eager, compiled /
    captured, eager / HF static, eager / eager-nocast (fast.cast_once); multi-turn episodes' sampled tokens per
    second, captured turns against eager."""
    by: dict[tuple, dict] = {}
    rates: dict[tuple, dict] = {}
    for r in run.data["results"]:
        if "ms_per_step" in r and "error" not in r:
            by.setdefault((r["shape"], r["precision"]), {})[r["engine"]] = r["ms_per_step"]
        if "tokens_per_s" in r and "error" not in r:
            by.setdefault((r["shape"], r["precision"]), {})
            rates.setdefault((r["shape"], r["precision"]), {})[r["engine"]] = r["tokens_per_s"]
    out = []
    for (shape, precision), ms in by.items():
        row = {"shape": shape, "precision": precision, **{f"{k}_ms": v for k, v in ms.items()}}
        rate = rates.get((shape, precision), {})
        row.update({f"{k}_tokens_per_s": v for k, v in rate.items()})
        if "episodes" in rate and "episodes-eager" in rate:
            row["episodes/episodes-eager"] = rate["episodes"] / rate["episodes-eager"]
        for num, den in (
            ("captured", "hf-static"),
            ("compiled", "hf-static"),
            ("captured", "eager"),
            ("compiled", "captured"),
            ("eager", "hf-static"),
            ("eager", "eager-nocast"),
        ):
            if num in ms and den in ms:
                row[f"{num}/{den}"] = ms[num] / ms[den]
        out.append(row)
    run.data["summary"] = out
    run.write()


def main(argv=None) -> None:
    """Runs the equality check and the decode measurements and writes --out."""
    args = parse_args(argv)
    import torch
    import transformers

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("decode.py needs a CUDA GPU here (or --device cpu --tiny for a dry run)")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    header = {
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "rows": args.prompts * args.group,
        "tokens": args.tokens,
        "prompt_len": args.prompt_len,
        "repeats": args.repeats,
    }
    print(json.dumps(header), flush=True)
    run = Run(args.out, header)
    sync = syncer(args.device)
    if not args.skip_equality:
        try:
            equality_check(args, run, sync)
        except Exception as e:  # noqa: BLE001 - recorded; the timings still run
            run.data["equality"] = {
                "error": f"{type(e).__name__}: {e}"[:2000],
                "traceback": traceback.format_exc()[-3000:],
            }
            run.write()
            print(f"equality: FAILED {e}", flush=True)
    shapes = [s for s in args.shapes.split(",") if s]
    engines = [e for e in args.engines.split(",") if e]
    for i, shape in enumerate(shapes):
        precisions = [p for p in args.precisions.split(",") if p] if i == 0 else ["bf16"]
        for precision in precisions:
            use = engines if i == 0 else [e for e in args.second_shape_engines.split(",") if e]
            run_shape(shape, precision, use, args, run, sync)
    for row in run.data["summary"]:
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
