"""Benchmark models: cohort's tiny Qwen2 models, edited so that EOS comes at a controlled rate.

An untrained model samples EOS with probability about 1/V at every position, so its completions never
end (V = 258) or end at random (V = 151,936 never). To get completions of varied length that end at
EOS, identically for both frameworks, the saved weights are edited so that the EOS logit sits a fixed
offset `b` above every other logit, whatever the context:

1. residual dimension 0 is made a constant `c`: every token's embedding has `c` there, and every
   layer's output projections (`o_proj`, `down_proj`) write nothing into dimension 0;
2. after the final RMSNorm that dimension is then ``s = c * norm.weight[0] / rms(h)``, nearly constant
   because `c` dominates the residual's RMS (measured: it varies by < 1 %);
3. the LM-head row of EOS gets ``b / s`` in dimension 0 and every other row 0 there (untied
   embeddings, cohort's default), so the EOS logit is ``b`` above the others. With tied embeddings
   the EOS row gets ``c + b / s`` instead (every logit then carries ``c * s``, which softmax
   ignores); EOS is never an input whose output matters (it is the last token of a completion).

Other logits stay near-uniform (a random model), so the EOS probability is
``p = e^b / (e^b + V - 1)`` and lengths are geometric, truncated at max_completion_length:
mean ``(1 - (1 - p)^L) / p``. `s` and the measured EOS probability (from which `b` is corrected
twice) come from contexts like those sampling meets: prompts of the workload's kind followed by
128 tokens drawn uniformly. `eos_rate=0` sets ``b = -60`` (EOS unreachable: every completion is
exactly max_completion_length tokens, as the sweep needs). The model stays a plain Qwen2
checkpoint that both trainers load with ``from_pretrained``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

RESIDUAL_CONST = 3.0  # c: large against the residual's other entries (about 0.02-0.1 each)


def eos_offset(eos_rate: float, vocab_size: int) -> float:
    """Return the EOS logit offset b that gives EOS probability `eos_rate` among `vocab_size` near-equal logits."""
    if eos_rate <= 0:
        return -60.0
    if not 0 < eos_rate < 1:
        raise ValueError(f"eos_rate={eos_rate} must be in [0, 1)")
    return math.log(eos_rate * (vocab_size - 1) / (1 - eos_rate))


def expected_length(eos_rate: float, max_len: int) -> float:
    """Return the mean completion length (EOS included) for a per-token EOS probability, cut at max_len."""
    if eos_rate <= 0:
        return float(max_len)
    return (1 - (1 - eos_rate) ** max_len) / eos_rate


def rate_for_mean_length(mean: float, max_len: int) -> float:
    """Return the per-token EOS probability whose truncated geometric length has this mean (bisection)."""
    lo, hi = 1e-6, 1.0
    for _ in range(100):
        mid = (lo + hi) / 2
        if expected_length(mid, max_len) > mean:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


CONTEXT_COMPLETION = 128  # random completion tokens appended to each calibration prompt


def _contexts(tokenizer, prompts: list[str] | None, vocab: int, seed: int) -> torch.Tensor:
    """Return [n, T] contexts like the ones sampling meets: a prompt, then tokens drawn uniformly from
    the tokenizer's ids (what a near-uniform model samples). Prompts are cut to a common length."""
    g = torch.Generator().manual_seed(seed)
    n_ids = min(vocab, len(tokenizer))
    if prompts:
        enc = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
        width = min(len(e) for e in enc)
        head = torch.tensor([e[:width] for e in enc])  # [n, P]
    else:
        head = torch.randint(2, n_ids, (8, 16), generator=g)  # [8, 16]
    tail = torch.randint(2, n_ids, (head.shape[0], CONTEXT_COMPLETION), generator=g)  # [n, 128]
    return torch.cat([head, tail], dim=1)  # [n, P + 128]


@torch.no_grad()
def _final_dim0(model, tokenizer, prompts, vocab: int, seed: int) -> tuple[float, float]:
    """Return (mean, std) of dimension 0 after the final norm over calibration contexts."""
    ids = _contexts(tokenizer, prompts, vocab, seed)  # [n, T]
    out = model.model(input_ids=ids).last_hidden_state  # [n, T, h]
    return float(out[..., 0].mean()), float(out[..., 0].std())  # Qwen2Model applies the final norm


