"""PreallocatedLayer must behave exactly like transformers' DynamicLayer, without concatenating."""

import inspect
import warnings

import pytest
import torch
from transformers.cache_utils import DynamicLayer

from cohort.fastpath.kv_cache import PreallocatedLayer, preallocated_cache
from cohort.models import cache_kwargs


def _states(rows, n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 2, n, 4, generator=g), torch.randn(rows, 2, n, 4, generator=g)


def _same(a, b):
    assert a.get_seq_length() == b.get_seq_length()
    torch.testing.assert_close(a.keys, b.keys, rtol=0, atol=0)
    torch.testing.assert_close(a.values, b.values, rtol=0, atol=0)


def test_matches_dynamic_layer_through_prefill_repeat_select_and_crop():
    ours, ref = PreallocatedLayer(capacity=9), DynamicLayer()
    k, v = _states(2, 5, 0)  # prefill of 2 prompts, 5 positions
    torch.testing.assert_close(ours.update(k, v)[0], ref.update(k, v)[0])
    ours.batch_repeat_interleave(3)
    ref.batch_repeat_interleave(3)
    _same(ours, ref)
    for step in range(3):
        k, v = _states(6 if step < 2 else 4, 1, step + 1)
        if step == 2:
            keep = torch.tensor([0, 2, 3, 5])
            ours.batch_select_indices(keep)
            ref.batch_select_indices(keep)
        out_k, out_v = ours.update(k, v)
        ref_k, ref_v = ref.update(k, v)
        torch.testing.assert_close(out_k, ref_k, rtol=0, atol=0)
        torch.testing.assert_close(out_v, ref_v, rtol=0, atol=0)
    ours.crop(-2)
    ref.crop(-2)
    _same(ours, ref)


def test_writes_in_place_and_grows_past_capacity():
    layer = PreallocatedLayer(capacity=4)
    k, v = _states(1, 3, 0)
    layer.update(k, v)
    buffer = layer._k
    layer.update(*_states(1, 1, 1))
    assert layer._k is buffer  # no new allocation while within capacity
    k2, v2 = _states(1, 3, 2)
    keys, _ = layer.update(k2, v2)  # 7 > 4: grows and keeps what was there
    assert keys.shape[-2] == 7 and layer.get_seq_length() == 7
    torch.testing.assert_close(keys[..., :3, :], k)
    torch.testing.assert_close(keys[..., 4:, :], k2)


def test_cache_replaces_only_full_attention_layers(tiny_model_dir):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_model_dir)
    cache = preallocated_cache(config, 16)
    assert cache.layers and all(isinstance(x, PreallocatedLayer) for x in cache.layers)
    lazy = preallocated_cache(None, 16)
    lazy.update(*_states(1, 2, 0), layer_idx=1)
    assert all(isinstance(x, PreallocatedLayer) for x in lazy.layers)


class _OldForward(torch.nn.Module):
    """A forward that names the cache as transformers before 5.24 did."""

    def forward(self, input_ids, past_key_values=None, use_cache=None):
        return input_ids


class _NewForward(torch.nn.Module):
    """A forward that names the cache as transformers 5.24 does (`past_key_values` deprecated)."""

    def forward(self, input_ids, cache=None, use_cache=None, **kwargs):
        return input_ids


def test_cache_keyword_follows_the_model_forward(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    marker = object()
    assert cache_kwargs(_OldForward(), marker) == {"past_key_values": marker, "use_cache": True}
    assert cache_kwargs(_NewForward(), marker) == {"cache": marker, "use_cache": True}
    # The installed transformers: whichever name its forward takes, it fills the cache handed in, in place
    # and without a deprecation warning (5.24 warns on `past_key_values`; a warning turned into an error
    # inside the once-per-model checks silently cost the shared-prefix fast path).
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    cache = preallocated_cache(model.config, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(input_ids=torch.tensor([[3, 4, 5]]), **cache_kwargs(model, cache))
    assert cache.get_seq_length() == 3


def test_a_lora_model_gets_the_keyword_of_the_model_it_wraps(tiny_model_dir):
    """peft's forward takes **kwargs and names neither keyword; the model inside decides (under transformers 5.24+
    the old name warned at every LoRA forward, and the warning failed the once-per-model fast-path checks)."""
    pytest.importorskip("peft")
    from cohort.config import LoraConfig
    from cohort.models import load_model

    model = load_model(tiny_model_dir, lora=LoraConfig(r=2, target_modules=["q_proj"]))
    named = inspect.signature(model.get_base_model().forward).parameters
    want = "cache" if "cache" in named else "past_key_values"
    marker = object()
    assert cache_kwargs(model, marker) == {want: marker, "use_cache": True}
    cache = preallocated_cache(model.config, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(input_ids=torch.tensor([[3, 4, 5]]), **cache_kwargs(model, cache))
    assert cache.get_seq_length() == 3
