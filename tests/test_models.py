"""Tiny model / tokenizer factory, loading through the Auto classes, dtype, LoRA and error messages."""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from cohort.config import ConfigError, LoraConfig
from cohort.models import (
    CHAR_VOCAB,
    TINY_SIZES,
    adapter_base,
    build_tiny_model,
    build_tiny_tokenizer,
    count_parameters,
    fix_adapter_base_path,
    is_adapter_folder,
    load_model,
    load_tokenizer,
    resolve_dtype,
    save_merged,
    stop_token_ids,
)

ROUND_TRIP = [
    "12+34=46",
    "Hi there , a b  c",  # the default decode cleanup would turn " ," into ","
    "3 + 4 * 2 - 5 = 6\nnext line\n\n",
    "<think> 2 and 2 </think><answer>4</answer>",
    "  leading and trailing spaces  ",
    "tab\tand unicode é ü 你好",  # outside CHAR_VOCAB: still lossless through UTF-8 bytes
    "don't ? ! . ; : ' \" ` ~ ^ | \\ { } [ ] ( )",
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture(scope="module")
def tok(tiny_dir):
    return load_tokenizer(tiny_dir)


def test_auto_tokenizer_round_trip_matches_original(tiny_dir, tok):
    """Guards the bug DESIGN.md names: AutoTokenizer picks Qwen2Tokenizer for a qwen2 folder and
    a plain char vocabulary then loses every space."""
    original = build_tiny_tokenizer()
    auto = AutoTokenizer.from_pretrained(tiny_dir)
    fast = PreTrainedTokenizerFast.from_pretrained(tiny_dir)
    for text in ROUND_TRIP:
        ids = original(text, add_special_tokens=False)["input_ids"]
        assert original.decode(ids) == text
        for loaded in (auto, fast, tok):
            assert loaded(text, add_special_tokens=False)["input_ids"] == ids, (type(loaded).__name__, text)
            assert loaded.decode(ids) == text


def test_char_vocab_is_one_token_per_char_with_lowest_ids(tok):
    ids = [tok(c, add_special_tokens=False)["input_ids"] for c in CHAR_VOCAB]
    assert all(len(i) == 1 for i in ids)
    flat = [i[0] for i in ids]
    assert flat == list(range(2, 2 + len(CHAR_VOCAB)))  # after <|pad|>=0 and <|endoftext|>=1


def test_special_tokens_are_single_ids_and_skipped_on_decode(tiny_dir, tok):
    assert (tok.pad_token_id, tok.eos_token_id) == (0, 1)
    assert tok(tok.eos_token, add_special_tokens=False)["input_ids"] == [1]
    assert tok(tok.pad_token, add_special_tokens=False)["input_ids"] == [0]
    ids = tok("7+8=15", add_special_tokens=False)["input_ids"]
    assert tok.decode(ids + [1, 0, 0], skip_special_tokens=True) == "7+8=15"
    assert tok.decode(ids + [1], skip_special_tokens=False) == "7+8=15<|endoftext|>"
    assert tok("12", add_special_tokens=True)["input_ids"] == tok("12", add_special_tokens=False)["input_ids"]
    config = json.loads((tiny_dir / "config.json").read_text())
    assert (config["eos_token_id"], config["pad_token_id"], config["bos_token_id"]) == (1, 0, None)
    assert tok.padding_side == "left"
    tokenizer_config = json.loads((tiny_dir / "tokenizer_config.json").read_text())
    assert tokenizer_config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert tokenizer_config["clean_up_tokenization_spaces"] is False


def test_optional_bos_token(tmp_path):
    d = build_tiny_model(tmp_path, add_bos=True)
    tok = load_tokenizer(d)
    assert tok.bos_token == "<|bos|>" and tok.bos_token_id == 2
    assert tok.decode([2, 5, 1], skip_special_tokens=True) == tok.decode([5])
    # prepended when special tokens are added, like Llama's tokenizers, by every loader
    plain = build_tiny_tokenizer(add_bos=True)("12", add_special_tokens=False)["input_ids"]
    for loaded in (tok, AutoTokenizer.from_pretrained(d), PreTrainedTokenizerFast.from_pretrained(d)):
        assert loaded("12")["input_ids"] == [2, *plain]
        assert loaded("12", add_special_tokens=False)["input_ids"] == plain


def test_chat_template(tok):
    text = tok.apply_chat_template(
        [{"role": "user", "content": "1+2="}], tokenize=False, add_generation_prompt=True
    )
    assert text == "User: 1+2=\nAssistant: "
    full = tok.apply_chat_template(
        [{"role": "user", "content": "1+2="}, {"role": "assistant", "content": "3"}], tokenize=False
    )
    assert full == "User: 1+2=\nAssistant: 3<|endoftext|>\n"


def test_tiny_model_loads_back_and_generates(tiny_dir, tok, tmp_path):
    _, info = AutoModelForCausalLM.from_pretrained(tiny_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    model = load_model(tiny_dir)
    assert model.config.model_type == "qwen2" and not model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    tied = load_model(
        build_tiny_model(tmp_path / "tied", hidden_size=16, num_layers=1, tie_word_embeddings=True)
    )
    assert tied.lm_head.weight.data_ptr() == tied.model.embed_tokens.weight.data_ptr()
    assert model.config._attn_implementation == "sdpa"
    assert model.config.vocab_size == len(tok) == 258
    ids = tok("12+34=", add_special_tokens=False)["input_ids"]
    out = model.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False)
    assert out.shape == (1, len(ids) + 4) and out[0, : len(ids)].tolist() == ids
    assert 0 <= int(out.max()) < 258


def test_seed_makes_weights_reproducible(tmp_path, tiny_dir):
    same = load_model(build_tiny_model(tmp_path / "same", seed=0)).state_dict()
    other = load_model(build_tiny_model(tmp_path / "other", seed=1)).state_dict()
    ref = load_model(tiny_dir).state_dict()
    assert all(torch.equal(ref[k], same[k]) for k in ref)
    assert not torch.equal(ref["model.embed_tokens.weight"], other["model.embed_tokens.weight"])


@pytest.mark.parametrize("name, low, high", [("0.5m", 0.4e6, 0.6e6), ("14m", 12e6, 16e6)])
def test_size_presets_parameter_count(tmp_path, name, low, high):
    model = load_model(build_tiny_model(tmp_path, **TINY_SIZES[name]))
    assert low <= count_parameters(model) <= high


def test_wide_vocab_pads_embedding_keeps_tokenizer(tmp_path):
    d = build_tiny_model(tmp_path, vocab_size=151936, hidden_size=16, num_layers=1, num_heads=2)
    model, tok = load_model(d), load_tokenizer(d)
    assert model.model.embed_tokens.weight.shape == (151936, 16)
    assert len(tok) == 258 and tok.decode(tok("1 2")["input_ids"]) == "1 2"


def test_build_rejects_bad_sizes(tmp_path):
    with pytest.raises(ValueError, match="smaller than the tiny tokenizer's 258"):
        build_tiny_model(tmp_path, vocab_size=100)
    with pytest.raises(ValueError, match="divisible by num_heads=5"):
        build_tiny_model(tmp_path, hidden_size=64, num_heads=5)


def test_dtype_device_and_attention_override(tiny_dir):
    model = load_model(tiny_dir, dtype="bfloat16", attn_implementation="eager")
    assert next(model.parameters()).dtype == torch.bfloat16
    assert model.config._attn_implementation == "eager"
    assert resolve_dtype("auto") == "auto" and resolve_dtype(torch.float16) is torch.float16
    with pytest.raises(ValueError, match=r"dtype='float8'.*'bfloat16'"):
        load_model(tiny_dir, dtype="float8")
    with pytest.raises(ValueError, match="not a valid torch device"):
        load_model(tiny_dir, device="gpu0")


def test_stop_token_ids_join_tokenizer_and_generation_config(tiny_dir, tok):
    model = load_model(tiny_dir)
    assert stop_token_ids(model, tok) == ([tok.eos_token_id], tok.pad_token_id)
    model.generation_config.eos_token_id = [7, tok.eos_token_id]  # e.g. an instruct model's end-of-turn
    assert stop_token_ids(model, tok) == ([tok.eos_token_id, 7], tok.pad_token_id)
    no_pad = types.SimpleNamespace(eos_token_id=5, pad_token_id=None)
    assert stop_token_ids(None, no_pad) == ([5], 5)
    with pytest.raises(ValueError, match="neither the tokenizer nor the model's generation_config"):
        stop_token_ids(None, types.SimpleNamespace(eos_token_id=None, pad_token_id=None))


def test_unknown_local_path_error_suggests_demo(tmp_path):
    for bad in ("./no/such/model", str(tmp_path / "missing")):
        for loader in (load_model, load_tokenizer):
            with pytest.raises(ValueError, match="neither a local model folder nor.*cohort demo"):
                loader(bad)
    with pytest.raises(ValueError, match="holds no config.json"):
        load_model(tmp_path)
    with pytest.raises(ValueError, match="holds no tokenizer_config.json"):
        load_tokenizer(tmp_path)
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="is a file, not a model folder"):
        load_model(tmp_path / "weights.bin")


