"""oneDNN-packed linear layers for CPU decoding: same outputs, restored afterwards, fallbacks."""

from __future__ import annotations

import pytest
import torch
from _tiny import ALL_FAST, make_test_engine, random_prompts, tiny_model

from cohort.fastpath import FastPathError
from cohort.fastpath import packed_linear as pl
from cohort.rollout import SamplingParams

pytestmark = pytest.mark.skipif(
    pl.packing_unavailable(tiny_model()) is not None, reason="this torch build has no oneDNN packed linear"
)


def linears(model):
    return [m for m in model.modules() if type(m) is torch.nn.Linear]


def test_packed_layers_compute_the_same_and_are_restored():
    model = tiny_model(eos_bias=0.5)  # the LM head has a bias
    x = torch.randint(2, 40, (3, 7))
    with torch.inference_mode():
        ref = model(x).logits
        with pl.packed_linears(model, batch_hint=3, min_elements=0) as n:
            assert n == len(linears(model)) > 0
            assert all("forward" in m.__dict__ for m in linears(model))
            got = model(x).logits
        assert all("forward" not in m.__dict__ for m in linears(model))
        again = model(x).logits
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)
    assert torch.equal(again, ref)


def test_strided_and_batched_inputs():
    layer = torch.nn.Linear(64, 300)
    inputs = [torch.randn(64, 10).t(), torch.randn(5, 3, 64)[:, 1:2], torch.randn(4, 128)[:, ::2]]
    with torch.inference_mode():
        refs = [layer(x) for x in inputs]
        with pl.packed_linears(layer, min_elements=0) as n:
            assert n == 1
            for x, ref in zip(inputs, refs):
                assert not x.is_contiguous()
                torch.testing.assert_close(layer(x), ref, rtol=1e-4, atol=1e-5)


def test_size_threshold_and_dtype_decide_what_is_packed():
    model = tiny_model(hidden_size=48)  # q/o 48x48 (2304), k/v 24x48, MLP 96x48, head 40x48
    with torch.inference_mode(), pl.packed_linears(model, min_elements=2304) as n:
        big = [m for m in linears(model) if m.weight.numel() >= 2304]
        assert n == len(big) and 0 < n < len(linears(model))
    assert pl.packing_unavailable(model) is None
    with torch.inference_mode(), pl.packed_linears(model.to(torch.bfloat16), min_elements=0) as n:
        assert n == 0  # oneDNN packing here is for float32 weights only
    assert "no float32 nn.Linear weight" in pl.packing_unavailable(model)
    with pytest.raises(FastPathError, match="packed_weights=on, but Qwen2ForCausalLM cannot take it"):
        make_test_engine("builtin").generate(
            model, random_prompts(2, seed=1), 2, SamplingParams(max_completion_length=3)
        )


def test_restored_after_an_exception_and_nested_blocks_pack_once():
    model = tiny_model()
    with pytest.raises(KeyError), torch.inference_mode(), pl.packed_linears(model, min_elements=0) as n:
        assert n > 0
        with pl.packed_linears(model, min_elements=0) as inner:
            assert inner == 0  # already packed by the outer block
        assert all("forward" in m.__dict__ for m in linears(model))
        raise KeyError("boom")
    assert all("forward" not in m.__dict__ for m in linears(model))


def test_a_failed_packing_warns_and_leaves_the_model_plain(monkeypatch):
    model = tiny_model()
    x = torch.randint(2, 40, (2, 5))
    calls = []
    reorder = torch.ops.mkldnn._reorder_linear_weight

    def fail_on_third(weight, batch_hint):
        calls.append(weight.shape)
        if len(calls) == 3:
            raise RuntimeError("out of memory (simulated)")
        return reorder(weight, batch_hint)

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", fail_on_third)
    with torch.inference_mode():
        ref = model(x).logits
        with pytest.warns(UserWarning, match="simulated"), pl.packed_linears(model, min_elements=0) as n:
            assert n == 0
            assert all("forward" not in m.__dict__ for m in linears(model))
            got = model(x).logits
    assert torch.equal(got, ref)


def test_autograd_inside_the_block_uses_the_plain_weights():
    model = tiny_model()
    x = torch.randint(2, 40, (2, 5))
    ref_loss = model(x).logits.logsumexp(-1).sum()
    (ref_grad,) = torch.autograd.grad(ref_loss, [model.model.layers[0].mlp.up_proj.weight])
    with pl.packed_linears(model, min_elements=0) as n:
        assert n > 0
        loss = model(x).logits.logsumexp(-1).sum()
        (grad,) = torch.autograd.grad(loss, [model.model.layers[0].mlp.up_proj.weight])
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(grad, ref_grad)


def test_builtin_engine_packed_and_plain_agree():
    """Same greedy tokens and log-probs within float32 rounding; packed runs repeat bit for bit."""
    model = tiny_model(eos_bias=0.7, logit_scale=4.0)
    prompts = random_prompts(4, seed=3)
    params = SamplingParams(max_completion_length=12, greedy=True)
    batches = {}
    for packed in (True, False):
        engine = make_test_engine("builtin", fast=ALL_FAST.replace(packed_weights="on" if packed else "off"))
        batches[packed] = engine.generate(model, prompts, 3, params)
        assert batches[packed].paths["packed_weights"] is packed
    assert batches[True].completion_ids == batches[False].completion_ids
    again = make_test_engine("builtin").generate(model, prompts, 3, params)
    assert all(torch.equal(a, b) for a, b in zip(again.sampling_logprobs, batches[True].sampling_logprobs))
    for a, b in zip(batches[True].sampling_logprobs, batches[False].sampling_logprobs):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4)
    assert all("forward" not in m.__dict__ for m in linears(model))


