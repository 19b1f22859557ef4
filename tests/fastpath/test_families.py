"""The fast paths on model families other than Qwen2: exact where taken, refused where they would be wrong.

Each family is a tiny random model built from its transformers config. For every one, the builtin
sampler (shared-prefix and repeated-cache decoding) must give `generate`'s greedy tokens, and the
grouped log-prob layouts (segment attention and the dense block mask) must give the log-probs of
running each prompt + completion alone. Families whose forward hands a pre-built mask to its layers
(most of them) must actually take the fast paths; sliding-window models must take them only while
no sequence is longer than the window.
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from _compile import Recorder
from torch._dynamo.utils import counters

from cohort.fastpath import FastConfig, compiled, probes
from cohort.logprobs import completion_logprobs
from cohort.models import full_attention_span
from cohort.rollout import make_engine
from cohort.rollout.base import SamplingParams
from cohort.rollout.graph import DECODE_STEP, static_decode

V, PAD, EOS, G = 64, 0, 1, 3
_TOKENS = {"vocab_size": V, "pad_token_id": PAD, "eos_token_id": EOS, "bos_token_id": None}
_DECODER = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}


def _build(family: str, window: int | None = None) -> torch.nn.Module:
    gqa = {**_DECODER, "num_key_value_heads": 2, **_TOKENS}
    configs = {
        "llama": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**gqa)),
        "qwen3": lambda: tf.Qwen3ForCausalLM(tf.Qwen3Config(**gqa, head_dim=8)),
        "phi3": lambda: tf.Phi3ForCausalLM(tf.Phi3Config(**gqa)),
        "olmo2": lambda: tf.Olmo2ForCausalLM(tf.Olmo2Config(**gqa)),
        "gpt_neox": lambda: tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(**_DECODER, rotary_pct=0.5, **_TOKENS)),
        "gpt2": lambda: tf.GPT2LMHeadModel(
            tf.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=128, **{**_TOKENS, "bos_token_id": EOS})
        ),
        "mistral": lambda: tf.MistralForCausalLM(tf.MistralConfig(**gqa, sliding_window=window)),
        "gpt_neo": lambda: tf.GPTNeoForCausalLM(
            tf.GPTNeoConfig(
                hidden_size=32,
                num_layers=2,
                num_heads=4,
                attention_types=[[["global", "local"], 1]],
                window_size=window or 256,
                max_position_embeddings=128,
                **{**_TOKENS, "bos_token_id": EOS},
            )
        ),
        "gemma3": lambda: tf.Gemma3ForCausalLM(
            tf.Gemma3TextConfig(**gqa, head_dim=8, sliding_window=window or 4096)
        ),
        # Logit transforms after the LM head: soft-capping, division, multiplication.
        "gemma2": lambda: tf.Gemma2ForCausalLM(
            tf.Gemma2Config(**gqa, head_dim=8, sliding_window=window or 4096, final_logit_softcapping=5.0)
        ),
        "granite": lambda: tf.GraniteForCausalLM(tf.GraniteConfig(**gqa, logits_scaling=4.0)),
        "cohere": lambda: tf.CohereForCausalLM(tf.CohereConfig(**gqa, logit_scale=0.25)),
    }
    torch.manual_seed(0)
    model = configs[family]().eval()
    with torch.no_grad():  # peaked distributions, so greedy choices are not decided by rounding
        model.get_output_embeddings().weight.mul_(8)
    return model


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(2, V, (n,), generator=g).tolist() for n in (5, 9, 3)]


def _alone(model, prompts, completions) -> list[torch.Tensor]:
    """Returns each completion's log-probs from a forward over its own prompt + completion."""
    out = []
    for i, comp in enumerate(completions):
        prompt = prompts[i // G]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + comp])).logits[0].float()
        lp = torch.log_softmax(logits[len(prompt) - 1 : len(prompt) - 1 + len(comp)], -1)
        out.append(lp.gather(-1, torch.tensor(comp)[:, None]).squeeze(-1))
    return out


EAGER = FastConfig(shared_prefix_min_elements=0, segments_min_tokens=0)
"""auto, with the size thresholds at 0: every path the model supports is taken, the rest fall back."""


def _check_exact(model, max_new: int = 10) -> dict:
    """Asserts greedy decoding on both cache paths equals generate's, and both grouped layouts equal _alone;
    returns the paths EAGER took: {"shared_prefix": bool, "logprobs": path, "chunked_head": bool}."""
    prompts, params = _prompts(), SamplingParams(max_completion_length=max_new, greedy=True)
    hf = make_engine("hf", eos_token_ids=[EOS], pad_token_id=PAD).generate(model, prompts, G, params)
    assert any(len(c) > 1 for c in hf.completion_ids)
    taken = {}
    for fast in (EAGER, FastConfig(shared_prefix="off")):
        ours = make_engine("builtin", eos_token_ids=[EOS], pad_token_id=PAD, fast=fast).generate(
            model, prompts, G, params
        )
        assert ours.completion_ids == hf.completion_ids, fast
        taken.setdefault("shared_prefix", ours.paths["shared_prefix"])
    ref = _alone(model, prompts, hf.completion_ids)
    for fast in (EAGER, FastConfig(segments="off")):
        got = completion_logprobs(model, prompts, hf.completion_ids, G, fast=fast)
        taken.setdefault("logprobs", got.path)
        taken.setdefault("chunked_head", got.chunked_head)
        for i, comp in enumerate(hf.completion_ids):
            torch.testing.assert_close(got.logp[i, : len(comp)], ref[i], rtol=0, atol=1e-5)
    return taken


@pytest.mark.parametrize("family", ["llama", "qwen3", "phi3", "olmo2", "gpt_neox", "gpt2"])
def test_fast_paths_are_taken_and_exact(family):
    model = _build(family)
    taken = _check_exact(model)
    # Both once-per-model checks passed: these families train with segments and decode with sharing.
    assert taken == {"shared_prefix": True, "logprobs": "segments", "chunked_head": True}
    assert probes.results(model)["segments"] is True and probes.results(model)["shared_prefix"] is True


STEP_FAMILIES = ["llama", "qwen3", "phi3", "olmo2", "gpt_neox", "gpt2", "gemma3"]
"""Families whose decode step the static step (graph_decode, compile_decode) is checked on."""


@pytest.mark.slow  # a trace of each family's step: 9-20 s each
@pytest.mark.parametrize("family", STEP_FAMILIES)
def test_the_static_decode_step_decodes_each_family_exactly_as_is_and_compiled(family, monkeypatch):
    """The captured decode step (graph_decode) and its compiled form (compile_decode) run on a GPU only; their step
    runs here uncaptured. On each family it must decode the eager engine's greedy tokens and log-probs, and trace as
    one graph through AOTAutograd, once for the whole rollout: a family that failed here would be refused by the
    probes on a GPU, and decode there several times slower without an error to show for it."""
    monkeypatch.setattr(compiled, "BACKEND", Recorder(then="aot_eager"))
    torch._dynamo.reset()  # Dynamo keeps traces per code object: count this family's alone
    counters.clear()
    model = _build(family).double()
    prompts, params = _prompts(), SamplingParams(max_completion_length=10, greedy=True)
    cpu = torch.device("cpu")
    plain = make_engine(
        "builtin", eos_token_ids=[EOS], pad_token_id=PAD, fast=FastConfig(shared_prefix="off")
    )
    with torch.no_grad():
        tokens, lengths, ended, logps = plain._decode(model, prompts, G, params, None, cpu, shared=False)
    assert int(lengths.max()) > 1
    for compiled_step in (False, True):
        with torch.no_grad():
            got = static_decode(
                model, prompts, G, params, None, cpu, eos_token_ids=[EOS], pad_token_id=PAD, shared=True,
                capture=False, compiled=compiled_step,
            )  # fmt: skip
        assert torch.equal(got[1], lengths) and torch.equal(got[2], ended), compiled_step
        for r, n in enumerate(lengths.tolist()):
            assert torch.equal(got[0][r, :n], tokens[r, :n]), (compiled_step, r)
            torch.testing.assert_close(got[3][r, :n], logps[r, :n], rtol=0, atol=1e-10)
    assert DECODE_STEP.failed(model) is None  # compiled, not fallen back to the eager step
    # One frame traced for all ten steps, into one graph without a break (Gemma3's trace restarts once inside
    # Dynamo, over a Python float it first kept symbolic: a slower trace, still one graph).
    assert counters["frames"]["total"] == 1 and counters["stats"]["unique_graphs"] == 1
    assert not counters["graph_break"], dict(counters["graph_break"])
    torch._dynamo.reset()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="captures a CUDA graph: needs a CUDA GPU")