@pytest.fixture
def no_downloads(monkeypatch):
    """Records the sources given to from_pretrained, which then fails as an unreachable Hub would; the Hub's
    offline switch is off, so a check that relied on it would try the network."""
    import huggingface_hub.constants

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    sources: list[str] = []

    def from_pretrained(source, *args, **kwargs):
        sources.append(str(source))
        raise OSError(f"cannot reach the Hub for {source}")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", from_pretrained)
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", from_pretrained)
    return sources


def test_local_looking_missing_paths_fail_without_the_hub(tmp_path, monkeypatch, no_downloads):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "tiny").mkdir(parents=True)
    for bad in (
        "runs/tiny-typo",
        "./tiny-typo",
        "../tiny-typo",
        str(tmp_path / "tiny-typo"),
        "~/cohort-no-such-model",
    ):
        for loader in (load_model, load_tokenizer):
            with pytest.raises(ValueError, match="neither a local model folder nor"):
                loader(bad)
    with pytest.raises(ValueError, match=r"no such folder; 'runs' exists and holds \['tiny'\]"):
        load_model("runs/tiny-typo")
    assert no_downloads == []  # decided from the filesystem alone
    # a Hub id whose organisation is no folder here still goes to the Hub
    with pytest.raises(ValueError, match="cannot reach the Hub"):
        load_model("Qwen/Qwen2.5-0.5B")
    with pytest.raises(ValueError, match="cannot reach the Hub"):
        load_tokenizer("Qwen/Qwen2.5-0.5B")
    assert no_downloads == ["Qwen/Qwen2.5-0.5B"] * 2
    (tmp_path / "Qwen").mkdir()  # ... unless a folder of that name is here: then it is a path, and says so
    with pytest.raises(ValueError, match="run from another folder"):
        load_model("Qwen/Qwen2.5-0.5B")
    assert len(no_downloads) == 2