def test_lora_base_layers_are_packed_and_the_adapter_still_applies(tmp_path):
    peft = pytest.importorskip("peft")
    model = tiny_model()
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)  # a non-zero adapter, so dropping it would show
    lora.eval()
    x = torch.randint(2, 40, (2, 6))
    with torch.inference_mode():
        ref = lora(x).logits
        with lora.disable_adapter():
            base = lora(x).logits
        with pl.packed_linears(lora, min_elements=0) as n:
            assert n >= 2 * len(model.model.layers)  # at least the wrapped q/v base layers
            got = lora(x).logits
    assert not torch.allclose(ref, base, atol=1e-3)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("max_len, packs", [(3, False), (5, False), (6, True), (9, True)])
def test_rollouts_switch_to_packed_weights_after_a_few_steps(peaky_model, max_len, packs):
    """auto: only a rollout still going after pack_after_steps decode steps, with room for more than
    pack_min_remaining tokens, packs."""
    fast = ALL_FAST.replace(
        packed_weights="auto", pack_after_steps=3, pack_min_remaining=2, pack_min_elements=0
    )
    engine = make_test_engine("builtin", fast=fast)
    batch = engine.generate(
        peaky_model, random_prompts(2, seed=1), 3, SamplingParams(max_completion_length=max_len)
    )
    assert all(len(c) == max_len for c in batch.completion_ids)  # EOS is never sampled by this model
    # Token 0 comes from the prefill and token t from decode step t: step 3 packs when max_len - 3 > 2.
    assert batch.paths["packed_weights"] is packs
    assert all("forward" not in m.__dict__ for m in linears(peaky_model))


def test_under_cpu_autocast_packing_is_refused_and_the_build_checks_are_unaffected():
    """Packed weights compute in float32 whatever autocast says; a once-per-process check of the torch build (the
    packed linear's) must not take a caller's autocast for a broken build (it compared float32 with bf16 and said
    so for good)."""
    from cohort.fastpath import FastConfig, probes

    gen = torch.Generator().manual_seed(0)
    w, x = torch.randn(64, 48, generator=gen), torch.randn(3, 48, generator=gen)

    def plain():  # float32, or bf16 if the caller's autocast reached it
        return torch.nn.functional.linear(x, w)

    def reference():
        return torch.nn.functional.linear(x.double(), w.double()).float()

    model = tiny_model()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert probes.probe(None, "float32_linear_under_a_callers_autocast", plain, reference)
        assert "autocast is on for the CPU" in pl.packing_unavailable(model)
        engine = make_test_engine("builtin", fast=FastConfig(packed_weights="on"))
        with pytest.raises(FastPathError, match="fast.packed_weights=on.*autocast is on for the CPU"):
            with torch.inference_mode():
                engine.generate(model, random_prompts(2, seed=1), 2, SamplingParams(max_completion_length=4))
    assert probes.results(None)["float32_linear_under_a_callers_autocast"] is True
    assert pl.packing_unavailable(model) is None


@pytest.mark.parametrize("greedy", [True, False])
def test_multi_turn_episodes_decode_through_packed_weights_and_sample_the_same(tmp_path, greedy):
    """The episode loop packs once for its batch (fast.packed_weights, CPU): the same turns as plain matmuls, on a
    tool model whose turns end after ~11 tokens, playing a guessing game of three turns."""
    from _tiny import build_tool_model
    from episode_envs import small_game
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from cohort.config import EpisodeConfig
    from cohort.episodes.multiturn import EpisodeGeneration
    from cohort.episodes.spec import build_episode_spec
    from cohort.episodes.templates import render_prompt
    from cohort.fastpath import FastConfig

    play = [{"role": "user", "content": "Play."}]
    folder = build_tool_model(tmp_path / "model")
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    spec = build_episode_spec(EpisodeConfig(), environment_factory=small_game)
    batches = {}
    for setting in ("on", "off"):
        loop = EpisodeGeneration(
            spec, model, tok, end_of_turn_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id,
            fast=FastConfig(packed_weights=setting),
        )  # fmt: skip
        try:
            batches[setting] = loop.generate(
                [render_prompt(tok, play)] * 2,
                3,
                SamplingParams(max_completion_length=90, greedy=greedy, temperature=0.9),
                torch.Generator().manual_seed(4),
                rows=[{"prompt": play}] * 2,
            )
        finally:
            loop.close()
    on, off = batches["on"], batches["off"]
    assert on.paths["packed_weights"] is True and off.paths["packed_weights"] is False
    assert on.completion_ids == off.completion_ids
    if not greedy:  # the game answered and the policy played on (greedy, its first guess ends the game)
        assert max(len(r.messages) for r in on.episodes) >= 3
    for a, b in zip(on.sampling_logprobs, off.sampling_logprobs):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4)
    assert all("forward" not in m.__dict__ for m in linears(model))
