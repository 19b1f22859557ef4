"""cohort.fastpath.no_mask: unmasked padded rows hand transformers the mask mapping {"full_attention": None} where the
decoder takes it, so that transformers neither reads a device value on the host to look for packed sequences at
every forward nor, under torch.compile, builds a full [R, 1, L, L] mask (which rules out sdpa's causal kernels)."""

from __future__ import annotations

import pytest
import torch
from _compile import Recorder
from _tiny import tiny_model
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from cohort.fastpath import compiled
from cohort.fastpath.no_mask import no_mask
from cohort.rollout.graph import HostSyncCheck, HostSyncError

IDS = torch.tensor([[3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 2, 2]])
POS = torch.arange(6).expand(2, 6)


def _reads_the_host(decoder, mask) -> bool:
    try:
        with torch.no_grad(), HostSyncCheck():
            decoder(input_ids=IDS, attention_mask=mask, position_ids=POS, use_cache=False)
    except HostSyncError:
        return True
    return False


def test_a_full_attention_decoder_takes_the_mapping_and_no_longer_waits_for_the_device():
    model = tiny_model(seed=1)
    for decoder in (model, model.model):
        mask = no_mask(decoder)
        assert mask == {"full_attention": None}
        assert _reads_the_host(decoder, None)  # transformers' packed-sequence check, at every forward
        assert not _reads_the_host(decoder, mask)
        with torch.no_grad():
            plain = decoder(input_ids=IDS, position_ids=POS, use_cache=False)[0]
            mapped = decoder(input_ids=IDS, attention_mask=mask, position_ids=POS, use_cache=False)[0]
        assert torch.equal(plain, mapped)


def test_decoders_without_the_mapping_or_with_other_layer_kinds_keep_none():
    llama = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64,
        )
    ).eval()  # fmt: skip
    assert no_mask(llama) is None  # its forward hands the argument to create_causal_mask
    sliding = Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, use_sliding_window=True, sliding_window=4,
            max_window_layers=1,
        )
    ).eval()  # fmt: skip
    assert "sliding_attention" in sliding.config.layer_types
    assert no_mask(sliding) is None  # None would widen the sliding layers' window
    # eager attention applies only the mask it is handed: None in the mapping would drop the causal mask (the
    # check sees other hidden states)
    assert no_mask(tiny_model(seed=1, attn_implementation="eager")) is None


def test_the_compiled_forward_hands_sdpa_no_mask_and_its_causal_flag(monkeypatch):
    """What compile_update traces: with the mapping, sdpa gets attn_mask=None and is_causal=True (its causal
    kernels); with None, transformers cannot decide the packed-sequence check while tracing and builds a mask."""
    decoder = tiny_model(seed=1).model
    seen: list[tuple[bool, bool]] = []

    def backend(gm, example_inputs):
        for node in gm.graph.nodes:
            if node.op == "call_function" and "scaled_dot_product_attention" in str(node.target):
                seen.append((node.kwargs.get("attn_mask") is None, bool(node.kwargs.get("is_causal", False))))
        return Recorder()(gm, example_inputs)

    monkeypatch.setattr(compiled, "BACKEND", backend)
    torch._dynamo.reset()
    with torch.no_grad():
        got = compiled.hidden_states(decoder, IDS, POS, no_mask(decoder))
        want = decoder(input_ids=IDS, position_ids=POS, use_cache=False).last_hidden_state
    assert seen and all(s == (True, True) for s in seen), seen
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    seen.clear()
    torch._dynamo.reset()
    with torch.no_grad():
        compiled.hidden_states(decoder, IDS, POS, None)
    assert seen and all(s == (False, False) for s in seen), seen  # the mask the mapping avoids
    torch._dynamo.reset()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="watches for host syncs on a CUDA GPU: needs one")
def test_on_a_gpu_the_mapping_keeps_the_forward_from_waiting_for_the_device():
    decoder = tiny_model(seed=1).model.cuda()
    ids, pos = IDS.cuda(), POS.cuda()
    mask = no_mask(decoder)
    assert mask == {"full_attention": None}
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.no_grad():
            decoder(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False)
            with pytest.raises(RuntimeError, match="synchroniz"):
                decoder(input_ids=ids, attention_mask=None, position_ids=pos, use_cache=False)
    finally:
        torch.cuda.set_sync_debug_mode(previous)