def test_local_folders_load_by_absolute_path(tmp_path, monkeypatch, tiny_dir):
    """What records the source (config._name_or_path, peft's base_model_name_or_path) resolves from elsewhere."""
    monkeypatch.chdir(tiny_dir.parent)
    model = load_model(tiny_dir.name)
    assert model.name_or_path == str(tiny_dir.resolve())


def test_unreachable_hub_name_error(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # fail fast, no retries
    with pytest.raises(ValueError, match="neither a local model folder nor a model that could be downloaded"):
        load_model("cohort-test-nonexistent/model-xyz")
    with pytest.raises(ValueError, match="cohort demo"):
        load_tokenizer("cohort-test-nonexistent/model-xyz")


def test_lora_trains_only_adapters_and_starts_equal_to_base(tiny_dir):
    base = load_model(tiny_dir)
    model = load_model(tiny_dir, lora=LoraConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj"]))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    # 2 layers x (q_proj, v_proj) x (A: 4x64 + B: 64x4)
    assert count_parameters(model, trainable=True) == 2 * 2 * (4 * 64 + 64 * 4)
    ids = torch.tensor([[5, 6, 76, 7, 8, 84]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, base(ids).logits)  # LoRA's B starts at zero


def test_lora_on_gpt2_style_conv1d_layers(tmp_path):
    """GPT-2's projections are transformers' Conv1D, not nn.Linear: they are named in the error and adaptable."""
    pytest.importorskip("peft")
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(
        GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=64, vocab_size=64)
    ).save_pretrained(tmp_path / "gpt2")
    with pytest.raises(ValueError, match=r"named \['c_attn', 'c_fc', 'c_proj', 'lm_head'\]"):
        load_model(tmp_path / "gpt2", lora=LoraConfig())
    model = load_model(tmp_path / "gpt2", lora=LoraConfig(r=2, target_modules=["c_attn", "c_proj"]))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)


def test_lora_errors(tiny_dir, monkeypatch):
    with pytest.raises(ValueError, match=r"match no Linear layer.*'q_proj'"):
        load_model(tiny_dir, lora=LoraConfig(target_modules=["query"]))
    for bad, fragment in (
        ({"r": 0}, "model.lora.r=0 must be a positive integer"),
        ({"alpha": 0}, "model.lora.alpha=0 must be > 0"),
        ({"dropout": 1.0}, r"model.lora.dropout=1.0 must be in \[0, 1\)"),
        ({"target_modules": "q_proj"}, "must be a non-empty list"),
        ({"target_modules": []}, "must be a non-empty list"),
    ):
        with pytest.raises(ConfigError, match=fragment):
            load_model("never-loaded/model", lora=LoraConfig(**bad))  # checked before the model loads
    monkeypatch.setitem(sys.modules, "peft", None)  # makes `import peft` raise ImportError
    with pytest.raises(ImportError, match=r"pip install 'cohort\[peft\]'"):
        load_model(tiny_dir, lora=LoraConfig())


def test_bound_heap_fixes_glibc_threshold_or_says_it_cannot():
    import sys

    from cohort.fastpath.memory import bound_heap

    assert bound_heap(0) is False  # 0 = leave glibc's dynamic threshold alone
    applied = bound_heap(16)
    if sys.platform.startswith("linux"):
        import platform

        assert applied is (platform.libc_ver()[0] == "glibc")


def _randomise_adapter(model, seed: int = 0) -> None:
    """Gives every LoRA weight a random value (B starts at zero, which would make the adapter a no-op)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def test_lora_adapter_round_trip_and_merge(tmp_path, monkeypatch):
    pytest.importorskip("peft")
    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    work.mkdir()
    elsewhere.mkdir()
    monkeypatch.chdir(work)
    build_tiny_model("base", hidden_size=32, num_layers=2, num_heads=4, seed=3)  # a relative folder
    tok = load_tokenizer("base")
    model = load_model("base", lora=LoraConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj"])).eval()
    _randomise_adapter(model)
    model.save_pretrained("adapter")
    tok.save_pretrained("adapter-with-tokenizer")
    model.save_pretrained("adapter-with-tokenizer")
    assert is_adapter_folder("adapter") and not is_adapter_folder("base")
    assert adapter_base("adapter") == str(work / "base")  # recorded absolute, not as "base"
    ids = torch.tensor([tok("12+34=46")["input_ids"]])
    with torch.no_grad():
        expected = model(ids).logits
        assert not torch.allclose(expected, load_model("base")(ids).logits)

    monkeypatch.chdir(elsewhere)
    for folder in (work / "adapter", work / "adapter-with-tokenizer"):
        loaded = load_model(folder)
        assert not any(p.requires_grad for p in loaded.parameters()) and not loaded.training
        with torch.no_grad():
            assert torch.equal(loaded(ids).logits, expected)
        assert load_tokenizer(folder)("12+34=46")["input_ids"] == ids[0].tolist()
    with pytest.raises(ValueError, match="cannot be added on top of it"):
        load_model(work / "adapter", lora=LoraConfig(r=2, target_modules=["q_proj"]))

    merged = save_merged(model, tok, tmp_path / "merged")
    assert not (merged / "adapter_config.json").exists() and (merged / "config.json").is_file()
    plain = AutoModelForCausalLM.from_pretrained(merged)  # plain transformers, no peft
    assert type(plain).__name__ == "Qwen2ForCausalLM"
    assert AutoTokenizer.from_pretrained(merged)("12+34=46")["input_ids"] == ids[0].tolist()
    with torch.no_grad():
        torch.testing.assert_close(plain(ids).logits, expected, rtol=1e-5, atol=1e-5)
        assert torch.equal(model(ids).logits, expected)  # the training model keeps its adapter
    assert any(p.requires_grad for p in model.parameters())
    plain_again = save_merged(plain, None, tmp_path / "plain")  # a model without an adapter saves as it is
    assert (plain_again / "config.json").is_file() and not (plain_again / "tokenizer_config.json").exists()


def test_fix_adapter_base_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "base").mkdir(parents=True)
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    config = adapter / "adapter_config.json"
    config.write_text(json.dumps({"base_model_name_or_path": "runs/base", "r": 4, "peft_type": "LORA"}))
    assert fix_adapter_base_path(adapter) == str(tmp_path / "runs" / "base")
    saved = json.loads(config.read_text())
    assert saved == {"base_model_name_or_path": str(tmp_path / "runs" / "base"), "r": 4, "peft_type": "LORA"}
    assert fix_adapter_base_path(adapter) == saved["base_model_name_or_path"]  # already absolute: unchanged
    config.write_text(json.dumps({"base_model_name_or_path": "Qwen/Qwen2.5-0.5B"}))
    assert fix_adapter_base_path(adapter) == "Qwen/Qwen2.5-0.5B"  # a Hub name stays
    assert fix_adapter_base_path(tmp_path / "runs") is None  # no adapter there
    config.write_text(json.dumps({"r": 4}))
    with pytest.raises(ValueError, match="names no base model"):
        fix_adapter_base_path(adapter)


def test_adapter_with_a_base_that_does_not_resolve(tmp_path, monkeypatch):
    pytest.importorskip("peft")
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "./runs/base"}))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        ValueError, match=r"neither a local model folder.*base_model_name_or_path.*fix_adapter_base_path"
    ):
        load_model(adapter)
