"""The built-in sampler: batched KV-cache decoding that prefills each prompt once.

Compared with `model.generate(num_return_sequences=G)`, which prefills every prompt G times, this
engine prefills the B unique prompts once; its G samples then decode against that one copy of the
prompt's keys and values (shared-prefix attention, `cohort.fastpath.attention`), each sample caching only its
own tokens, or, for models where that is unavailable, against G repeated copies. It stops as soon as
every row has ended and drops ended rows from the batch once a sizeable fraction of it has ended, so
no compute is spent decoding rows that already emitted EOS. The cache is written in place into buffers
sized for the tokens to come (`cohort.fastpath.kv_cache`), so no decode step copies the cache. On a CPU, a rollout
that runs past a few steps switches its large float32 weights to oneDNN's packed layout
(`cohort.fastpath.packed_linear`). Each of these follows its switch in `fast` (`cohort.fastpath.FastConfig`),
and the returned batch says which ones ran (`RolloutBatch.paths`).
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Callable

import torch
from transformers import DynamicCache

from cohort.errors import first_line
from cohort.fastpath import FastConfig, probes
from cohort.fastpath.attention import PrefixPlan, plan_attention, plan_carrier
from cohort.fastpath.kv_cache import preallocated_cache
from cohort.fastpath.packed_linear import packed_linears, packing_plan
from cohort.fastpath.switches import FastPathError, choose, say_once
from cohort.models import (
    attention_shape,
    cache_kwargs,
    forward_accepts,
    full_attention_span,
    text_config,
)
from cohort.rollout.base import RolloutEngine, Sampled, SamplingParams, left_pad, prefill
from cohort.rollout.casts import cast_once
from cohort.rollout.graph import DECODE_STEP, CaptureError, static_decode
from cohort.rollout.sampling import check_finite_logprobs, sample_next, sample_next_topk
from cohort.runtime.sharding import fsdp_managed

_GRAPH_FAILED: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
"""Models whose decode step failed to capture in a rollout under fast.graph_decode=auto (said once; eager since)."""


def capture_failed(model: torch.nn.Module, setting: str, error: Exception, what: str) -> None:
    """Returns None after turning the captured step off for `model` in this process, said once, when `what` (the
    decode step, a turn's) failed to capture under fast.graph_decode=auto; raises FastPathError under `on`."""
    if setting == "on":
        raise FastPathError(
            f"fast.graph_decode=on, but capturing {what} failed ({first_line(error)}); set fast.graph_decode=auto "
            "or off"
        ) from error
    _GRAPH_FAILED.add(model)
    say_once(model, "graph_decode", f"fast path 'graph_decode' off: capture failed ({first_line(error)})")


def graph_decode_unavailable(
    model: torch.nn.Module | None, device: torch.device, logprobs_topk: int = 0
) -> str | None:
    """Returns why the captured decode step cannot run for `model` on `device` from what is known without running
    it (None: nothing rules it out); the config checks the same before the model loads."""
    if logprobs_topk > 0:
        # The captured step writes each token's log-prob only; top-K rollouts decode eagerly.
        return f"top-K log-probs are asked for (logprobs_topk={logprobs_topk}), which the captured step does not return"
    if device.type != "cuda":
        return f"it decodes on {device.type}, and CUDA graphs need a CUDA GPU"
    if model is not None and fsdp_managed(model):
        return (
            "its weights are sharded (distributed.strategy=fsdp): every forward gathers them with collectives"
        )
    impl = getattr(text_config(model), "_attn_implementation", None) if model is not None else None
    if impl not in (None, "sdpa"):
        return f"attention implementation {impl!r} (the captured step replaces sdpa's attention only)"
    return None


class BuiltinEngine(RolloutEngine):
    """KV-cache sampler: one prefill per unique prompt, shared by its G samples; ended rows are dropped."""

    name = "builtin"
    streams_finished = True
    returns_topk = True

    def __init__(self, *, eos_token_ids, pad_token_id: int, fast: FastConfig | None = None) -> None:
        super().__init__(eos_token_ids=eos_token_ids, pad_token_id=pad_token_id)
        if fast is not None and not isinstance(fast, FastConfig):
            raise TypeError(f"fast must be a cohort.fastpath.FastConfig, got {type(fast).__name__}")
        self.fast = (FastConfig() if fast is None else fast).validate()

    def sample(
        self,
        model: torch.nn.Module,
        prompt_ids: list[list[int]],
        group_size: int,
        params: SamplingParams,
        generator: torch.Generator | None,
        device: torch.device,
        *,
        on_finished: Callable[[int, list[int]], None] | None = None,
    ) -> Sampled:
        """Returns group_size sampled completions per prompt as Sampled rows, with the fast paths taken
        (on_finished: called with each completion that ends with EOS, at the step it ends)."""
        if generator is not None and generator.device.type != device.type:
            raise ValueError(
                f"generator is on {generator.device} but the model is on {device}; create it with "
                f"torch.Generator(device={str(device)!r})"
            )
        paths: dict[str, bool] = {}
        top: dict[str, torch.Tensor] = {}
        tokens, lengths, ended, logps = self._decode(
            model,
            prompt_ids,
            group_size,
            params,
            generator,
            device,
            paths=paths,
            on_finished=on_finished,
            top=top,
        )
        return Sampled(
            tokens=tokens,
            lengths=lengths,
            truncated=~ended,
            logprobs=logps,
            paths=paths,
            topk_ids=top.get("ids"),
            topk_logprobs=top.get("logprobs"),
        )

    def _decode(
        self,
        model,
        prompt_ids,
        group_size,
        params,
        generator,
        device,
        shared=None,
        paths=None,
        on_finished=None,
        top=None,
    ):
        """Returns (tokens [N, T], lengths [N], ended-with-EOS [N] bool, log-probs [N, T]) on `device`.

        shared: decode against one copy of each prompt's cache (None: as the switches decide). paths, when
        given, receives which fast paths ran (shared_prefix, preallocated_kv, packed_weights); on_finished: as in
        `sample`; top, when given and params.logprobs_topk = K > 0, receives each token's top-K ("ids" [N, T, K]
        long, "logprobs" [N, T, K] float32).
        """
        f = self.fast
        G, T = group_size, params.max_completion_length
        N = len(prompt_ids) * G
        input_ids, attn = left_pad(prompt_ids, self.pad_token_id, device)  # [B, P]
        P = input_ids.shape[1]
        if shared is None:
            shared = G > 1 and choose(
                f.shared_prefix,
                "shared_prefix",
                model,
                worth=_copies_avoided(model, len(prompt_ids), G, P) >= f.shared_prefix_min_elements,
                unavailable=lambda: self._sharing_unavailable(model, device, P + T),
            )
        K = params.logprobs_topk
        graph = self.takes_captured_step(model, device, P + T, T, K)
        if not graph and f.compile_decode == "on":  # graph_decode is auto here: on refuses, off is refused
            reason = (
                "capturing it failed earlier in this process"
                if model in _GRAPH_FAILED
                else self._graph_unavailable(model, device, P + T, K)
            )
            raise FastPathError(
                "fast.compile_decode=on compiles the captured decode step, which this rollout cannot take "
                f"({reason}); set fast.compile_decode=auto or off"
            )
        if graph:
            compiled = self.compiles_captured_step(model, device)
            try:
                tokens, lengths, ended, logps = static_decode(
                    model,
                    prompt_ids,
                    G,
                    params,
                    generator,
                    device,
                    eos_token_ids=list(self.eos_token_ids),
                    pad_token_id=self.pad_token_id,
                    shared=bool(shared),
                    capture=True,
                    check_every=f.graph_decode_check_every,
                    on_finished=on_finished,
                    compiled=compiled,
                )
            except CaptureError as e:  # only the capture: an error of the replays or of on_finished is raised
                capture_failed(model, f.graph_decode, e, "the decode step")
            else:
                check_finite_logprobs(logps)
                if paths is not None:
                    paths.update(
                        shared_prefix=bool(shared),
                        preallocated_kv=True,
                        packed_weights=False,
                        graph_decode=True,
                        compile_decode=compiled and DECODE_STEP.failed(model) is None,
                        cast_once=False,  # the eager paths' switch: the captured step always casts once
                    )
                return tokens, lengths, ended, logps
        prealloc = choose(f.preallocated_kv, "preallocated_kv", model)
        pack = packing_plan(f, model, device, T)  # (the step it packs at, the smallest weight packed) or None
        config = getattr(model, "config", None)

        def new_cache(capacity: int):
            if prealloc:
                return preallocated_cache(config, capacity)
            return DynamicCache(config=config) if config is not None else DynamicCache()

        taken: dict[str, bool] = {}
        with contextlib.ExitStack() as scope:
            # the eager steps read Linear weights cast once (fast.cast_once), until packed ones replace them
            forward = scope.enter_context(cast_once(model, device, f, taken))
            cache = new_cache(P if shared else P + T)
            logits = prefill(model, input_ids, attn, cache, forward)  # [B, V]
            if G > 1:
                logits = logits.repeat_interleave(G, dim=0)  # [N, V]
            if shared:
                # The G samples of a prompt read its prefill from one copy; each sample caches only its own tokens.
                plan = PrefixPlan([(layer.keys, layer.values) for layer in cache.layers], attn, G)
                cache = new_cache(T)
                step_mask = plan_carrier(device, plan)
            elif G > 1:
                # The G samples of a prompt share its prefill: repeat cache rows instead of recomputing them.
                cache.batch_repeat_interleave(G)
            mask = torch.ones(N, P + T, dtype=torch.long, device=device)  # [N, P+T]
            mask[:, :P] = attn.repeat_interleave(G, dim=0)
            pos = attn.sum(-1).repeat_interleave(G)  # [n] position of the next token
            rows = torch.arange(N, device=device)  # [n] live batch slot -> row id
            eos = torch.tensor(self.eos_token_ids, dtype=torch.long, device=device)

            tokens = torch.full((N, T), self.pad_token_id, dtype=torch.long, device=device)  # [N, T]
            logps = torch.zeros(N, T, dtype=torch.float32, device=device)  # [N, T]
            if K > 0:
                top_ids = torch.zeros(N, T, K, dtype=torch.long, device=device)  # [N, T, K]
                top_lps = torch.zeros(N, T, K, dtype=torch.float32, device=device)  # [N, T, K]
            lengths = torch.full((N,), T, dtype=torch.long, device=device)  # [N]
            ended = torch.zeros(N, dtype=torch.bool, device=device)  # [N]
            done = torch.zeros(N, dtype=torch.bool, device=device)  # [n] live rows that already ended
            packed = 0

            if shared:
                scope.enter_context(plan_attention(model))
            for t in range(T):
                if K > 0:
                    tok, lp, k_ids, k_lps = sample_next_topk(
                        logits, params, K, generator
                    )  # [n] x2, [n, K] x2
                    top_ids[rows, t] = k_ids
                    top_lps[rows, t] = k_lps
                else:
                    tok, lp = sample_next(logits, params, generator)  # [n], [n]
                tokens[rows, t] = tok
                logps[rows, t] = lp
                hit = torch.isin(tok, eos) & ~done  # [n]
                lengths[rows] = torch.where(hit, t + 1, lengths[rows])
                ended[rows] = ended[rows] | hit
                done = done | hit
                if on_finished is not None:  # one more host sync a step, only when a caller listens
                    for row in rows[hit].tolist():
                        on_finished(row, tokens[row, : t + 1].tolist())
                if t == T - 1:
                    break
                n_live, n_done = done.numel(), int(done.sum())  # the step's only host sync
                if n_done == n_live:
                    break
                if n_done >= max(1, math.ceil(f.drop_ended_fraction * n_live)):
                    keep = (~done).nonzero().squeeze(1)  # [n']
                    cache.batch_select_indices(keep)
                    rows, mask, pos, tok, done = rows[keep], mask[keep], pos[keep], tok[keep], done[keep]
                    if shared:
                        plan.select(rows)
                if pack is not None and t == pack[0]:
                    packed = scope.enter_context(packed_linears(model, n_live - n_done, pack[1]))
                out = (model if packed else forward)(
                    input_ids=tok[:, None],
                    attention_mask=step_mask if shared else mask[:, : P + t + 1],
                    position_ids=pos[:, None],
                    **cache_kwargs(model, cache),
                )
                logits = out.logits[:, -1, :]  # [n, V]
                pos = pos + 1
        # One host sync per rollout: on an accelerator sample_next draws from non-finite logits without
        # refusing (a CUDA kernel's refusal would end the process's CUDA context) and flags them here.
        check_finite_logprobs(logps)
        if paths is not None:
            paths.update(
                shared_prefix=bool(shared),
                preallocated_kv=prealloc,
                packed_weights=packed > 0,
                graph_decode=False,
                compile_decode=False,
                cast_once=taken.get("cast_once", False),
            )
        if K > 0 and top is not None:
            top.update(ids=top_ids, logprobs=top_lps)
        return tokens, lengths, ended, logps

    def takes_captured_step(
        self,
        model: torch.nn.Module,
        device: torch.device,
        span_needed: int,
        new_tokens: int,
        logprobs_topk: int = 0,
    ) -> bool:
        """Returns whether a rollout of `new_tokens` new tokens reading `span_needed` positions decodes with the
        captured step (fast.graph_decode; multi-turn episodes ask it too)."""
        f = self.fast
        if f.graph_decode == "auto" and model in _GRAPH_FAILED:
            return False
        return choose(
            f.graph_decode,
            "graph_decode",
            model,
            # compile_decode=on asks for the captured step whatever its length threshold says
            worth=device.type == "cuda"
            and (new_tokens >= f.graph_decode_min_tokens or f.compile_decode == "on"),
            unavailable=lambda: self._graph_unavailable(model, device, span_needed, logprobs_topk),
        )

    def _graph_unavailable(
        self, model: torch.nn.Module, device: torch.device, span_needed: int, logprobs_topk: int = 0
    ) -> str | None:
        """Returns why the captured decode step cannot sample this model (None: it can).

        Static reasons first (the device, a sharded model, the attention implementation, sliding windows), then
        a check once per model: two prompts of different lengths decoded greedily by the captured step must
        reproduce the eager decoding; a capture that fails (a forward that syncs with the host, for one) fails it.
        """
        reason = graph_decode_unavailable(model, device, logprobs_topk)
        reason = reason or _window_unavailable(model, span_needed)
        if reason is not None:
            return reason
        return self._probe_static_step(
            model, device, "graph_decode", "the captured decode step", capture=True
        )

    def compiles_captured_step(self, model: torch.nn.Module, device: torch.device) -> bool:
        """Returns whether this rollout's static step runs through torch.compile (fast.compile_decode)."""
        return choose(
            self.fast.compile_decode,
            "compile_decode",
            model,
            worth=device.type == "cuda",
            unavailable=lambda: self._compile_unavailable(model, device),
        )

    def _compile_unavailable(self, model: torch.nn.Module, device: torch.device) -> str | None:
        """Returns why the compiled decode step cannot sample this model (None: it can): compiling it failed in
        this process, or (checked once per model) its greedy decoding of two prompts of different lengths, captured
        on CUDA, strays from the eager decoding by more than the precision's rounding."""
        return DECODE_STEP.unavailable(
            model,
            lambda: self._probe_static_step(
                model,
                device,
                "compile_decode",
                "the compiled decode step",
                capture=device.type == "cuda",
                compiled=True,
            ),
        )

    def _probe_static_step(
        self,
        model: torch.nn.Module,
        device: torch.device,
        name: str,
        what: str,
        *,
        capture: bool,
        compiled: bool = False,
    ) -> str | None:
        """Returns None when the static step (captured, compiled as asked) decodes two prompts of different lengths
        greedily as the eager engine does (check `name`, once per model), else why not (`what` names the step)."""
        vocab, prompts = _probe_prompts(model)
        params = SamplingParams(max_completion_length=6, greedy=True)
        eager = self._probe_engine(vocab)

        def fast():
            return static_decode(
                model, prompts, 2, params, None, device, eos_token_ids=[vocab], pad_token_id=self.pad_token_id,
                shared=True, check_every=2, capture=capture, compiled=compiled,
            )  # fmt: skip

        def plain():
            return eager._decode(model, prompts, 2, params, None, device, shared=False)

        if probes.probe(model, name, fast, plain, agree=_decodes_like_forward(model, prompts, 2)):
            return None
        return probes.failure(model, name, f"{what} does not reproduce the eager decoding")

    def _probe_engine(self, vocab: int) -> BuiltinEngine:
        """Returns the plain engine a probe compares with: this one's switches, without packing, the static step or
        weights cast once (probes run without autocast), and an EOS id outside the vocabulary (never sampled: every
        step is decoded)."""
        return BuiltinEngine(
            eos_token_ids=[vocab],
            pad_token_id=self.pad_token_id,
            fast=self.fast.replace(
                packed_weights="off", graph_decode="off", compile_decode="off", cast_once="off"
            ),
        )

    def _sharing_unavailable(
        self, model: torch.nn.Module, device: torch.device, span_needed: int
    ) -> str | None:
        """Returns why shared-prefix decoding cannot sample this model (None: it can).

        Checked once per model with a few greedy steps on two prompts of different lengths (left padding):
        tokens and log-probs must match the repeated-cache decoding. Chunked or linear-attention layers,
        attention implementations other than sdpa / eager, and models whose forward does not hand a
        pre-built 4-D mask to its layers unchanged fail; sliding-window models share only rollouts that fit
        in the window.
        """
        impl = getattr(text_config(model), "_attn_implementation", None)
        if impl not in ("sdpa", "eager"):
            return f"attention implementation {impl!r} (shared-prefix attention replaces 'sdpa' or 'eager')"
        reason = _window_unavailable(model, span_needed)
        if reason is not None:
            return reason
        vocab, prompts = _probe_prompts(model)
        params = SamplingParams(max_completion_length=4, greedy=True)
        probe = self._probe_engine(vocab)

        def run(shared: bool):
            return lambda: probe._decode(model, prompts, 2, params, None, device, shared=shared)

        agree = _decodes_like_forward(model, prompts, 2)
        if not probes.probe(model, "shared_prefix", run(True), run(False), agree=agree):
            return probes.failure(
                model, "shared_prefix", "shared-prefix decoding does not reproduce its tokens and log-probs"
            )
        return None


def _window_unavailable(model: torch.nn.Module, span_needed: int) -> str | None:
    """Returns why decoding against a whole cached prompt cannot serve this model's attention layers for
    `span_needed` positions (None: it can)."""
    span = full_attention_span(model)
    if span == 0:
        return "its chunked or linear attention layers see no full prompt"
    if span is not None and span_needed > span:
        return f"prompt + completion ({span_needed} tokens) exceed its sliding attention window ({span})"
    return None


def _probe_prompts(model: torch.nn.Module) -> tuple[int, list[list[int]]]:
    """Returns (the vocabulary size, two prompts of different lengths within it) for a once-per-model probe."""
    # A transformers model's method, which nn.Module's __getattr__ types as Tensor | Module:
    vocab = int(model.get_input_embeddings().weight.shape[0])  # type: ignore[operator]
    return vocab, [[i % vocab for i in (2, 3, 4, 5)], [i % vocab for i in (6, 7)]]


def _forward_reference(
    model: torch.nn.Module, prompt_ids: list[list[int]], group_size: int, tokens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, float, torch.dtype]:
    """Returns (the log-prob of each decoded token [N, T], the best log-prob at each of those positions [N, T],
    the logits' largest magnitude, their dtype) from a plain forward over each row's prompt and decoded tokens
    (teacher forcing): the reference a decoding's recorded log-probs are judged against."""
    N, T = tokens.shape
    chosen = torch.empty(N, T, dtype=torch.float32)
    best = torch.empty(N, T, dtype=torch.float32)
    largest, dtype = 0.0, torch.float32
    keep = {"logits_to_keep": T + 1} if forward_accepts(model, "logits_to_keep") else {}
    for r in range(
        N
    ):  # one row at a time: no [N, T, V] logits held (a 152k vocabulary makes them tens of MB)
        prompt = torch.tensor(prompt_ids[r // group_size], dtype=torch.long, device=tokens.device)
        with torch.no_grad():
            logits = model(input_ids=torch.cat([prompt, tokens[r]])[None], **keep).logits[0, -(T + 1) : -1]
        wide = logits.float()  # [T, V]
        norm = torch.logsumexp(wide, dim=-1)  # [T]
        chosen[r] = (wide.gather(-1, tokens[r, :, None]).squeeze(-1) - norm).cpu()
        best[r] = (wide.amax(-1) - norm).cpu()
        largest, dtype = max(largest, float(logits.abs().max())), logits.dtype
    return chosen, best, largest, dtype


def _forward_gaps(model, prompt_ids, group_size, decoded) -> tuple[float, float, float]:
    """Returns (the largest |log-prob - reference|, the largest reference log-prob below the best token's, the
    logits' rounding allowance: their dtype's eps times their largest magnitude) over a greedy decoding's
    tokens; infinite gaps when a row ended or holds a token outside the vocabulary."""
    tokens, lengths, ended, logps = decoded
    vocab = int(model.get_input_embeddings().weight.shape[0])
    inside = bool(((0 <= tokens) & (tokens < vocab)).all())
    if bool(ended.any()) or bool((lengths != tokens.shape[1]).any()) or not inside:
        return math.inf, math.inf, 0.0
    chosen, best, largest, dtype = _forward_reference(model, prompt_ids, group_size, tokens)
    rounding = torch.finfo(dtype).eps * largest
    return float((logps.float().cpu() - chosen).abs().max()), float((best - chosen).max()), rounding


def _decodes_like_forward(
    model: torch.nn.Module, prompt_ids: list[list[int]], group_size: int
) -> Callable[[tuple, tuple, float], bool]:
    """Returns agree(fast, plain, tol) for probes.probe: whether a fast greedy decoding is as true to the model
    as the plain one, each judged against a plain forward over its own tokens (teacher forcing).

    Two greedy decodings cannot be compared token by token at half precision: rounding flips near-ties (a
    randomly initialised model's logits are all near-ties), after which the rows decode different text. Each
    decoding's recorded log-probs are instead compared with what one plain forward over the same prompt and
    tokens gives, and each chosen token must be within rounding of that forward's best. The allowance is the
    precision's tolerance (or twice the plain decoding's own gap, where rounding alone makes that larger) plus
    what rounding the logits to their dtype can move a log-prob by (real bf16 models' logits reach tens, where
    one bf16 step is 0.125); a wrong cache position, mask or weight moves a trained model's log-probs by more."""

    def agree(fast: tuple, plain: tuple, tol: float) -> bool:
        gap_fast, pick_fast, rounding = _forward_gaps(model, prompt_ids, group_size, fast)
        gap_plain, pick_plain, _ = _forward_gaps(model, prompt_ids, group_size, plain)
        bound = max(tol, 2 * gap_plain) + rounding
        return gap_fast <= bound and pick_fast <= max(2 * bound, 2 * pick_plain)

    return agree


def _copies_avoided(model: torch.nn.Module, n_prompts: int, group_size: int, prompt_width: int) -> int:
    """Returns the cache elements per layer that G repeated prompt copies would add beyond one (0 if unknown)."""
    shape = attention_shape(model)
    if shape is None:
        return 0
    _, kv_heads, head_dim = shape
    return n_prompts * (group_size - 1) * prompt_width * kv_heads * head_dim
