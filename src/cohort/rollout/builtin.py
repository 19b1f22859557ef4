"""The built-in sampler: batched KV-cache decoding that prefills each prompt once.

Compared with `model.generate(num_return_sequences=G)`, which prefills every prompt G times, this
engine prefills the B unique prompts once and repeats their cache rows G times; it stops as soon as
every row has ended and drops ended rows from the batch once a sizeable fraction of it has ended, so
no compute is spent decoding rows that already emitted EOS. The cache is written in place into buffers
sized for prompt + max_completion_length (`kv_cache.py`), so no decode step copies the cache.
"""

from __future__ import annotations

import inspect
import math

import torch

from cohort.rollout.base import (
    RolloutBatch,
    RolloutEngine,
    SamplingParams,
    eval_mode,
    left_pad,
    model_device,
    validate_request,
)
from cohort.rollout.kv_cache import preallocated_cache
from cohort.rollout.sampling import sample_next


class BuiltinEngine(RolloutEngine):
    """KV-cache sampler: one prefill per unique prompt, shared by its G samples; ended rows are dropped."""

    name = "builtin"

    def __init__(self, *, eos_token_ids, pad_token_id: int, compact_fraction: float = 0.25) -> None:
        super().__init__(eos_token_ids=eos_token_ids, pad_token_id=pad_token_id)
        if not 0.0 < compact_fraction <= 1.0:
            raise ValueError(
                f"compact_fraction must be in (0, 1], got {compact_fraction}; it is the fraction of ended "
                "rows in the batch that triggers dropping them (0.25 is a good default)"
            )
        self.compact_fraction = compact_fraction

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
        device = model_device(model)
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

    def _decode(self, model, prompt_ids, group_size, params, generator, device):
        """Returns (tokens [N, T], lengths [N], ended-with-EOS [N] bool, log-probs [N, T]) on `device`."""
        G, T = group_size, params.max_completion_length
        N = len(prompt_ids) * G
        input_ids, attn = left_pad(prompt_ids, self.pad_token_id, device)  # [B, P]
        P = input_ids.shape[1]
        position_ids = (attn.cumsum(-1) - 1).clamp(min=0)  # [B, P]
        cache = preallocated_cache(getattr(model, "config", None), P + T)
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
        # The G samples of a prompt share its prefill: repeat cache rows instead of recomputing them.
        if G > 1:
            cache.batch_repeat_interleave(G)
            logits = logits.repeat_interleave(G, dim=0)  # [N, V]
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
            out = model(
                input_ids=tok[:, None],
                attention_mask=mask[:, : P + t + 1],
                position_ids=pos[:, None],
                past_key_values=cache,
                use_cache=True,
            )
            cache = out.past_key_values
            logits = out.logits[:, -1, :]  # [n, V]
            pos = pos + 1
        return tokens, lengths, ended, logps


def _accepts(model: torch.nn.Module, name: str) -> bool:
    """Returns whether model.forward takes a keyword `name` (explicitly or through **kwargs)."""
    try:
        sig = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return False
    return name in sig.parameters or any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
