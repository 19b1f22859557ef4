"""Prompt encoding: plain text with the tokenizer's own special tokens, conversations through the chat template
(whose BOS is not doubled), template variables passed through."""

from __future__ import annotations

import pytest

from cohort.data import as_completions, encode_prompts, is_conversational, make_task, prompt_text
from cohort.models import TINY_CHAT_TEMPLATE, build_tiny_tokenizer, load_tokenizer

CHAT = [{"role": "user", "content": "1+2="}]
BOS = "<|bos|>"


@pytest.fixture(scope="module")
def tok():
    """The tiny tokenizer with a BOS that it prepends itself, like Llama's (its template writes none)."""
    return build_tiny_tokenizer(add_bos=True)


@pytest.fixture(scope="module")
def bos_template_tok():
    """A BOS-adding tokenizer whose chat template also writes the BOS, like Llama 3's and Gemma's."""
    tokenizer = build_tiny_tokenizer(add_bos=True)
    tokenizer.chat_template = "{{ bos_token }}" + TINY_CHAT_TEMPLATE
    return tokenizer


def test_plain_text_gets_the_tokenizers_bos_once(tok):
    bos = tok.bos_token_id
    ids = encode_prompts(tok, ["12+34=", "7+8="])
    assert ids == [
        [bos, *tok("12+34=", add_special_tokens=False)["input_ids"]],
        [bos, *tok("7+8=", add_special_tokens=False)["input_ids"]],
    ]
    assert all(row.count(bos) == 1 and row[0] == bos for row in ids)
    assert tok.decode(ids[0], skip_special_tokens=True) == "12+34="
    # a prompt that already starts with the BOS text keeps a single BOS
    assert encode_prompts(tok, [BOS + "12+34="]) == ids[:1]


def test_chat_template_bos_is_not_doubled(tok, bos_template_tok):
    bos = bos_template_tok.bos_token_id
    (ids,) = encode_prompts(bos_template_tok, [CHAT])
    assert ids[0] == bos and ids.count(bos) == 1
    assert bos_template_tok.decode(ids) == BOS + "User: 1+2=\nAssistant: "
    assert encode_prompts(bos_template_tok, ["1+2="], chat_template=True) == [ids]
    # what transformers itself gives for the templated prompt
    text = bos_template_tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert ids == bos_template_tok(text, add_special_tokens=False)["input_ids"]
    # a template without a BOS: the chat prompt has none either (add_special_tokens=False), as in TRL
    (plain_template,) = encode_prompts(tok, [CHAT])
    assert tok.bos_token_id not in plain_template


def test_demo_prompts_encode_as_before(tiny_model_dir):
    """The demo's tokenizer adds no special tokens, so its prompts encode exactly as with add_special_tokens=False
    (what encode_prompts did before it followed the tokenizer's defaults)."""
    tokenizer = load_tokenizer(tiny_model_dir)
    assert tokenizer.bos_token_id is None
    for task in ("addition", "multistep"):
        train, held = make_task(task, n_train=4000, n_eval=200, seed=1234)  # the demo's split
        prompts = [r["prompt"] for r in train + held]
        assert encode_prompts(tokenizer, prompts) == tokenizer(prompts, add_special_tokens=False)["input_ids"]
    chat_ids = encode_prompts(tokenizer, [CHAT])
    text = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert chat_ids == [tokenizer(text, add_special_tokens=False)["input_ids"]]


def test_conversational_prompts_use_the_template(tok):
    (ids,) = encode_prompts(tok, [CHAT])
    assert tok.decode(ids) == "User: 1+2=\nAssistant: "
    mixed = encode_prompts(tok, ["1+2=", CHAT])
    assert tok.decode(mixed[0], skip_special_tokens=True) == "1+2=" and mixed[1] == ids


def test_chat_template_true_wraps_plain_text(tok):
    assert prompt_text(tok, "1+2=", chat_template=True) == "User: 1+2=\nAssistant: "
    assert encode_prompts(tok, ["1+2="], chat_template=True) == encode_prompts(tok, [CHAT])


def test_chat_template_kwargs_reach_the_template():
    tokenizer = build_tiny_tokenizer()
    switch = "{% if enable_thinking is defined and not enable_thinking %}/no_think {% endif %}"
    tokenizer.chat_template = switch + TINY_CHAT_TEMPLATE
    assert prompt_text(tokenizer, CHAT) == "User: 1+2=\nAssistant: "
    off = {"enable_thinking": False}
    assert prompt_text(tokenizer, CHAT, chat_template_kwargs=off) == "/no_think User: 1+2=\nAssistant: "
    (ids,) = encode_prompts(tokenizer, [CHAT], chat_template_kwargs=off)
    assert tokenizer.decode(ids) == "/no_think User: 1+2=\nAssistant: "
    wrapped = prompt_text(tokenizer, "1+2=", chat_template=True, chat_template_kwargs=off)
    assert wrapped.startswith("/no_think")
    # plain text that the template does not format is unaffected
    unformatted = encode_prompts(tokenizer, ["1+2="], chat_template_kwargs=off)
    assert unformatted == encode_prompts(tokenizer, ["1+2="])
    assert prompt_text(tokenizer, CHAT, chat_template_kwargs={}) == prompt_text(tokenizer, CHAT)
    with pytest.raises(TypeError, match="chat_template_kwargs must be a dict"):
        encode_prompts(tokenizer, [CHAT], chat_template_kwargs=["enable_thinking"])
    with pytest.raises(ValueError, match=r"may not set \['add_generation_prompt'\]"):
        prompt_text(tokenizer, CHAT, chat_template_kwargs={"add_generation_prompt": False})


def test_errors(tok):
    with pytest.raises(ValueError, match="chat_template=False but the prompt is a list of messages"):
        encode_prompts(tok, [CHAT], chat_template=False)
    with pytest.raises(ValueError, match="must be None"):
        prompt_text(tok, "x", chat_template="yes")
    with pytest.raises(TypeError, match="got int"):
        encode_prompts(tok, [3])
    no_template = build_tiny_tokenizer()
    no_template.chat_template = None
    with pytest.raises(ValueError, match="has no chat template"):
        encode_prompts(no_template, [CHAT])
    with pytest.raises(ValueError, match="prompt 1 .* encodes to no tokens"):
        encode_prompts(no_template, ["1+1=", ""])
    assert encode_prompts(tok, [""]) == [[tok.bos_token_id]]  # the BOS alone is a prompt
    assert encode_prompts(tok, []) == []


def test_completions_take_the_format_of_their_prompt():
    assert as_completions(("3", "4"), "1+2=") == ["3", "4"]
    assert as_completions(["3"], CHAT) == [[{"role": "assistant", "content": "3"}]]
    assert all(is_conversational(c) for c in as_completions(["3", ""], CHAT))
