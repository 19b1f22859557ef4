"""The built-in sampler: batched KV-cache decoding that prefills each prompt once.

Compared with `model.generate(num_return_sequences=G)`, which prefills every prompt G times, this
engine prefills the B unique prompts once; its G samples then decode against that one copy of the
prompt's keys and values (shared-prefix attention, `cohort.attention`), each sample caching only its
own tokens, or, for models where that is unavailable, against G repeated copies. It stops as soon as
every row has ended and drops ended rows from the batch once a sizeable fraction of it has ended, so
no compute is spent decoding rows that already emitted EOS. The cache is written in place into buffers
sized for the tokens to come (`kv_cache.py`), so no decode step copies the cache. On a CPU, a rollout
that runs past a few steps switches its large float32 weights to oneDNN's packed layout
(`packed_linear.py`).
"""

from __future__ import annotations

import contextlib
import inspect
import math
import warnings
import weakref

import torch

from cohort.attention import PrefixPlan, custom_attention, plan_masks
from cohort.models import (
    attention_shape,
    check_tolerance,
    eval_mode,
    full_attention_span,
    input_device,
    text_config,
)
from cohort.rollout.base import (
    RolloutBatch,
    RolloutEngine,
    SamplingParams,
    left_pad,
    validate_request,
)
from cohort.rollout.kv_cache import preallocated_cache
from cohort.rollout.packed_linear import packed_linears
from cohort.rollout.sampling import sample_next


class BuiltinEngine(RolloutEngine):
    """KV-cache sampler: one prefill per unique prompt, shared by its G samples; ended rows are dropped."""

    name = "builtin"

    def __init__(
        self, *, eos_token_ids, pad_token_id: int, compact_fraction: float = 0.25, packed_weights: bool = True
    ) -> None:
        super().__init__(eos_token_ids=eos_token_ids, pad_token_id=pad_token_id)
        if not 0.0 < compact_fraction <= 1.0:
            raise ValueError(
                f"compact_fraction must be in (0, 1], got {compact_fraction}; it is the fraction of ended "
                "rows in the batch that triggers dropping them (0.25 is a good default)"
            )
        self.compact_fraction = compact_fraction
        self.packed_weights = packed_weights

    def generate(
        self,
        model: torch.nn.Module,
        prompt_ids: list[list[int]],
        group_size: int,
        params: SamplingParams,
        generator: torch.Generator | None = None,
    ) -> RolloutBatch:
        """Returns a RolloutBatch with group_size sampled completions per prompt and their sampling log-probs."""
        validate_request(prompt_ids, group_size, params)
        device = input_device(model)
        if generator is not None and generator.device.type != device.type:
            raise ValueError(
                f"generator is on {generator.device} but the model is on {device}; create it with "
                f"torch.Generator(device={str(device)!r})"
            )
        with torch.inference_mode(), eval_mode(model):
            tokens, lengths, ended, logps = self._decode(
                model, prompt_ids, group_size, params, generator, device
            )
        tokens_l, lengths_l = tokens.tolist(), lengths.tolist()
        completions = [row[:n] for row, n in zip(tokens_l, lengths_l)]
        logps = logps.cpu()
        return RolloutBatch(
            prompt_ids=[list(p) for p in prompt_ids],
            completion_ids=completions,
            truncated=~ended.cpu(),
            group_size=group_size,
            sampling_logprobs=[logps[i, :n].clone() for i, n in enumerate(lengths_l)],
        )

    def _decode(self, model, prompt_ids, group_size, params, generator, device, shared=None):
        """Returns (tokens [N, T], lengths [N], ended-with-EOS [N] bool, log-probs [N, T]) on `device`.

        shared: decode against one copy of each prompt's cache (None: when G > 1 and the model allows it).
        """
        G, T = group_size, params.max_completion_length
        N = len(prompt_ids) * G
        input_ids, attn = left_pad(prompt_ids, self.pad_token_id, device)  # [B, P]
        P = input_ids.shape[1]
        if shared is None:
            span = full_attention_span(model)  # sliding-window layers: sharing only while the window cannot bite
            shared = (
                (span is None or P + T <= span)
                and _worth_sharing(model, len(prompt_ids), G, P)
                and _prefix_sharing_ok(model, device, self.pad_token_id)
            )
        position_ids = (attn.cumsum(-1) - 1).clamp(min=0)  # [B, P]
        config = getattr(model, "config", None)
        cache = preallocated_cache(config, P if shared else P + T)
        extra = {"logits_to_keep": 1} if _accepts(model, "logits_to_keep") else {}
        out = model(
            input_ids=input_ids,
            attention_mask=attn,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
            **extra,
        )
        cache = out.past_key_values
        logits = out.logits[:, -1, :]  # [B, V]
        if G > 1:
            logits = logits.repeat_interleave(G, dim=0)  # [N, V]
        if shared:
            # The G samples of a prompt read its prefill from one copy; each sample caches only its own tokens.
            plan = PrefixPlan([(layer.keys, layer.values) for layer in cache.layers], attn, G)
            cache = preallocated_cache(config, T)
            step_mask = plan_masks(device, plan)
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
        lengths = torch.full((N,), T, dtype=torch.long, device=device)  # [N]
        ended = torch.zeros(N, dtype=torch.bool, device=device)  # [N]
        done = torch.zeros(N, dtype=torch.bool, device=device)  # [n] live rows that already ended

        with contextlib.ExitStack() as scope:
            if shared:
                scope.enter_context(custom_attention(model))
            for t in range(T):
                tok, lp = sample_next(logits, params, generator)  # [n], [n]
                tokens[rows, t] = tok
                logps[rows, t] = lp
                hit = torch.isin(tok, eos) & ~done  # [n]
                lengths[rows] = torch.where(hit, t + 1, lengths[rows])
                ended[rows] = ended[rows] | hit
                done = done | hit
                if t == T - 1:
                    break
                n_live, n_done = done.numel(), int(done.sum())  # the step's only host sync
                if n_done == n_live:
                    break
                if n_done >= max(1, math.ceil(self.compact_fraction * n_live)):
                    keep = (~done).nonzero().squeeze(1)  # [n']
                    cache.batch_select_indices(keep)
                    rows, mask, pos, tok, done = rows[keep], mask[keep], pos[keep], tok[keep], done[keep]
                    if shared:
                        plan.select(rows)
                if t == PACK_AFTER_STEPS and T - t > PACK_MIN_REMAINING and self.packed_weights:
                    scope.enter_context(packed_linears(model, n_live - n_done))
                out = model(
                    input_ids=tok[:, None],
                    attention_mask=step_mask if shared else mask[:, : P + t + 1],
                    position_ids=pos[:, None],
                    past_key_values=cache,
                    use_cache=True,
                )
                cache = out.past_key_values
                logits = out.logits[:, -1, :]  # [n, V]
                pos = pos + 1
        return tokens, lengths, ended, logps


