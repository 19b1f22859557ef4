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
mean ``(1 - (1 - p)^L) / p``. Because real prompts are other contexts than the random ids the offset
is first fitted on, `b` is then corrected twice against the mean length of 128 completions sampled
(with transformers' `generate`) on prompts of the workload's kind. `eos_rate=0` sets ``b = -60``
(EOS unreachable: every completion is exactly max_completion_length tokens, as the sweep needs). The model stays a plain Qwen2 checkpoint
that both trainers load with ``from_pretrained``.
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


@torch.no_grad()
def _final_dim0(model, vocab: int, seed: int) -> tuple[float, float]:
    """Return (mean, std) of dimension 0 after the final norm over random contexts."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, min(vocab, 258), (4, 96), generator=g)  # [4, 96]
    out = model.model(input_ids=ids).last_hidden_state  # [4, 96, h]
    return float(out[..., 0].mean()), float(out[..., 0].std())  # Qwen2Model applies the final norm


@torch.no_grad()
def _eos_prob(model, eos: int, vocab: int, seed: int) -> float:
    """Return the mean next-token probability of EOS over random contexts."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, min(vocab, 258), (4, 96), generator=g)  # [4, 96]
    logits = model(input_ids=ids).logits.float()  # [4, 96, V]
    return float(torch.softmax(logits, -1)[..., eos].mean())


@torch.no_grad()
def sample_lengths(
    model, tokenizer, prompts: list[str], max_len: int, *, seed: int, per_prompt: int = 8
) -> list[int]:
    """Return the lengths (EOS included) of completions sampled at temperature 1 with transformers' generate."""
    torch.manual_seed(seed)
    eos = tokenizer.eos_token_id
    lengths = []
    for i in range(0, len(prompts), 8):
        enc = tokenizer(prompts[i : i + 8], return_tensors="pt", padding=True, padding_side="left")
        out = model.generate(
            **enc,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=max_len,
            num_return_sequences=per_prompt,
            eos_token_id=eos,
            pad_token_id=tokenizer.pad_token_id,
        )
        for row in out[:, enc["input_ids"].shape[1] :].tolist():
            lengths.append(row.index(eos) + 1 if eos in row else len(row))
    return lengths


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
    calibration_length: int = 128,
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
        "calibration": [len(calibration_prompts or []), calibration_length],
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
    s, s_std = _final_dim0(model, V, seed)
    b = eos_offset(eos_rate, V)
    p_eos = 0.0
    # The other logits are not exactly equal, so correct b twice against the measured probability
    # (for small p, p is proportional to e^b).
    for _ in range(3 if eos_rate > 0 else 1):
        set_offset(b)
        p_eos = _eos_prob(model, eos, V, seed + 1)
        if eos_rate > 0:
            b += math.log(eos_rate / p_eos)
    sampled = []
    if eos_rate > 0 and calibration_prompts:
        # Real prompts give other contexts than random ids: correct b on sampled completion lengths.
        want = expected_length(eos_rate, calibration_length)
        for it in range(2):
            lengths = sample_lengths(model, tok, calibration_prompts, calibration_length, seed=seed + it)
            mean = sum(lengths) / len(lengths)
            sampled.append(mean)
            set_offset(offset() + math.log(eos_rate / rate_for_mean_length(mean, calibration_length)))
        lengths = sample_lengths(model, tok, calibration_prompts, calibration_length, seed=seed + 10)
        sampled.append(sum(lengths) / len(lengths))
        if abs(sampled[-1] - want) > 0.25 * want:
            raise RuntimeError(
                f"EOS calibration failed: mean sampled length {sampled} for a target of {want:.1f}"
            )
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
        "eos_prob_random_contexts": p_eos,
        "calibration_mean_lengths": sampled,
        "mean_length_target": expected_length(eos_rate, calibration_length) if eos_rate > 0 else None,
    }
    meta_path.write_text(json.dumps(meta, indent=2))
    return meta