@torch.no_grad()
def _eos_prob(model, tokenizer, prompts, eos: int, vocab: int, seed: int) -> float:
    """Return the mean next-token probability of EOS where completion tokens are predicted."""
    ids = _contexts(tokenizer, prompts, vocab, seed)  # [n, T]
    P = ids.shape[1] - CONTEXT_COMPLETION
    hidden = model.model(input_ids=ids).last_hidden_state[
        :, P - 1 :
    ]  # [n, 129, h]: predicts completion tokens
    head = model.get_output_embeddings()
    probs = [
        torch.softmax(head(h).float(), -1)[:, eos] for h in hidden.reshape(-1, hidden.shape[-1]).split(256)
    ]
    return float(torch.cat(probs).mean())


@torch.no_grad()
def build_bench_model(
    out_dir: str | Path,
    *,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    intermediate_size: int,
    vocab_size: int | None = None,
    eos_rate: float = 0.0,
    max_position_embeddings: int = 1024,
    seed: int = 0,
    calibration_prompts: list[str] | None = None,
) -> dict:
    """Return facts about the model saved in `out_dir` (cohort tiny Qwen2 + EOS-rate edit, see module doc)."""
    from cohort.models import build_tiny_model, load_model, load_tokenizer

    out = Path(out_dir)
    meta_path = out / "bench_model.json"
    spec = {
        "hidden_size": hidden_size,
        "num_layers": num_layers,
        "num_heads": num_heads,
        "intermediate_size": intermediate_size,
        "vocab_size": vocab_size,
        "eos_rate": eos_rate,
        "max_position_embeddings": max_position_embeddings,
        "seed": seed,
        "calibration_prompts": len(calibration_prompts or []),
    }
    if meta_path.exists():
        meta = json.loads(meta_path.read_text())
        if meta.get("spec") == spec:
            return meta
    build_tiny_model(
        out,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        intermediate_size=intermediate_size,
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
        seed=seed,
    )
    tok = load_tokenizer(out)
    model = load_model(out).eval()
    V = model.config.vocab_size
    eos = tok.eos_token_id
    emb = model.get_input_embeddings().weight  # [V, h]
    head = model.get_output_embeddings().weight  # [V, h], the same tensor when tied
    tied = head.data_ptr() == emb.data_ptr()
    emb[:, 0] = RESIDUAL_CONST
    base = RESIDUAL_CONST if tied else 0.0  # tied: every logit gets c * s, which softmax ignores
    if not tied:
        head[:, 0] = 0.0

    def set_offset(b: float) -> None:
        head[eos, 0] = base + b / s

    def offset() -> float:
        return float((head[eos, 0] - base) * s)

    for layer in model.model.layers:
        layer.self_attn.o_proj.weight[0, :] = 0.0
        layer.mlp.down_proj.weight[0, :] = 0.0
    s, s_std = _final_dim0(model, tok, calibration_prompts, V, seed)
    b = eos_offset(eos_rate, V)
    p_eos = 0.0
    # The other logits are not exactly equal, so correct b twice against the measured probability
    # (for small p, p is proportional to e^b).
    for _ in range(3 if eos_rate > 0 else 1):
        set_offset(b)
        p_eos = _eos_prob(model, tok, calibration_prompts, eos, V, seed + 1)
        if eos_rate > 0:
            b += math.log(eos_rate / p_eos)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    n_params = sum(p.numel() for p in model.parameters())
    n_embed = emb.numel() + (0 if tied else head.numel())
    meta = {
        "spec": spec,
        "path": str(out),
        "vocab_size": V,
        "hidden_size": hidden_size,
        "num_layers": num_layers,
        "intermediate_size": intermediate_size,
        "parameters": n_params,
        "parameters_nonembedding": n_params - n_embed,
        "tied_embeddings": tied,
        "eos_offset": offset(),
        "final_dim0_mean": s,
        "final_dim0_std": s_std,
        "eos_prob_target": eos_rate,
        "eos_prob_calibrated": p_eos,
        "mean_length_at_128": expected_length(eos_rate, 128),
    }
    meta_path.write_text(json.dumps(meta, indent=2))
    return meta
