"""Multi-turn episodes, side by side in one process: rollout tokens/s with the KV cache extended across turns
against re-encoding each turn, tool time hidden behind decoding, and the update's cost per masked-in token.

    python benchmarks/episodes/run.py --quick     # 0.5m model, L=256, ~4 min on 2 cores
    python benchmarks/episodes/run.py             # 0.5m model, L=256 and 512; update also on 14m; ~15 min
    python benchmarks/episodes/run.py --sections rollout --shapes 14m --lengths 256 --repeats 2   # ~13 min

Sections (benchmarks/episodes/README.md has the numbers and what each column means):

- `rollout`: `EpisodeGeneration(extend_cache=True)` against `extend_cache=False` (every continuing episode
  re-encoded from scratch at each turn) on the same model, prompts and seeds; all modes sample the same
  tokens (asserted). G = 8 rollouts of 8 GSM8K-shaped prompts (100-150 tokens), a text environment of this
  file that answers every turn with a 30-token observation and ends the episode after 4 turns. The models
  are cohort's tiny Qwen2 with the Hermes tool template (`build_tiny_model(tool_format="hermes")`), edited as
  benchmarks/bench_models.py does so that the end of a turn comes at a fixed rate (mean turn length about
  max_completion_length / 8): random models whose turns end at random, like the tests' `tool_model_dir`.
  Both run with the decoder's default cache, cohort's preallocated one (written in place); two more modes
  (`extend_dynamic`, `reencode_dynamic`) run with transformers' DynamicCache (`preallocate=False`, what
  fast.preallocated_kv=off gives), which copies the whole cache at every step.
- `overlap`: a tool that sleeps 50 ms (standing for a sandboxed execution). A random model never writes a
  tool call, so this section uses the real model's forward (its cost and its KV cache) with the logits
  replaced by a script by position (as tests/_scripted_lm.py): every episode calls the tool three times and
  then answers; the 8 groups' prompts and tool results differ in length so that their turns end 8 tokens
  apart. Three runs of the same tokens: tools at 0 s (decode only), tools started as soon as an episode's
  turn ends (cohort's loop, overlapped), and tools started only when the whole batch has stopped decoding
  (the loop's executor wrapped to defer them: the batch-synchronous baseline); "serial" is decode-only time
  plus the sum of the tools' seconds. The loop's waits for tool results are timed directly (the tool time
  not hidden), which a shared machine's noise on the decode time does not blur. A second row does the same
  with a text environment whose `step` sleeps 50 ms, on the sampled model of the rollout section.
- `update`: `PolicyUpdater.update` on three batches of the same prompts and G: episodes whose completions
  are half inserted (4 sampled turns, 3 inserted blocks; loss mask False there), single-turn completions of
  the same total length, and single-turn completions of the same number of policy tokens; seconds per
  masked-in (policy) token.

Each measurement is repeated (`--repeats`, after a small warm-up), the modes take turns going first, and the
tables give the median with the min-max spread; wall-clock and CPU seconds are both recorded. The share of the
machine's CPU that other processes used during each section is recorded (`others_cpu`): above 0.05 the
timings were contended. Writes results.json and results.md under --out.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `benchmarks` as a package

import torch  # noqa: E402

from benchmarks import bench_models, bench_tasks  # noqa: E402
from benchmarks.common import MODEL_SHAPES, busy_seconds, others_cpu_share, own_cpu_seconds  # noqa: E402
from cohort.config import AlgoConfig, EpisodeConfig  # noqa: E402
from cohort.episodes import multiturn as episode_loop  # noqa: E402
from cohort.episodes.environments import EnvStep, TextEnvironment  # noqa: E402
from cohort.episodes.multiturn import EpisodeGeneration, prompt_messages  # noqa: E402
from cohort.episodes.parsers import parser_for  # noqa: E402
from cohort.episodes.spec import build_episode_spec  # noqa: E402
from cohort.episodes.templates import render_prompt, render_tool_turn  # noqa: E402
from cohort.fastpath import FastConfig  # noqa: E402
from cohort.fastpath.memory import bound_heap  # noqa: E402
from cohort.models import build_tiny_model, cache_kwargs, load_model, load_tokenizer  # noqa: E402
from cohort.rollout import RolloutBatch, SamplingParams  # noqa: E402
from cohort.train.update import PolicyBatch, PolicyUpdater  # noqa: E402

SECTIONS = ("rollout", "overlap", "update")
MODES = ("extend", "reencode", "extend_dynamic", "reencode_dynamic")
"""Rollout modes: KV extension / re-encoding, with the decoder's preallocated KV cache (its default) or with
transformers' DynamicCache (`EpisodeGeneration(preallocate=False)`, what fast.preallocated_kv=off gives)."""
SHAPES: dict[str, dict[str, int]] = {
    # benchmarks/common.py's tiny Qwen2 shapes (cohort.models.TINY_SIZES), plus a smaller one for the smoke test
    "0.5m": MODEL_SHAPES["0.5m"],
    "14m": MODEL_SHAPES["14m"],
    "tiny": {"hidden_size": 32, "num_layers": 2, "num_heads": 4, "intermediate_size": 64},
}
TURNS = 4
"""Sampled turns per episode in the rollout section (the environment ends the episode after the 4th)."""
OBSERVATION_TOKENS = 30
"""Length of every observation the rollout section's environment answers (characters = tokens)."""
TOOL_CALLS = 3
"""Tool calls per episode in the overlap section (then a final answer turn)."""


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Returns the command-line options (--quick fills the ones left unset with its smaller values)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the 0.5m model, one length, 2 repeats (~3 min)")
    p.add_argument("--sections", default=",".join(SECTIONS), help="comma list of rollout, overlap, update")
    p.add_argument(
        "--shapes", default="0.5m", help=f"models of the rollout section, comma list of {sorted(SHAPES)}"
    )
    p.add_argument(
        "--lengths", default=None, help="max_completion_length values (default 256,512; quick 256)"
    )
    p.add_argument("--prompts", type=int, default=8, help="prompts per batch (default 8)")
    p.add_argument("--group", type=int, default=8, help="G rollouts per prompt (default 8)")
    p.add_argument(
        "--repeats", type=int, default=None, help="measured rounds after the warm-up (default 3; quick 2)"
    )
    p.add_argument(
        "--tool-seconds", type=float, default=0.05, help="how long the overlap section's tool sleeps"
    )
    p.add_argument("--overlap-shape", default="0.5m", help="model of the overlap section (default 0.5m)")
    p.add_argument(
        "--update-length",
        type=int,
        default=None,
        help="completion length of the update section (default 256; quick 128)",
    )
    p.add_argument(
        "--update-shapes", default=None, help="models of the update section (default 0.5m,14m; quick 0.5m)"
    )
    p.add_argument(
        "--overlap-repeats",
        type=int,
        default=None,
        help="measured rounds of the overlap section (default 2)",
    )
    p.add_argument(
        "--update-prompts", type=int, default=None, help="prompts of the update batches (default 4)"
    )
    p.add_argument(
        "--modes",
        default=None,
        help=f"rollout modes, comma list of {list(MODES)} including reencode (default all; quick the first three)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: on a machine other processes share, 2 threads on 2 cores wait for each "
        "other's preempted thread at every parallel region and time 5x slower, erratically)",
    )
    p.add_argument(
        "--idle-wait",
        type=float,
        default=0.0,
        help="before each section, wait up to this many seconds for other processes to use < 5%% of the CPU",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/bench-episodes", help="folder of results.json and results.md")
    p.add_argument(
        "--workdir", default="runs/bench-episodes/models", help="built models (reused between runs)"
    )
    a = p.parse_args(argv)
    a.sections = [s for s in a.sections.split(",") if s]
    unknown = sorted(set(a.sections) - set(SECTIONS))
    if unknown:
        p.error(f"unknown sections {unknown}; choose among {list(SECTIONS)}")
    a.shapes = a.shapes.split(",")
    a.update_shapes = (a.update_shapes or ("0.5m" if a.quick else "0.5m,14m")).split(",")
    unknown = sorted(set(a.shapes + a.update_shapes + [a.overlap_shape]) - set(SHAPES))
    if unknown:
        p.error(f"unknown shapes {unknown}; choose among {sorted(SHAPES)}")
    a.lengths = [int(x) for x in (a.lengths or ("256" if a.quick else "256,512")).split(",")]
    a.modes = (a.modes or ",".join(MODES[:3] if a.quick else MODES)).split(",")
    if set(a.modes) - set(MODES) or "reencode" not in a.modes:
        p.error(f"--modes takes a comma list of {list(MODES)} including reencode (the reference)")
    a.repeats = a.repeats if a.repeats is not None else (2 if a.quick else 3)
    a.overlap_repeats = a.overlap_repeats if a.overlap_repeats is not None else 2
    a.update_length = a.update_length or (128 if a.quick else 256)
    a.update_prompts = a.update_prompts or 4
    return a


# ------------------------------------------------------------------------------------------------ models
@torch.no_grad()
def build_episode_model(workdir: Path, shape: str, mean_turn: int, seed: int) -> dict[str, Any]:
    """Returns facts about a tiny Hermes-tool Qwen2 saved under workdir whose turns end (EOS = <|im_end|>) with
    probability 1 / mean_turn at every position, reused when a previous run built the same one.

    The EOS edit is benchmarks/bench_models.py's: residual dimension 0 made a constant that no layer writes to,
    and the LM head's EOS row reading it, so the EOS logit sits a calibrated offset above near-uniform others."""
    out = workdir / f"{shape}_turn{mean_turn}"
    spec = {"shape": SHAPES[shape], "mean_turn": mean_turn, "seed": seed, "tool_format": "hermes"}
    meta_path = out / "episode_model.json"
    if meta_path.exists() and json.loads(meta_path.read_text()).get("spec") == spec:
        return json.loads(meta_path.read_text())
    build_tiny_model(out, **SHAPES[shape], tool_format="hermes", max_position_embeddings=4096, seed=seed)
    tok = load_tokenizer(out)
    model = load_model(out).eval()
    calibration = [
        _render_text(tok, r["prompt"]) for r in bench_tasks.gsm8k_like_rows(8, seed=seed + 99)
    ]  # not the benchmark's own prompts
    vocab, eos, c = model.config.vocab_size, tok.eos_token_id, bench_models.RESIDUAL_CONST
    model.get_input_embeddings().weight[:, 0] = c
    head = model.get_output_embeddings().weight
    head[:, 0] = 0.0  # untied embeddings (build_tiny_model's default)
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight[0, :] = 0.0
        layer.mlp.down_proj.weight[0, :] = 0.0
    s, _ = bench_models._final_dim0(model, tok, calibration, vocab, seed)
    rate = 1.0 / mean_turn
    b = bench_models.eos_offset(rate, vocab)
    p_eos = 0.0
    # the other logits are not exactly equal: b is corrected twice against the measured probability
    for i in range(3):
        head[eos, 0] = b / s
        p_eos = bench_models._eos_prob(model, tok, calibration, eos, vocab, seed + 1)
        if i < 2:
            b += math.log(rate / p_eos)
    model.save_pretrained(out)
    meta = {
        "spec": spec,
        "path": str(out),
        "parameters": sum(p.numel() for p in model.parameters()),
        "vocab_size": vocab,
        "eos_prob": p_eos,
    }
    meta_path.write_text(json.dumps(meta, indent=2))
    return meta


def _render_text(tok: Any, prompt: str) -> str:
    """Returns the chat-rendered text of a one-message prompt (for calibration contexts)."""
    return tok.decode(render_prompt(tok, prompt_messages(prompt)))


def _load(meta: dict[str, Any]) -> tuple[torch.nn.Module, Any]:
    """Returns (model in eval mode, tokenizer) of a built model."""
    return load_model(meta["path"]).eval(), load_tokenizer(meta["path"])


# ------------------------------------------------------------------------------------------- environments
class FixedObservations(TextEnvironment):
    """Answers every turn with an observation of exactly `chars` characters (= tokens: the tiny tokenizer has
    one per character) and ends the episode after `turns` turns; `step_seconds` makes each step sleep first
    (an environment that takes time), the seconds slept are appended to `slept`."""

    def __init__(self, turns: int, chars: int, step_seconds: float = 0.0, slept: list[float] | None = None):
        self.turns, self.chars, self.step_seconds = turns, chars, step_seconds
        self.slept = slept if slept is not None else []
        self.turn = 0

    def reset(self, **row: Any) -> None:
        self.turn = 0
        return None

    def step(self, action: str) -> EnvStep:
        if self.step_seconds:
            t0 = time.perf_counter()
            time.sleep(self.step_seconds)
            self.slept.append(time.perf_counter() - t0)
        self.turn += 1
        if self.turn >= self.turns:
            return EnvStep("", 0.0, True)
        return EnvStep(f"observation {self.turn}: ".ljust(self.chars, ".")[: self.chars], 0.0, False)


class SandboxTools:
    """A TRL-style environment with one tool, `run_code`, that sleeps `seconds` (a sandboxed execution) and returns
    a result whose length the row sets (`pad`), so the groups' next turns start at different positions."""

    def __init__(self, seconds: float, slept: list[float]):
        self._seconds, self._slept, self._pad = seconds, slept, 0

    def reset(self, **row: Any) -> None:
        self._pad = int(row["pad"])
        return None

    def run_code(self, code: str) -> str:
        """Runs Python code in a sandbox and returns its output.

        Args:
            code: The Python source to run.
        """
        if self._seconds:
            t0 = time.perf_counter()
            time.sleep(self._seconds)
            self._slept.append(time.perf_counter() - t0)
        return "ok" + "." * self._pad


class ScriptedLogits(torch.nn.Module):
    """A real causal LM's forward (its cost, its KV cache) whose logits are replaced by a script by position:
    after the token at position p it predicts script[p + 1] (EOS where the script is silent), as
    tests/_scripted_lm.py's ScriptedLM does without a model behind it."""

    def __init__(self, inner: torch.nn.Module, script: dict[int, int], eos: int) -> None:
        super().__init__()
        self.inner, self.script, self.eos = inner, dict(script), eos
        self.config = inner.config

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.inner.get_input_embeddings()

    def forward(
        self, input_ids, attention_mask=None, position_ids=None, cache=None, use_cache=None, logits_to_keep=0
    ):
        out = self.inner(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            logits_to_keep=logits_to_keep,
            **cache_kwargs(self.inner, cache),
        )
        width = out.logits.shape[1]
        nxt = [[self.script.get(p + 1, self.eos) for p in row[-width:]] for row in position_ids.tolist()]
        logits = torch.full_like(out.logits, -30.0)
        logits.scatter_(-1, torch.tensor(nxt, device=logits.device)[..., None], 30.0)
        return SimpleNamespace(logits=logits)


class WaitingExecutor:
    """Wraps an EpisodeGeneration's ToolExecutor to time how long the loop waits for tool results (`waited`: the
    tool time the loop did not hide). `defer`: calls submitted during a turn start only when the loop first asks
    for a result (once no episode decodes any more), all together: the batch-synchronous baseline."""

    def __init__(self, inner: Any, *, defer: bool) -> None:
        self.inner, self.defer = inner, defer
        self.queue: list[tuple[_Waited, Any, Any]] = []
        self.waited = 0.0

    def submit(self, calls: Any, tools: Any) -> _Waited:
        future = _Waited(self)
        if self.defer:
            self.queue.append((future, calls, tools))
        else:
            future.real = self.inner.submit(calls, tools)
        return future

    def flush(self) -> None:
        for future, calls, tools in self.queue:
            future.real = self.inner.submit(calls, tools)
        self.queue.clear()

    def close(self) -> None:
        self.inner.close()


class _Waited:
    def __init__(self, owner: WaitingExecutor) -> None:
        self.owner, self.real = owner, None

    def result(self) -> Any:
        t0 = time.perf_counter()
        try:
            if self.real is None:
                self.owner.flush()
            return self.real.result()
        finally:
            self.owner.waited += time.perf_counter() - t0


@contextlib.contextmanager
def step_waits(clock: list[float]) -> Iterator[None]:
    """Yields with the episode loop's environment-step handles timing how long the loop waits for them (added to
    clock[0]); patched in for the run (cohort.episodes.multiturn._Pending.result)."""
    shipped = episode_loop._Pending.result

    def result(self: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return shipped(self)
        finally:
            clock[0] += time.perf_counter() - t0

    episode_loop._Pending.result = result
    try:
        yield
    finally:
        episode_loop._Pending.result = shipped


# ------------------------------------------------------------------------------------------------ helpers
class Contention:
    """Measures the share of the machine's CPU other processes used while it was open."""

    def __enter__(self) -> Contention:
        self.start = (busy_seconds(), own_cpu_seconds(), time.time())
        return self

    def __exit__(self, *exc: object) -> None:
        self.share = round(others_cpu_share(*self.start), 3)


def wait_idle(limit_s: float) -> float:
    """Returns the share of the CPU other processes use, after waiting up to limit_s seconds for it to be < 5 %."""
    t0 = time.time()
    while True:
        b0, w0 = busy_seconds(), time.time()
        time.sleep(5.0)
        load = (busy_seconds() - b0) / ((time.time() - w0) * (os.cpu_count() or 1))
        if load < 0.05 or time.time() - t0 > limit_s:
            return load


def spread(values: Sequence[float], digits: int = 3) -> dict[str, float]:
    """Returns the median, min and max of `values`, rounded."""
    return {
        "median": round(statistics.median(values), digits),
        "min": round(min(values), digits),
        "max": round(max(values), digits),
    }


def fmt(s: dict[str, float], digits: int = 0, suffix: str = "") -> str:
    """Returns 'median (min-max)' of a spread()."""
    f = f"{{:.{digits}f}}"
    return f"{f.format(s['median'])}{suffix} ({f.format(s['min'])}-{f.format(s['max'])})"


def episode_counts(batch: RolloutBatch) -> dict[str, int]:
    """Returns the sampled and inserted tokens, sampled turns and truncated episodes of a batch."""
    masks = batch.loss_masks or [torch.ones(len(c), dtype=torch.bool) for c in batch.completion_ids]
    sampled = sum(int(m.sum()) for m in masks)
    return {
        "sampled_tokens": sampled,
        "inserted_tokens": sum(len(m) for m in masks) - sampled,
        "turns": sum(
            sum(1 for m in r.messages if m.get("role") == "assistant") for r in batch.episodes or []
        ),
        "truncated": int(batch.truncated.sum()),
    }


def reencoded_tokens(batch: RolloutBatch) -> int:
    """Returns the tokens re-encoding each turn feeds again: for every turn after an insertion, the prompt and
    the episode so far (what extending the cache does not recompute)."""
    total = 0
    for g, prompt in enumerate(batch.prompt_ids):
        for i in range(g * batch.group_size, (g + 1) * batch.group_size):
            mask = batch.loss_masks[i].tolist() if batch.loss_masks is not None else []
            for t in range(1, len(mask)):
                if mask[t] and not mask[t - 1]:  # a sampled turn starts after an inserted block
                    total += len(prompt) + t
    return total


def same_tokens(a: RolloutBatch, b: RolloutBatch, what: str) -> None:
    """Raises AssertionError naming the first row where two batches' tokens or masks differ."""
    for i, (x, y) in enumerate(zip(a.completion_ids, b.completion_ids)):
        if x != y or (a.loss_masks is not None and not torch.equal(a.loss_masks[i], b.loss_masks[i])):
            first = next((j for j, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y)))
            raise AssertionError(
                f"{what}: rollout {i} differs from token {first} on ({len(x)} vs {len(y)} tokens)"
            )
    assert len(a.completion_ids) == len(b.completion_ids), what


# -------------------------------------------------------------------------------------------- 1. rollout
class ForwardProbe:
    """Counts, through a forward pre-hook on the model, what the decoder feeds it: decode steps (one token per
    slot) and the cache width each attends over (the attention mask's columns, holes included), and the token
    positions of the other forwards (prefills, re-encodings, inserted blocks; padding included)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.reset()
        model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def reset(self) -> dict[str, float]:
        """Returns the counts so far and starts new ones."""
        counts = dict(getattr(self, "counts", {}))
        self.counts = {"steps": 0, "step_width": 0, "step_rows": 0, "block_positions": 0}
        return counts

    def _hook(self, module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        ids, mask = kwargs.get("input_ids"), kwargs.get("attention_mask")
        if ids is None or mask is None:
            return
        if ids.shape[1] == 1:
            self.counts["steps"] += 1
            self.counts["step_width"] += mask.shape[1]
            self.counts["step_rows"] += ids.shape[0]
        else:
            self.counts["block_positions"] += ids.numel()


def timed_generate(
    loop: EpisodeGeneration, probe: ForwardProbe, *args: Any, **kwargs: Any
) -> tuple[RolloutBatch, float, float, dict[str, float]]:
    """Returns (batch, wall seconds, CPU seconds of this process, forward counts) of one loop.generate."""
    probe.reset()
    t0, c0 = time.perf_counter(), time.process_time()
    batch = loop.generate(*args, **kwargs)
    return batch, time.perf_counter() - t0, time.process_time() - c0, probe.reset()


def rollout_section(args: argparse.Namespace, workdir: Path, log: Callable[[str], None]) -> list[dict]:
    """Returns one result per (shape, max_completion_length): tokens/s of KV extension and of re-encoding."""
    rows = [{"prompt": r["prompt"]} for r in bench_tasks.gsm8k_like_rows(args.prompts, seed=args.seed + 7)]
    modes = args.modes
    results = []
    for shape in args.shapes:
        for length in args.lengths:
            meta = build_episode_model(workdir, shape, max(length // 8, 4), args.seed)
            model, tok = _load(meta)
            spec = build_episode_spec(
                EpisodeConfig(), environment_factory=lambda: FixedObservations(TURNS, OBSERVATION_TOKENS)
            )
            probe = ForwardProbe(model)
            loops = {
                mode: EpisodeGeneration(
                    spec,
                    model,
                    tok,
                    end_of_turn_ids=[tok.eos_token_id],
                    pad_token_id=tok.pad_token_id,
                    extend_cache=mode.startswith("extend"),
                    preallocate=not mode.endswith("_dynamic"),
                )
                for mode in modes
            }
            prompts = [render_prompt(tok, prompt_messages(r["prompt"])) for r in rows]
            params = SamplingParams(max_completion_length=length)
            small = SamplingParams(max_completion_length=64)
            for loop in loops.values():  # warm-up: a small batch through every path
                loop.generate(prompts[:1], 2, small, torch.Generator(), rows=rows[:1])
            rounds = []
            with Contention() as busy:
                for rnd in range(args.repeats):
                    wall, cpu, batches, fed = {}, {}, {}, {}
                    for mode in (
                        modes[rnd % len(modes) :] + modes[: rnd % len(modes)]
                    ):  # each round another first
                        gen = torch.Generator().manual_seed(args.seed * 1000 + rnd)
                        batches[mode], wall[mode], cpu[mode], fed[mode] = timed_generate(
                            loops[mode], probe, prompts, args.group, params, gen, rows=rows
                        )
                    for mode in modes[1:]:
                        same_tokens(
                            batches[modes[0]], batches[mode], f"{shape} L={length} round {rnd} {mode}"
                        )
                    counts = episode_counts(batches[modes[0]])
                    rounds.append(
                        {
                            **counts,
                            "reencoded_tokens": reencoded_tokens(batches[modes[0]]),
                            "seconds": {m: round(wall[m], 3) for m in modes},
                            "cpu_seconds": {m: round(cpu[m], 3) for m in modes},
                            "tokens_per_s": {m: counts["sampled_tokens"] / wall[m] for m in modes},
                            "decode_steps": fed[modes[0]]["steps"],
                            "mean_step_width": {
                                m: fed[m]["step_width"] / max(fed[m]["steps"], 1) for m in modes
                            },
                            "block_positions": {m: fed[m]["block_positions"] for m in modes},
                        }
                    )
                    log(
                        f"  rollout {shape} L={length} round {rnd}: "
                        + ", ".join(f"{m} {wall[m]:.2f} s" for m in modes)
                        + f"; {counts['sampled_tokens']} sampled + {counts['inserted_tokens']} inserted tokens, "
                        f"{counts['turns']} turns"
                    )
            for loop in loops.values():
                loop.close()
            keys = ("sampled_tokens", "inserted_tokens", "turns", "truncated", "reencoded_tokens")
            results.append(
                {
                    "shape": shape,
                    "parameters": meta["parameters"],
                    "max_completion_length": length,
                    "mean_turn_target": max(length // 8, 4),
                    "episodes": args.prompts * args.group,
                    "modes": modes,
                    "same_tokens": True,
                    "rounds": rounds,
                    "others_cpu": busy.share,
                    **{k: spread([float(r[k]) for r in rounds], 1) for k in keys},
                    "tokens_per_s": {m: spread([r["tokens_per_s"][m] for r in rounds], 1) for m in modes},
                    "seconds": {m: spread([r["seconds"][m] for r in rounds]) for m in modes},
                    "cpu_seconds": {m: spread([r["cpu_seconds"][m] for r in rounds]) for m in modes},
                    "decode_steps": spread([float(r["decode_steps"]) for r in rounds], 1),
                    "mean_step_width": {
                        m: spread([r["mean_step_width"][m] for r in rounds], 1) for m in modes
                    },
                    "block_positions": {
                        m: spread([float(r["block_positions"][m]) for r in rounds], 1) for m in modes
                    },
                    # each mode against re-encoding as shipped: wall-clock and CPU-time ratios, round by round
                    "speedup": {
                        m: spread([r["seconds"]["reencode"] / r["seconds"][m] for r in rounds])
                        for m in modes
                        if "reencode" in modes
                    },
                    "cpu_speedup": {
                        m: spread([r["cpu_seconds"]["reencode"] / r["cpu_seconds"][m] for r in rounds])
                        for m in modes
                        if "reencode" in modes
                    },
                }
            )
    return results


# -------------------------------------------------------------------------------------------- 2. overlap
FILLER, SPREAD, FIRST = "a", 8, 8
"""Overlap script: group g's turns are FIRST + SPREAD * g filler tokens, then the call (or, last, the answer)."""


def _tool_script(
    tok: Any, rows: list[dict], prompts: list[list[int]], schemas: list[dict]
) -> tuple[dict[int, int], list[int]]:
    """Returns (position -> token script, expected sampled tokens per group) of the overlap section's episodes:
    each group's turn k (k < TOOL_CALLS) is filler up to a common position then the same tool call, the last
    turn filler up to a common position then EOS; positions are computed from the rendered prompts and
    tool turns (the groups' prompts and results are longer by SPREAD tokens per group before them)."""
    call_text = '<tool_call>\n{"name": "run_code", "arguments": {"code": "print(6 * 7)"}}\n</tool_call>'
    call = tok(call_text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    parser = parser_for(tok, tools=schemas)
    filler = tok(FILLER, add_special_tokens=False)["input_ids"]
    assert len(filler) == 1
    n_groups = len(prompts)
    starts = [len(p) for p in prompts]
    script: dict[int, int] = {}
    history: list[list[dict]] = [prompt_messages(r["prompt"]) for r in rows]
    expected = [0] * n_groups
    for turn in range(TOOL_CALLS + 1):
        # the group whose turn starts last (group 0) samples FIRST filler tokens, the others reach the same point
        target = max(starts) + FIRST
        for p in range(min(starts), target):
            script[p] = filler[0]
        if turn == TOOL_CALLS:
            break  # the last turn: filler, then EOS where the script is silent
        for k, t in enumerate(call):
            script[target + k] = t
        for g in range(n_groups):
            sampled = filler * (target - starts[g]) + call
            expected[g] += len(sampled)
            message = parser.parse(tok.decode(sampled)).message()
            result = {"role": "tool", "name": "run_code", "content": "ok" + "." * rows[g]["pad"]}
            inserted = render_tool_turn(
                tok,
                [*history[g], message],
                [result],
                tools=schemas,
                end_of_turn=[tok.eos_token_id],
            )
            history[g] += [message, result]
            starts[g] = target + len(call) + len(inserted)
    for g in range(n_groups):
        expected[g] += target - starts[g] + 1  # the answer turn and its EOS
    return script, expected


def overlap_section(args: argparse.Namespace, workdir: Path, log: Callable[[str], None]) -> list[dict]:
    """Returns the overlap rows: scripted tool calls, and a text environment whose steps sleep."""
    return [_overlap_tools(args, workdir, log), _overlap_environment(args, workdir, log)]


def _overlap_tools(args: argparse.Namespace, workdir: Path, log: Callable[[str], None]) -> dict:
    meta = build_episode_model(workdir, args.overlap_shape, 32, args.seed)
    inner, tok = _load(meta)
    n_groups = args.prompts
    pads = [SPREAD * (n_groups - 1 - g) for g in range(n_groups)]
    rows = [{"prompt": "Run the job" + "." * pad, "pad": pad} for pad in pads]
    slept: list[float] = []
    specs = {
        seconds: build_episode_spec(
            EpisodeConfig(), environment_factory=lambda s=seconds: SandboxTools(s, slept)
        )
        for seconds in (0.0, args.tool_seconds)
    }
    schemas = specs[0.0].schemas(specs[0.0].environments[None])
    prompts = [render_prompt(tok, prompt_messages(r["prompt"]), tools=schemas) for r in rows]
    script, expected = _tool_script(tok, rows, prompts, schemas)
    model = ScriptedLogits(inner, script, tok.eos_token_id)
    length = max(expected) + 64 + max(len(p) for p in prompts)

    def loop(seconds: float) -> EpisodeGeneration:
        return EpisodeGeneration(
            specs[seconds], model, tok, end_of_turn_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id
        )

    loops = {
        "decode_only": loop(0.0),
        "overlapped": loop(args.tool_seconds),
        "after_decoding": loop(args.tool_seconds),
    }
    for name, lp in loops.items():
        lp.executor = WaitingExecutor(lp.executor, defer=name == "after_decoding")
    params = SamplingParams(max_completion_length=length, greedy=True)
    for lp in loops.values():
        lp.generate(prompts[:1], 1, params, None, rows=rows[:1])  # warm-up
    rounds = []
    with Contention() as busy:
        for rnd in range(args.overlap_repeats):
            runs, batches = {}, {}
            names = list(loops) if rnd % 2 == 0 else list(loops)[::-1]
            for name in names:
                slept.clear()
                executor = loops[name].executor
                executor.waited = 0.0
                t0 = time.perf_counter()
                batches[name] = loops[name].generate(prompts, args.group, params, None, rows=rows)
                runs[name] = (time.perf_counter() - t0, sum(slept), executor.waited)
            for name in ("overlapped", "after_decoding"):
                same_tokens(batches["decode_only"], batches[name], f"overlap {name} round {rnd}")
            for i, record in enumerate(batches["decode_only"].episodes):
                sampled = int(batches["decode_only"].loss_masks[i].sum())
                if record.calls != TOOL_CALLS or sampled != expected[i // args.group]:
                    raise AssertionError(
                        f"overlap: episode {i} made {record.calls} calls and sampled {sampled} tokens, where the "
                        f"script has {TOOL_CALLS} calls and {expected[i // args.group]} tokens (stop: {record.stop})"
                    )
            rounds.append(_overlap_round(runs, batches["decode_only"]))
            log(f"  overlap tools round {rnd}: " + _overlap_line(runs))
    for lp in loops.values():
        lp.close()
    return _overlap_result("tool calls (scripted logits, real forward)", args, meta, rounds, busy.share)


def _overlap_environment(args: argparse.Namespace, workdir: Path, log: Callable[[str], None]) -> dict:
    length = min(args.lengths)
    meta = build_episode_model(workdir, args.overlap_shape, max(length // 8, 4), args.seed)
    model, tok = _load(meta)
    rows = [{"prompt": r["prompt"]} for r in bench_tasks.gsm8k_like_rows(args.prompts, seed=args.seed + 7)]
    prompts = [render_prompt(tok, prompt_messages(r["prompt"])) for r in rows]
    slept: list[float] = []
    loops = {
        name: EpisodeGeneration(
            build_episode_spec(
                EpisodeConfig(),
                environment_factory=lambda s=seconds: FixedObservations(TURNS, OBSERVATION_TOKENS, s, slept),
            ),
            model,
            tok,
            end_of_turn_ids=[tok.eos_token_id],
            pad_token_id=tok.pad_token_id,
        )
        for name, seconds in (("decode_only", 0.0), ("overlapped", args.tool_seconds))
    }
    params = SamplingParams(max_completion_length=length)
    small = SamplingParams(max_completion_length=64)
    for lp in loops.values():
        lp.generate(prompts[:1], 2, small, torch.Generator(), rows=rows[:1])
    rounds = []
    with Contention() as busy:
        for rnd in range(args.overlap_repeats):
            runs, batches = {}, {}
            for name in list(loops) if rnd % 2 == 0 else list(loops)[::-1]:
                slept.clear()
                clock = [0.0]
                gen = torch.Generator().manual_seed(args.seed * 1000 + rnd)
                with step_waits(clock):
                    t0 = time.perf_counter()
                    batches[name] = loops[name].generate(prompts, args.group, params, gen, rows=rows)
                    runs[name] = (time.perf_counter() - t0, sum(slept), clock[0])
            same_tokens(batches["decode_only"], batches["overlapped"], f"overlap environment round {rnd}")
            rounds.append(_overlap_round(runs, batches["decode_only"]))
            log(f"  overlap environment round {rnd}: " + _overlap_line(runs))
    for lp in loops.values():
        lp.close()
    return _overlap_result(f"text environment steps (sampled, L={length})", args, meta, rounds, busy.share)


def _overlap_line(runs: dict[str, tuple[float, float, float]]) -> str:
    """Returns a log line of (wall, tool, waited) seconds per variant."""
    return ", ".join(f"{k} {w:.2f} s (tools {t:.2f} s, waited {x:.2f} s)" for k, (w, t, x) in runs.items())


def _overlap_round(runs: dict[str, tuple[float, float, float]], batch: RolloutBatch) -> dict:
    """Returns one round's record from {variant: (wall s, tool s slept, s the loop waited for tools)}."""
    decode = runs["decode_only"][0]
    tools = {k: t for k, (_, t, _) in runs.items() if k != "decode_only"}
    waited = {k: x for k, (_, _, x) in runs.items() if k != "decode_only"}
    return {
        "seconds": {k: round(w, 3) for k, (w, _, _) in runs.items()},
        "tool_seconds": {k: round(t, 3) for k, t in tools.items()},
        "waited_seconds": {k: round(x, 3) for k, x in waited.items()},
        "serial_seconds": round(decode + tools["overlapped"], 3),
        # the share of the tools' seconds the loop did not wait for (measured waits, robust to decode-time noise)
        "hidden_share": {k: 1 - waited[k] / tools[k] for k in tools},
        # the same from wall-clock differences against the decode-only run (noisy on a shared machine)
        "hidden_share_wall": {k: 1 - (runs[k][0] - decode) / tools[k] for k in tools},
        "calls": sum(r.calls for r in batch.episodes or []),
        **episode_counts(batch),
    }


def _overlap_result(what: str, args: argparse.Namespace, meta: dict, rounds: list[dict], busy: float) -> dict:
    names = list(rounds[0]["seconds"])
    return {
        "what": what,
        "shape": args.overlap_shape,
        "parameters": meta["parameters"],
        "episodes": args.prompts * args.group,
        "tool_call_seconds": args.tool_seconds,
        "rounds": rounds,
        "others_cpu": busy,
        "calls": rounds[0]["calls"],
        "sampled_tokens": spread([r["sampled_tokens"] for r in rounds], 1),
        "seconds": {k: spread([r["seconds"][k] for r in rounds]) for k in names},
        "serial_seconds": spread([r["serial_seconds"] for r in rounds]),
        **{
            key: {k: spread([r[key][k] for r in rounds]) for k in rounds[0][key]}
            for key in ("tool_seconds", "waited_seconds", "hidden_share", "hidden_share_wall")
        },
    }


# --------------------------------------------------------------------------------------------- 3. update
def _update_batch(
    prompts: list[list[int]], group: int, length: int, inserted: bool, vocab: int, seed: int
) -> PolicyBatch:
    """Returns a PolicyBatch of `group` random completions of `length` tokens per prompt, non-zero advantages;
    `inserted`: loss masks of 4 sampled turns of length / 8 and 3 inserted blocks sharing the other half."""
    g = torch.Generator().manual_seed(seed)
    n = len(prompts) * group
    completions = [torch.randint(3, vocab, (length,), generator=g).tolist() for _ in range(n)]
    masks = None
    if inserted:
        turn, blocks = length // 8, [(length - 4 * (length // 8) + k) // 3 for k in range(3)]
        pattern: list[bool] = []
        for k in range(4):
            pattern += [True] * turn + ([False] * blocks[k] if k < 3 else [])
        assert len(pattern) == length
        masks = [torch.tensor(pattern) for _ in range(n)]
    advantages = torch.randn(n, generator=g)
    advantages = advantages + advantages.sign() * 0.1  # no row with a zero advantage (it would be skipped)
    return PolicyBatch(
        prompt_ids=prompts,
        completion_ids=completions,
        group_size=group,
        advantages=advantages,
        in_loss=torch.ones(n, dtype=torch.bool),
        loss_masks=masks,
    )


def update_section(args: argparse.Namespace, workdir: Path, log: Callable[[str], None]) -> list[dict]:
    """Returns one result per shape: seconds per masked-in token of an update on episodes (half inserted)
    against single-turn batches of the same total length and of the same number of policy tokens."""
    length = args.update_length
    rows = bench_tasks.gsm8k_like_rows(args.update_prompts, seed=args.seed + 7)
    results = []
    for shape in args.update_shapes:
        meta = build_episode_model(workdir, shape, max(length // 8, 4), args.seed)
        model, tok = _load(meta)
        prompts = [render_prompt(tok, prompt_messages(r["prompt"])) for r in rows]
        vocab = model.config.vocab_size
        batches = {
            "episodes": _update_batch(prompts, args.group, length, True, vocab, args.seed),
            "single_same_length": _update_batch(prompts, args.group, length, False, vocab, args.seed),
            "single_same_policy_tokens": _update_batch(
                prompts, args.group, length // 2, False, vocab, args.seed
            ),
        }
        updater = PolicyUpdater(
            model,
            torch.optim.AdamW(model.parameters(), lr=1e-6),
            None,
            AlgoConfig(),
            temperature=1.0,
            max_completion_length=length,
            micro_batch_tokens=8192,  # cohort's default (train.micro_batch_tokens)
            max_grad_norm=1.0,
        )
        updater.update(_update_batch(prompts[:1], 2, 32, True, vocab, args.seed))  # warm-up
        rounds = []
        with Contention() as busy:
            for rnd in range(args.repeats):
                seconds = {}
                for name in list(batches) if rnd % 2 == 0 else list(batches)[::-1]:
                    t0 = time.perf_counter()
                    stats = updater.update(batches[name])
                    seconds[name] = time.perf_counter() - t0
                    assert stats.rows_computed_frac == 1.0, (name, stats.rows_computed_frac)
                rounds.append({"seconds": {k: round(v, 3) for k, v in seconds.items()}})
                log(
                    f"  update {shape} round {rnd}: "
                    + ", ".join(f"{k} {v:.2f} s" for k, v in seconds.items())
                )
        policy = {name: sum(b.loss_lengths) for name, b in batches.items()}
        per_token = {
            name: spread([1e3 * r["seconds"][name] / policy[name] for r in rounds], 4) for name in batches
        }  # ms per policy token
        results.append(
            {
                "shape": shape,
                "parameters": meta["parameters"],
                "completion_length": length,
                "rows": len(prompts) * args.group,
                "policy_tokens": policy,
                "rounds": rounds,
                "others_cpu": busy.share,
                "seconds": {k: spread([r["seconds"][k] for r in rounds]) for k in batches},
                "ms_per_policy_token": per_token,
                "ratio_vs_same_length": spread(
                    [
                        (r["seconds"]["episodes"] / policy["episodes"])
                        / (r["seconds"]["single_same_length"] / policy["single_same_length"])
                        for r in rounds
                    ]
                ),
                "ratio_vs_same_policy_tokens": spread(
                    [
                        (r["seconds"]["episodes"] / policy["episodes"])
                        / (r["seconds"]["single_same_policy_tokens"] / policy["single_same_policy_tokens"])
                        for r in rounds
                    ]
                ),
            }
        )
    return results


# ------------------------------------------------------------------------------------------------- report
def machine() -> dict[str, Any]:
    """Returns the CPU, core count and library versions."""
    import transformers

    cpu = platform.processor()
    try:
        cpu = next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    except (OSError, StopIteration):
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
    }


def markdown(results: dict[str, Any]) -> str:
    """Returns the results as Markdown tables."""
    lines = [f"`{results['command']}` — {results['machine']['cpu']}, {results['machine']['cores']} cores, torch "
             f"{results['machine']['torch']}, {results['machine']['threads']} threads, {results['seconds']:.0f} s; "
             "median (min-max) over the rounds"]  # fmt: skip
    if "rollout" in results:
        lines += [
            "",
            "### Rollout: KV-cache extension vs re-encoding each turn",
            "",
            "tok/s: sampled (policy) tokens per wall-clock second; speed-up: re-encoding's time over the mode's "
            "(both with the decoder's default preallocated KV cache), wall clock and CPU time of the process, "
            "round by round. `_dynamic`: with transformers' DynamicCache instead (`preallocate=False`).",
            "",
            "| model | L | episodes | sampled tok | inserted tok | turns | truncated | decode steps | mode | tok/s "
            "| wall s | CPU s | speed-up (wall) | speed-up (CPU) | cache width / step | block positions "
            "| others' CPU |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in results["rollout"]:
            for i, m in enumerate(r["modes"]):
                head = (
                    f"| {r['shape']} ({r['parameters'] / 1e6:.2f} M) | {r['max_completion_length']} | "
                    f"{r['episodes']} | {r['sampled_tokens']['median']:.0f} | {r['inserted_tokens']['median']:.0f} | "
                    f"{r['turns']['median']:.0f} | {r['truncated']['median']:.0f} | "
                    f"{r['decode_steps']['median']:.0f} "
                    if i == 0
                    else "| | | | | | | | "
                )
                lines.append(
                    f"{head}| {m} | {fmt(r['tokens_per_s'][m])} | {fmt(r['seconds'][m], 1)} | "
                    f"{fmt(r['cpu_seconds'][m], 1)} | {fmt(r['speedup'][m], 2, 'x')} | "
                    f"{fmt(r['cpu_speedup'][m], 2, 'x')} | {r['mean_step_width'][m]['median']:.0f} | "
                    f"{r['block_positions'][m]['median']:.0f} | {r['others_cpu']:.2f} |"
                )
    if "overlap" in results:
        lines += [
            "",
            "### Tool time hidden behind decoding",
            "",
            "| workload | model | episodes | calls | tool s (sum) | decode only s | overlapped s | after decoding s | "
            "serial s | waited s: overlapped | waited s: after decoding | hidden: overlapped | "
            "hidden: after decoding | others' CPU |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in results["overlap"]:
            after = "after_decoding" in r["seconds"]

            def pct(s: dict[str, float]) -> str:
                return fmt({k: 100 * v for k, v in s.items()}, 0, " %")

            lines.append(
                f"| {r['what']} | {r['shape']} | {r['episodes']} | {r['calls']} | "
                f"{fmt(r['tool_seconds']['overlapped'], 2)} | {fmt(r['seconds']['decode_only'], 2)} | "
                f"{fmt(r['seconds']['overlapped'], 2)} | "
                f"{fmt(r['seconds']['after_decoding'], 2) if after else '-'} | {fmt(r['serial_seconds'], 2)} | "
                f"{fmt(r['waited_seconds']['overlapped'], 2)} | "
                f"{fmt(r['waited_seconds']['after_decoding'], 2) if after else '-'} | "
                f"{pct(r['hidden_share']['overlapped'])} | "
                f"{pct(r['hidden_share']['after_decoding']) if after else '-'} | {r['others_cpu']:.2f} |"
            )
    if "update" in results:
        lines += [
            "",
            "### Update: cost per masked-in (policy) token",
            "",
            "| model | rows | batch | completion length | completion tok | policy tok | update s | ms / policy tok | "
            "episodes' cost per policy tok vs this | others' CPU |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in results["update"]:
            for name, label in (
                ("episodes", "episodes, half inserted"),
                ("single_same_length", "single-turn, same length"),
                ("single_same_policy_tokens", "single-turn, same policy tokens"),
            ):
                ratio = {
                    "episodes": "1",
                    "single_same_length": fmt(r["ratio_vs_same_length"], 2, "x"),
                    "single_same_policy_tokens": fmt(r["ratio_vs_same_policy_tokens"], 2, "x"),
                }[name]
                length = r["completion_length"] // (2 if name == "single_same_policy_tokens" else 1)
                lines.append(
                    f"| {r['shape']} ({r['parameters'] / 1e6:.2f} M) | {r['rows']} | {label} | {length} | "
                    f"{r['rows'] * length} | {r['policy_tokens'][name]} | {fmt(r['seconds'][name], 2)} | "
                    f"{fmt(r['ms_per_policy_token'][name], 3)} | {ratio} | {r['others_cpu']:.2f} |"
                )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Runs the sections, writes results.json and results.md under --out, prints the tables; returns the results."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    bound_heap(FastConfig().heap_mmap_threshold_mib)  # as the trainer does (fast.heap_mmap_threshold_mib)
    out, workdir = Path(args.out), Path(args.workdir)
    out.mkdir(parents=True, exist_ok=True)
    workdir.mkdir(parents=True, exist_ok=True)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    t0 = time.perf_counter()

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - t0:6.1f} s] {message}", flush=True)

    command = "python benchmarks/episodes/run.py" + ("".join(f" {a}" for a in argv) if argv is not None else
                                                     "".join(f" {a}" for a in sys.argv[1:]))  # fmt: skip
    results: dict[str, Any] = {"command": command, "machine": machine(), "args": vars(args)}
    sections = {"rollout": rollout_section, "overlap": overlap_section, "update": update_section}
    for name in args.sections:
        if args.idle_wait > 0:
            log(f"waiting for an idle machine (others use {wait_idle(args.idle_wait):.2f} of the CPU)")
        log(f"section {name}")
        results[name] = sections[name](args, workdir, log)
    results["seconds"] = round(time.perf_counter() - t0, 1)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    table = markdown(results)
    (out / "results.md").write_text(table)
    print(table)
    return results


if __name__ == "__main__":
    main()
