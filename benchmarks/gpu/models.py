"""The GPU check's model shapes and prompts: Qwen2.5-0.5B's exact shape (and a second one), randomly
initialised from a config, so nothing is downloaded.

Importing this module imports neither torch nor transformers (the GRPO driver imports it before choosing
which framework a worker runs).
"""

from __future__ import annotations

from pathlib import Path

SHAPES: dict[str, dict] = {
    # Qwen2.5-0.5B: 494 M parameters, tied embeddings, grouped-query attention (14 query heads, 2 KV heads).
    "0.5b": {
        "hidden_size": 896,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "intermediate_size": 4864,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
        "rope_theta": 1e6,
        "max_position_embeddings": 32768,
    },
    # Qwen2.5-1.5B: 1.54 B parameters, 28 layers of 1,536, 12 query heads, 2 KV heads.
    "1.5b": {
        "hidden_size": 1536,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "intermediate_size": 8960,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
        "rope_theta": 1e6,
        "max_position_embeddings": 32768,
    },
    # Shallower and wider per head than 0.5b: fewer kernels a step, each larger (where the host matters less).
    "14L1024": {
        "hidden_size": 1024,
        "num_hidden_layers": 14,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "intermediate_size": 4096,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
        "rope_theta": 1e6,
        "max_position_embeddings": 32768,
    },
    # For a dry run on a CPU (--tiny).
    "tiny": {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "vocab_size": 512,
        "tie_word_embeddings": True,
        "rope_theta": 1e6,
        "max_position_embeddings": 1024,
    },
}
"""Model shapes by name (Qwen2Config fields)."""


def qwen2_config(shape: str, *, pad_token_id: int = 0, eos_token_id: int | None = None):
    """Returns the transformers Qwen2Config of a named shape (sdpa attention, no sliding window)."""
    from transformers import Qwen2Config

    s = dict(SHAPES[shape])
    theta = s.pop("rope_theta")
    cfg = Qwen2Config(
        **s,
        use_sliding_window=False,
        pad_token_id=pad_token_id,
        eos_token_id=eos_token_id,
        bos_token_id=None,
        attn_implementation="sdpa",
    )
    # transformers 5 keeps the RoPE base in rope_parameters; older releases read rope_theta.
    rope = getattr(cfg, "rope_parameters", None)
    if isinstance(rope, dict):
        rope["rope_theta"] = theta
    cfg.rope_theta = theta
    return cfg


def random_model(shape: str, dtype, device: str, seed: int = 0, **config_kwargs):
    """Returns a randomly initialised Qwen2ForCausalLM of `shape` on `device` in `dtype`, in eval mode."""
    import torch
    from transformers import Qwen2ForCausalLM

    cfg = qwen2_config(shape, **config_kwargs)
    torch.manual_seed(seed)
    # Initialised on the target device: a 0.5 B model's normal_ fills take seconds on a CPU, milliseconds on a GPU.
    with torch.device(device):
        model = Qwen2ForCausalLM(cfg)
    return model.to(dtype=dtype).eval()


def save_model(out_dir: str | Path, shape: str, device: str, seed: int = 0) -> Path:
    """Returns `out_dir` after saving there a random float32 model of `shape` with cohort's char tokenizer
    (one token per character; its EOS and pad ids are the model's), reusing a previous save of the same shape."""
    import json

    import torch
    from transformers import GenerationConfig

    from cohort.models import build_tiny_tokenizer

    out = Path(out_dir)
    stamp = out / "gpu_check_model.json"
    spec = {"shape": shape, "seed": seed, **SHAPES[shape]}
    if stamp.exists() and json.loads(stamp.read_text()) == spec:
        return out
    tok = build_tiny_tokenizer()
    model = random_model(
        shape, torch.float32, device, seed, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id
    )
    model.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    stamp.write_text(json.dumps(spec))
    return out


def random_prompts(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Returns n prompts of lo..hi token ids drawn uniformly from 1..vocab-2 (0 is the pad id, vocab-1 the EOS
    id transformers' generate is given)."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(1, vocab - 1) for _ in range(rng.randint(lo, hi))] for _ in range(n)]