@pytest.mark.parametrize("family", STEP_FAMILIES)
def test_on_a_gpu_each_family_takes_the_captured_step_and_replays_the_uncaptured_one(family):
    device = torch.device("cuda")
    model = _build(family).to(device)
    prompts, params = _prompts(), SamplingParams(max_completion_length=10, greedy=True)
    fast = FastConfig(graph_decode="on", graph_decode_min_tokens=0)
    with torch.no_grad():
        out = make_engine("builtin", eos_token_ids=[EOS], pad_token_id=PAD, fast=fast).generate(
            model, prompts, G, params
        )
    assert out.paths["graph_decode"] is True  # its probe passed: the family decodes captured on a GPU
    kw = {"eos_token_ids": [EOS], "pad_token_id": PAD, "shared": True, "check_every": 4}
    with torch.no_grad():
        plain, captured = (
            static_decode(model, prompts, G, params, None, device, capture=c, **kw) for c in (False, True)
        )
    for a, b in zip(plain, captured):
        assert torch.equal(a, b)  # the same kernels, replayed


@pytest.mark.parametrize("family", ["mistral", "gemma3", "gpt_neo"])
@pytest.mark.parametrize("window", [8, 64])
def test_sliding_window_models_stay_exact(family, window):
    """A window of 8 bites (prompt + 10 tokens is longer): the dense mask and prefix sharing are refused,
    segment attention must apply the window."""
    model = _build(family, window)
    assert full_attention_span(model) == window
    taken = _check_exact(model)
    bites = window < 9 + 10
    if family == "gpt_neo":  # eager attention: past the window only the padded layout is exact
        assert taken["shared_prefix"] is False  # GPT-Neo fails the sharing check (checked once, falls back)
        assert "segments_window" not in probes.results(model)
        assert taken["logprobs"] == ("padded" if bites else "dense_mask")
    else:  # segment attention applies the window itself, once checked on sequences that outrun it
        assert probes.results(model).get("segments_window") is (True if bites else None)
        assert taken["logprobs"] == "segments" and taken["shared_prefix"] is not bites


@pytest.mark.parametrize("family", ["gemma2", "granite", "cohere"])
def test_logit_transforms_are_folded_into_the_chunked_head(family):
    """Soft-capped or scaled logits must not force full [B, L, V] logits: the head split still holds."""
    model = _build(family)
    assert _check_exact(model)["chunked_head"] is True


def test_full_attention_span_reads_the_config():
    assert full_attention_span(_build("llama")) is None
    assert full_attention_span(_build("mistral", None)) is None
    qwen2 = tf.Qwen2ForCausalLM(
        tf.Qwen2Config(**_DECODER, **_TOKENS, use_sliding_window=False, sliding_window=16)
    )
    assert full_attention_span(qwen2) is None
    mixed = tf.Qwen2Config(**_DECODER, **_TOKENS, layer_types=["full_attention", "linear_attention"])
    assert full_attention_span(tf.Qwen2ForCausalLM(mixed)) == 0
