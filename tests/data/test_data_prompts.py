"""Prompt encoding: plain text as written, conversations through the chat template."""

from __future__ import annotations

import pytest

from cohort.data import as_completions, encode_prompts, is_conversational, prompt_text
from cohort.models import build_tiny_tokenizer

CHAT = [{"role": "user", "content": "1+2="}]


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer(add_bos=True)


def test_plain_text_is_encoded_without_special_tokens(tok):
    ids = encode_prompts(tok, ["12+34=", "7+8="])
    assert ids == [
        tok("12+34=", add_special_tokens=False)["input_ids"],
        tok("7+8=", add_special_tokens=False)["input_ids"],
    ]
    assert all(tok.bos_token_id not in row for row in ids)
    assert tok.decode(ids[0]) == "12+34="


def test_conversational_prompts_use_the_template(tok):
    (ids,) = encode_prompts(tok, [CHAT])
    assert tok.decode(ids) == "User: 1+2=\nAssistant: "
    mixed = encode_prompts(tok, ["1+2=", CHAT])
    assert tok.decode(mixed[0]) == "1+2=" and mixed[1] == ids


def test_chat_template_true_wraps_plain_text(tok):
    assert prompt_text(tok, "1+2=", chat_template=True) == "User: 1+2=\nAssistant: "
    assert encode_prompts(tok, ["1+2="], chat_template=True) == encode_prompts(tok, [CHAT])


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
        encode_prompts(tok, ["1+1=", ""])
    assert encode_prompts(tok, []) == []


def test_completions_take_the_format_of_their_prompt():
    assert as_completions(("3", "4"), "1+2=") == ["3", "4"]
    assert as_completions(["3"], CHAT) == [[{"role": "assistant", "content": "3"}]]
    assert all(is_conversational(c) for c in as_completions(["3", ""], CHAT))
