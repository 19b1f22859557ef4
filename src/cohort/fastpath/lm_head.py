"""The chunked LM head: log-probs of completion tokens without [batch, length, vocabulary] logits.

The decoder runs without its head (`split_model`); the head then runs only on the hidden states that
predict completion tokens, a byte-bounded chunk of rows at a time (`chunk_rows`), and under autograd
each chunk is checkpointed, so the backward pass recomputes one chunk's logits at a time instead of
keeping all of them. Known logit transforms after the head (Gemma 2's soft-capping, Granite's
`logits_scaling`, Cohere's `logit_scale`) are folded into the head; whether the split reproduces the
model's own logits is checked once per model (`cohort.fastpath.probes`, check "head_split").
"""

from __future__ import annotations

from typing import cast

import torch
from torch.utils.checkpoint import checkpoint

from cohort.fastpath import probes
from cohort.models import input_device, unwrap  # unwrap: re-exported (checkpoint, logprobs)
from cohort.runtime.sharding import SHARDED_REASON, is_sharded, is_split_sharded


def chunk_rows(vocab: int, device: torch.device, chunk_size: int, chunk_mib: int) -> int:
    """Returns how many rows of float32 logits one chunk holds: at most chunk_size, within chunk_mib MiB."""
    return max(1, min(chunk_size, (chunk_mib << 20) // (4 * max(vocab, 1))))


def chunked_logprobs(
    head, picked, target, temperature, with_entropy, chunk_size, with_sum_pi_squared=False, topk_ids=None
):
    """Returns (log-probs [M], entropy [M] or None, sum_v pi(v)^2 [M] or None, top-K log-probs [M, K] or None)
    from hidden states (or logits when head is None) [M, *].

    `with_entropy`: False, True (a statistic, outside autograd) or "grad" (differentiable: a loss term).
    `with_sum_pi_squared`: also each position's sum of squared next-token probabilities at `temperature` (a
    statistic outside autograd: the Optimal Token Baseline's variance proxy), from the same chunk's logits.
    `topk_ids` [M, K] long: also each position's log-probs at these K token ids (a gather of the log-softmax at
    `temperature`, outside autograd: DPPO's top-K divergence), from the same chunk's logits."""
    if with_sum_pi_squared and with_entropy == "grad":
        raise ValueError(
            "with_sum_pi_squared is a statistic of a pass without gradients; with_entropy='grad' is not"
        )
    if topk_ids is not None and (topk_ids.dim() != 2 or topk_ids.shape[0] != picked.shape[0]):
        raise ValueError(
            f"topk_ids {tuple(topk_ids.shape)} must be [M, K] with M = {picked.shape[0]} (one row per position)"
        )
    fn = _logp_entropy_grad if with_entropy == "grad" else _logp_entropy if with_entropy else _logp_only
    if with_sum_pi_squared:
        fn = _logp_stats_entropy if with_entropy else _logp_stats
    # Recomputing chunks in backward keeps one chunk's logits alive at a time. When everything fits in
    # one chunk that bound holds anyway, and skipping the recompute saves 7 % of the demo's update.
    use_ckpt = torch.is_grad_enabled() and picked.requires_grad and picked.shape[0] > chunk_size
    logps, ents, squares, tops = [], [], [], []
    for start in range(0, picked.shape[0], chunk_size):
        h = picked[start : start + chunk_size]  # [m, H]
        tgt = target[start : start + chunk_size]  # [m]
        top = topk_ids[start : start + chunk_size] if topk_ids is not None else None  # [m, K]
        if use_ckpt:
            out = checkpoint(fn, head, h, tgt, temperature, top, use_reentrant=False)
        else:
            out = fn(head, h, tgt, temperature, top)
        logps.append(out[0])
        ents.append(out[1])
        squares.append(out[2])
        tops.append(out[3])
    return (
        torch.cat(logps),
        (torch.cat(ents) if with_entropy else None),
        (torch.cat(squares) if with_sum_pi_squared else None),
        (torch.cat(tops) if topk_ids is not None else None),
    )


def _scaled_logits(head, h, temperature):
    z = head(h) if head is not None else h
    logits = z.to(
        torch.promote_types(z.dtype, torch.float32)
    )  # [m, V]: float32, or float64 for a float64 model
    return logits / temperature if temperature != 1.0 else logits


def _gather_topk(logits, logz, topk):
    """Returns the log-probs [m, K] at ids topk [m, K] (None when not asked), outside autograd."""
    if topk is None:
        return None
    # A mask statistic, never a loss term: under checkpointing a differentiable gather would keep its inputs.
    with torch.no_grad():
        return logits.detach().gather(-1, topk) - logz.detach()[:, None]


def _logp_only(head, h, target, temperature, topk=None):
    logits = _scaled_logits(head, h, temperature)  # [m, V]
    logz = logits.logsumexp(-1)  # [m]
    logp = logits.gather(-1, target[:, None]).squeeze(-1) - logz  # [m]
    return logp, None, None, _gather_topk(logits, logz, topk)


def _logp_entropy(head, h, target, temperature, topk=None):
    logits = _scaled_logits(head, h, temperature)  # [m, V]
    logz = logits.logsumexp(-1)  # [m]
    logp = logits.gather(-1, target[:, None]).squeeze(-1) - logz  # [m]
    # Entropy is a statistic, not a loss term: outside autograd. Under checkpointing, tensors saved for a
    # backward that never runs stay alive until the whole backward ends, so a differentiable entropy
    # would keep two [m, V] tensors per chunk (2.7 GB at a 152k vocabulary).
    with torch.no_grad():
        z = logits.detach()
        entropy = logz.detach() - (z.softmax(-1) * z).sum(-1)  # [m]
    return logp, entropy, None, _gather_topk(logits, logz, topk)


def _logp_stats(head, h, target, temperature, topk=None):
    logits = _scaled_logits(head, h, temperature)  # [m, V]
    logz = logits.logsumexp(-1)  # [m]
    logp = logits.gather(-1, target[:, None]).squeeze(-1) - logz  # [m]
    with torch.no_grad():
        # sum_v pi_v^2 = exp(logsumexp(2 z) - 2 logsumexp(z)): in log space, so no [m, V] of probabilities.
        square = torch.exp((2 * logits.detach()).logsumexp(-1) - 2 * logz.detach())  # [m]
    return logp, None, square, _gather_topk(logits, logz, topk)


def _logp_stats_entropy(head, h, target, temperature, topk=None):
    logp, _, square, top = _logp_stats(head, h, target, temperature, topk)
    with torch.no_grad():
        z = _scaled_logits(head, h, temperature).detach()
        entropy = z.logsumexp(-1) - (z.softmax(-1) * z).sum(-1)  # [m]
    return logp, entropy, square, top


def _logp_entropy_grad(head, h, target, temperature, topk=None):
    logits = _scaled_logits(head, h, temperature)  # [m, V]
    logp_all = logits.log_softmax(-1)  # [m, V]
    logp = logp_all.gather(-1, target[:, None]).squeeze(-1)  # [m]
    entropy = -(logp_all.exp() * logp_all).sum(-1)  # [m], differentiable (entropy regularisation)
    top = None
    if topk is not None:
        with torch.no_grad():
            top = logp_all.detach().gather(-1, topk)  # [m, K]
    return logp, entropy, None, top


class _HeadThenTransform(torch.nn.Module):
    """The LM head followed by the logit transform the model's forward applies after it (in float32)."""

    def __init__(self, head: torch.nn.Module, transform) -> None:
        super().__init__()
        self.head, self.transform = head, transform

    @property
    def weight(self) -> torch.Tensor:
        """Returns the head's weight [V, H]."""
        return cast(torch.Tensor, self.head.weight)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Returns the transformed logits [..., V] float32."""
        z = self.head(hidden)
        return self.transform(z.to(torch.promote_types(z.dtype, torch.float32)))


def _logit_transform(inner: torch.nn.Module):
    """Returns the function transformers' forward applies to this model's LM-head output, or None.

    The known ones: final soft-capping (Gemma 2), division by `logits_scaling` (Granite),
    multiplication by `logit_scale` (Cohere). Whether it is right is checked by `_head_matches`.
    """
    config = getattr(inner, "config", None)
    cap = getattr(config, "final_logit_softcapping", None)
    if cap:
        return lambda z: torch.tanh(z / cap) * cap
    divisor = getattr(config, "logits_scaling", None)
    if isinstance(divisor, (int, float)) and divisor not in (0, 1):
        return lambda z: z / divisor
    factor = getattr(inner, "logit_scale", None)
    if isinstance(factor, (int, float)) and factor != 1:
        return lambda z: z * factor
    return None


def split_model(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module] | None:
    """Returns (decoder, lm_head) when head(decoder(x)) reproduces model(x).logits, else None (full logits).

    A known logit transform after the head (soft-capping, logit scaling) is folded into the returned head.
    Models with other transforms, peft prompt learning (virtual tokens), or no get_decoder /
    get_output_embeddings fail; the check runs once per model on a 4-token input.
    """
    peft_config = getattr(model, "active_peft_config", None)
    inner = unwrap(model)
    get_dec = getattr(inner, "get_decoder", None)
    get_head = getattr(inner, "get_output_embeddings", None)
    if getattr(peft_config, "is_prompt_learning", False) or not callable(get_dec) or not callable(get_head):
        return None
    decoder, head = get_dec(), get_head()
    if decoder is None or head is None or decoder is inner:
        return None
    transform = _logit_transform(inner)
    head = _HeadThenTransform(head, transform) if transform is not None else head
    vocab = head.weight.shape[0] if getattr(head, "weight", None) is not None else 2

    def inputs():
        ids = (torch.arange(4, device=input_device(model)) % vocab)[None]  # [1, 4]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "use_cache": False}

    def split():
        out = decoder(**inputs())
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        return head(hidden).float()  # [1, 4, V]

    def whole():
        return model(**inputs()).logits.float()  # [1, 4, V]

    def agree(ours, theirs, tol):
        # Logits, not log-probs: relative to their scale (a soft-cap or scale is exact or far off).
        scale = 1.0 + theirs.abs().max().item()
        return ours.shape == theirs.shape and bool(torch.allclose(ours, theirs, rtol=1e-3, atol=1e-3 * scale))

    return (decoder, head) if probes.probe(model, "head_split", split, whole, agree=agree) else None


def head_unavailable(model: torch.nn.Module) -> str | None:
    """Returns why the chunked LM head cannot run on `model` (None: it can)."""
    if is_sharded(model) and not is_split_sharded(model):
        return SHARDED_REASON
    if split_model(model) is None:
        return probes.failure(
            model,
            "head_split",
            "it does not split into a decoder and an LM head that reproduce its logits (computing full "
            "logits: memory grows with batch x length x vocabulary)",
        )
    return None
