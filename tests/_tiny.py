"""A tiny random Qwen2 causal LM shared by the rollout and log-prob tests (no files, no downloads)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from cohort.fastpath import FastConfig
from cohort.rollout import RolloutEngine, make_engine

VOCAB = 40
PAD = 0
EOS = 1

ALL_FAST = FastConfig(shared_prefix="on", packed_weights="on")
"""The tiny models fall under the size thresholds of shared-prefix decoding and packed weights (and their
rollouts are shorter than the steps packing waits for): `on` sends every builtin rollout of the tests
through both, and the plain paths are compared against them explicitly."""


def make_test_engine(name: str, *, eos=(EOS,), fast: FastConfig = ALL_FAST) -> RolloutEngine:
    """Returns the rollout engine `name` for the tiny vocabulary (the builtin one with `fast`)."""
    options = {"fast": fast} if name == "builtin" else {}
    return make_engine(name, eos_token_ids=list(eos), pad_token_id=PAD, **options)


def tiny_model(
    *,
    seed: int = 0,
    hidden_size: int = 48,
    num_layers: int = 2,
    eos_bias: float | None = None,
    logit_scale: float = 1.0,
    attn_implementation: str = "sdpa",
    vocab_size: int = VOCAB,
) -> Qwen2ForCausalLM:
    """Returns a float32 tiny Qwen2ForCausalLM in eval mode with deterministic random weights.

    eos_bias gives the LM head a bias whose EOS entry is eos_bias (so rows end mid-way);
    logit_scale multiplies the LM head weights (a random tiny model is nearly uniform otherwise,
    and a sampler with a wrong temperature would look right).
    """
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        pad_token_id=PAD,
        eos_token_id=EOS,
        bos_token_id=None,
        attn_implementation=attn_implementation,
    )
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
        if eos_bias is not None:
            head = torch.nn.Linear(hidden_size, vocab_size, bias=True)
            head.weight.copy_(model.lm_head.weight)
            head.bias.zero_()
            head.bias[EOS] = eos_bias
            model.lm_head = head
    return model.eval()


def random_prompts(n: int, *, seed: int, min_len: int = 2, max_len: int = 9) -> list[list[int]]:
    """Returns n prompts of random lengths in [min_len, max_len] over ids 2..VOCAB-1 (no PAD or EOS)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (n,), generator=g).tolist()
    return [torch.randint(2, VOCAB, (n_i,), generator=g).tolist() for n_i in lengths]


@contextlib.contextmanager
def single_thread() -> Iterator[None]:
    """Yields with torch on one CPU thread, restoring the previous count.

    Tiny models gain nothing from intra-op threads, and on a loaded 2-core machine OpenMP threads
    that wait on each other made these tests 10-20x slower.
    """
    before = torch.get_num_threads()
    # COHORT_TEST_THREADS=2 runs the suite on two threads: other reduction orders, to find tests that hold on one
    # float kernel only (as an AVX2-only CPU found).
    torch.set_num_threads(int(os.environ.get("COHORT_TEST_THREADS", "1")))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def build_tool_model(folder, *, max_positions: int = 256):
    """Returns `folder` after saving a tiny Qwen2 with cohort's Hermes tool template whose turns end after ~11
    tokens: every hidden state gets a shared component that only the EOS row of the LM head reads."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from cohort.models import build_tiny_model

    folder = build_tiny_model(
        folder,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        tool_format="hermes",
        max_position_embeddings=max_positions,
    )
    model = AutoModelForCausalLM.from_pretrained(folder)
    eos = AutoTokenizer.from_pretrained(folder).eos_token_id
    direction = torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    direction /= direction.norm()
    with torch.no_grad():
        model.model.embed_tokens.weight += 0.5 * direction
        model.lm_head.weight[eos] = 3.4 / model.config.hidden_size**0.5 * direction
    model.save_pretrained(folder)
    return folder
