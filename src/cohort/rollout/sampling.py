"""Next-token selection: temperature, top-k, top-p (in that order, as transformers applies them)."""

from __future__ import annotations

import torch

from cohort.errors import NonFiniteSamplingError
from cohort.rollout.base import SamplingParams


def filter_logits(scaled: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Returns `scaled` [n, V] with tokens outside the top-k / top-p sets set to -inf.

    top_p keeps, in decreasing order of probability, every token whose predecessors hold less than
    top_p of the (top-k renormalised) mass, so the most likely token always survives.
    """
    vocab = scaled.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(scaled, top_k, dim=-1).values[:, -1:]  # [n, 1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)  # [n, V]
        probs = sorted_logits.softmax(dim=-1)  # [n, V]
        mass_before = probs.cumsum(dim=-1) - probs  # [n, V]
        drop_sorted = mass_before >= top_p  # [n, V]; position 0 has mass_before 0 < top_p, always kept
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)  # [n, V]
        scaled = scaled.masked_fill(drop, float("-inf"))
    return scaled


def sample_next(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (tokens [n] long, log-probs [n] float32) for next-token logits [n, V].

    The log-prob is log_softmax(logits / temperature) at the chosen token, before top-k / top-p
    filtering (the distribution a trainer recomputes); for greedy it is log_softmax(logits).
    Raises NonFiniteSamplingError when torch refuses to draw from non-finite probabilities. On an
    accelerator nothing is refused (see `draw`): a row whose logits are not finite gets a non-finite
    log-prob, which the engine checks once per rollout (`check_finite_logprobs`).
    """
    tokens, logp, _ = _sample(logits, params, generator)
    return tokens, logp


def sample_next_topk(
    logits: torch.Tensor, params: SamplingParams, k: int, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (tokens [n], log-probs [n], top-K ids [n, k] long, top-K log-probs [n, k] float32): sample_next's
    draw (the same tokens and log-probs for the same generator) and the k most likely tokens under the same
    distribution, the sampled token forced in (`forced_topk`)."""
    tokens, logp, logp_all = _sample(logits, params, generator)
    ids, top = forced_topk(logp_all, tokens, k)
    return tokens, logp, ids, top


def forced_topk(logp_all: torch.Tensor, tokens: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (ids [n, k] long, log-probs [n, k]): the k largest of logp_all [n, V] per row, in decreasing order,
    except that a sampled token (tokens [n]) outside them replaces the k-th, so every row holds its own token."""
    vocab = logp_all.shape[-1]
    if not 0 < k <= vocab:
        raise ValueError(f"logprobs_topk={k} must be in 1..{vocab} (the vocabulary size)")
    top, ids = logp_all.topk(k, dim=-1)  # [n, k], [n, k]
    present = (ids == tokens[:, None]).any(-1)  # [n]
    ids[:, -1] = torch.where(present, ids[:, -1], tokens)
    top[:, -1] = torch.where(present, top[:, -1], logp_all.gather(-1, tokens[:, None]).squeeze(-1))
    return ids, top


def _sample(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (tokens [n], their log-probs [n], every token's log-prob [n, V]) of one draw (see sample_next)."""
    logits = logits.float()  # [n, V]
    if params.greedy:
        tokens = logits.argmax(dim=-1)  # [n]
        logp_all = torch.log_softmax(logits, dim=-1)  # [n, V]
        logp = logp_all.gather(-1, tokens[:, None]).squeeze(-1)  # [n]
        return tokens, logp, logp_all
    scaled = logits / params.temperature if params.temperature != 1.0 else logits  # [n, V]
    logp_all = torch.log_softmax(scaled, dim=-1)  # [n, V]
    if 0 < params.top_k < logits.shape[-1] or params.top_p < 1.0:
        probs = filter_logits(scaled, params.top_k, params.top_p).softmax(dim=-1)  # [n, V]
    else:
        probs = logp_all.exp()  # [n, V]
    try:
        tokens = draw(probs, generator)  # [n]
    except RuntimeError as e:
        # torch.multinomial refuses NaN / inf probabilities with an error of no type of its own: the
        # probabilities say whether that was the reason (checked only once sampling has failed).
        if not bool(torch.isfinite(probs).all()):
            raise NonFiniteSamplingError(str(e)) from e
        raise
    logp = logp_all.gather(-1, tokens[:, None]).squeeze(-1)  # [n]
    return tokens, logp, logp_all


def draw(probs: torch.Tensor, generator: torch.Generator | None = None, block: int = 1024) -> torch.Tensor:
    """Returns one token per row [n] drawn from probs [n, V] (rows need not be normalised).

    On CPU, inverse-CDF sampling: one uniform per row instead of torch.multinomial's V random
    numbers (about 20x faster for an 8k vocabulary). Two levels keep it light at large vocabularies:
    the uniform first picks a block of `block` tokens from the blocks' masses, then a token inside
    that block, so float64 cumulative sums cover only the block masses and one block per row (28 ->
    0.7 ms per step for 32 rows of a 152k vocabulary), and rounding cannot absorb a small token's
    mass into a large running sum. A zero-probability token is never chosen. On
    accelerators torch.multinomial is fast and needs no float64 buffer; it gets `drawable(probs)`,
    because CUDA's multinomial checks its input inside the kernel: a NaN, an inf or a negative entry is a
    device-side assert that no except clause catches and after which every CUDA call of the process fails.
    """
    if probs.device.type != "cpu":
        return torch.multinomial(drawable(probs), 1, generator=generator).squeeze(-1)  # [n]
    n, V = probs.shape
    if V <= block:
        cdf = probs.double().cumsum(dim=-1)  # [n, V]
        u = torch.rand(n, 1, dtype=torch.float64, generator=generator) * cdf[:, -1:]  # [n, 1]
        return torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp_(max=V - 1)  # [n]
    full = V // block
    # Block masses summed in the input dtype (sum(dtype=float64) is 80x slower): a relative error of
    # ~1e-7 per block, and an all-zero block still sums to exactly 0.
    sums = probs[:, : full * block].view(n, full, block).sum(-1)  # [n, full]
    if full * block < V:
        sums = torch.cat([sums, probs[:, full * block :].sum(-1, keepdim=True)], 1)
    cdf = sums.double().cumsum(-1)  # [n, nb]
    u = torch.rand(n, 1, dtype=torch.float64, generator=generator) * cdf[:, -1:]  # [n, 1]
    b = torch.searchsorted(cdf, u, right=True).clamp_(max=cdf.shape[1] - 1)  # [n, 1] first block with cdf > u
    before = torch.where(b > 0, cdf.gather(1, (b - 1).clamp(min=0)), 0.0)  # [n, 1]
    cols = b * block + torch.arange(block)  # [n, block]
    inner = probs.gather(1, cols.clamp(max=V - 1)).masked_fill(cols >= V, 0.0)  # [n, block]
    t = torch.searchsorted(inner.double().cumsum(-1), u - before, right=True)  # [n, 1]
    # Summation order can leave u - before a hair above the block's own cumsum: take its last live token.
    last = (inner > 0).long().cumsum(-1).argmax(-1, keepdim=True)  # [n, 1]
    return (b * block + torch.minimum(t, last)).squeeze(-1)  # [n]


def drawable(probs: torch.Tensor) -> torch.Tensor:
    """Returns probs [n, V] with each row that is no distribution (a NaN, an inf or a negative entry, or a sum
    of 0) replaced by a uniform one, without a host sync: what torch.multinomial on CUDA accepts."""
    # Two passes over the [n, V] rows, not seven (elementwise isfinite and >= 0, their and, all, sum, ones_like): a
    # NaN or an inf makes the row's sum non-finite, a negative entry its minimum negative. Entries of at most 1
    # (probabilities, or weights scaled by their row's largest) sum to at most V: a finite row never overflows its
    # sum. On a GPU's decode step each pass reads the whole vocabulary.
    total = probs.sum(-1, keepdim=True)  # [n, 1]
    ok = torch.isfinite(total) & (total > 0) & (probs.amin(-1, keepdim=True) >= 0)  # [n, 1]
    return torch.where(ok, probs, 1.0)  # [n, V]


def check_finite_logprobs(logprobs: torch.Tensor) -> None:
    """Raises NonFiniteSamplingError when a sampled token's log-prob [N, T] is NaN or inf (non-finite logits)."""
    if not bool(torch.isfinite(logprobs).all()):
        raise NonFiniteSamplingError(
            "probability tensor contains either `inf`, `nan` or element < 0: the policy's next-token logits "
            "were not finite while sampling"
        )