PACK_AFTER_STEPS = 8
PACK_MIN_REMAINING = 32
"""A CPU rollout still going after PACK_AFTER_STEPS decode steps, with room for more than
PACK_MIN_REMAINING further tokens, switches to oneDNN-packed copies of the weights (`packed_linear.py`).
Packing costs one to three passes over the weights (their fresh memory is faulted in at every rollout:
≈ 3 s for a 0.5 B model here) and saves 15-45 % of each later step (0.40 -> 0.23 s per step on that
model), so it pays only on long rollouts: with 16 new tokens, packing from the start made a 0.5 B
model's rollout 1.13x slower, after 8 steps 1.23x; with 64 new tokens, packing after 8 steps made it
1.17x faster. Short rollouts (the demo's) never pack; long ones give up the gain of their first steps."""

PREFIX_SHARING_MIN = 1 << 18
"""Cache elements per layer that G repeated prompt copies would add beyond one, above which decoding
reads one shared copy. Below it (short prompts, small models) the dozen small operators of shared-prefix
attention cost more per step than reading the copies: measured on the demo, neutral on workload (b)
at 0.5 M (5 * 10^5 elements), 1.04x faster at 14 M (1.6 * 10^6), 1.8x with 600-token prompts, G = 16."""

_PREFIX_OK: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _worth_sharing(model: torch.nn.Module, n_prompts: int, group_size: int, prompt_width: int) -> bool:
    """Returns whether the prompt cache copies that sharing avoids reach PREFIX_SHARING_MIN elements per layer."""
    shape = attention_shape(model)
    if shape is None:
        return False
    _, kv_heads, head_dim = shape
    return n_prompts * (group_size - 1) * prompt_width * kv_heads * head_dim >= PREFIX_SHARING_MIN


def _prefix_sharing_ok(model: torch.nn.Module, device: torch.device, pad_token_id: int) -> bool:
    """Returns whether shared-prefix decoding gives this model's plain-cache tokens and log-probs.

    Checked once per model with a few greedy steps on two prompts of different lengths (left padding).
    Chunked or linear-attention layers, attention implementations other than sdpa / eager, and models
    whose forward does not hand a pre-built 4-D mask to its layers unchanged keep the repeated cache;
    models with sliding-window layers share only rollouts that fit in the window (`_decode`).
    """
    if model in _PREFIX_OK:
        return _PREFIX_OK[model]
    config = text_config(model)
    ok = full_attention_span(model) != 0 and getattr(config, "_attn_implementation", None) in ("sdpa", "eager")
    if ok:
        vocab = model.get_input_embeddings().weight.shape[0]
        prompts = [[i % vocab for i in (2, 3, 4, 5)], [i % vocab for i in (6, 7)]]
        params = SamplingParams(max_completion_length=4, greedy=True)
        # An EOS id outside the vocabulary: every step is decoded, whatever the model prefers.
        probe = BuiltinEngine(eos_token_ids=[vocab], pad_token_id=pad_token_id)
        try:
            with torch.inference_mode(), eval_mode(model):
                a = probe._decode(model, prompts, 2, params, None, device, shared=True)
                b = probe._decode(model, prompts, 2, params, None, device, shared=False)
            # Compare log-probs up to the first step where rounding picked different tokens (possible at
            # half precision); step 0 comes from the prefill, so at least one decode step must agree.
            agree = (a[0] == b[0]).all(0).long().cumprod(0)  # [T] 1 while every row agrees
            steps = int(agree.sum())
            tol = check_tolerance(model)
            ok = steps >= 2 and torch.allclose(a[3][:, :steps], b[3][:, :steps], rtol=0, atol=tol)
        except Exception:  # noqa: BLE001 - any failure means sharing is unusable on this model
            ok = False
        if not ok:
            warnings.warn(
                f"builtin sampler: shared-prefix decoding does not reproduce {type(model).__name__}'s "
                "outputs; repeating each prompt's cache for its G samples instead",
                stacklevel=3,
            )
    _PREFIX_OK[model] = ok
    return ok


def _accepts(model: torch.nn.Module, name: str) -> bool:
    """Returns whether model.forward takes a keyword `name` (explicitly or through **kwargs)."""
    try:
        sig = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return False
    return name in sig.parameters or any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
