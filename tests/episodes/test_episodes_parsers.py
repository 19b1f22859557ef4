"""cohort.episodes.parsers: each family's calls as its chat template renders them and as models write them, the
three cases (no call, complete calls, malformed or unclosed), parser_for's choice, and transformers' response
parsing on whichever of its two APIs the installed transformers has."""

from __future__ import annotations

import inspect

import pytest

from cohort.episodes import (
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    ParsedResponse,
    ToolCall,
    TransformersParser,
    install_tool_format,
    parser_for,
    template_family,
)
from cohort.errors import ConfigError
from cohort.models import TINY_CHAT_TEMPLATE, build_tiny_tokenizer

HERMES = HermesParser()
LLAMA = Llama3JsonParser()
MISTRAL = MistralParser()


def _calls(parsed: ParsedResponse) -> list[tuple[str, dict]]:
    return [(call.name, call.arguments) for call in parsed.calls]


# ---------------------------------------------------------------------------------------------
# Hermes / Qwen
# ---------------------------------------------------------------------------------------------


def test_hermes_no_call():
    parsed = HERMES.parse("The answer is 6.<|im_end|>")
    assert parsed == ParsedResponse(content="The answer is 6.")
    assert parsed.status == "none" and parsed.message() == {
        "role": "assistant",
        "content": "The answer is 6.",
    }


def test_hermes_several_calls_after_text():
    text = (
        'Let me compute both.\n<tool_call>\n{"name": "multiply", "arguments": {"a": 2, "b": 3}}\n</tool_call>\n'
        '<tool_call>\n{"name": "search", "arguments": {"query": "x"}}\n</tool_call><|im_end|>'
    )
    parsed = HERMES.parse(text)
    assert parsed.status == "calls" and parsed.error is None
    assert parsed.content == "Let me compute both."
    assert _calls(parsed) == [("multiply", {"a": 2, "b": 3}), ("search", {"query": "x"})]
    assert (
        parsed.calls[0].raw
        == '<tool_call>\n{"name": "multiply", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    )
    assert parsed.message() == {
        "role": "assistant",
        "content": "Let me compute both.",
        "tool_calls": [
            {"type": "function", "function": {"name": "multiply", "arguments": {"a": 2, "b": 3}}},
            {"type": "function", "function": {"name": "search", "arguments": {"query": "x"}}},
        ],
    }


def test_hermes_argument_variants():
    no_arguments = HERMES.parse('<tool_call>{"name": "now"}</tool_call>')
    assert _calls(no_arguments) == [("now", {})]
    as_string = HERMES.parse('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>')
    assert _calls(as_string) == [("f", {"a": 1})]
    openai_shape = HERMES.parse(
        '<tool_call>{"type": "function", "function": {"name": "f", "arguments": {}}}</tool_call>'
    )
    assert _calls(openai_shape) == [("f", {})]


def test_a_tag_inside_the_reasoning_is_not_a_call():
    text = "<think>I could write <tool_call> here.</think>\n\nNo tool needed: 6."
    parsed = HERMES.parse(text)
    assert parsed.status == "none" and parsed.content == text
    with_call = HERMES.parse(text + '\n<tool_call>{"name": "f", "arguments": {}}</tool_call>')
    assert with_call.status == "calls" and with_call.content == text


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ('<tool_call>\n{"name": "multiply", "arguments": {"a": 2, "b": 3}}\n', "never closed"),
        ('<tool_call>\n{"name": "multiply", "arguments": {"a": 2, "b": 3}}<|im_end|>', "never closed"),
        (
            '<tool_call>{"name": "f", "arguments": {}}\n<tool_call>{"name": "g", "arguments": {}}</tool_call>',
            "never closed",
        ),
        ('<tool_call>\n{"name": "multiply", "arguments": {"a": 2</tool_call>', "unclosed"),
        ('<tool_call>\n{"name": multiply}\n</tool_call>', "invalid"),
        ('<tool_call>{"arguments": {"a": 1}}</tool_call>', "no 'name'"),
        ('<tool_call>{"name": "f", "arguments": [1, 2]}</tool_call>', "must be a JSON object, got list"),
        ('<tool_call>{"name": "f", "arguments": "a=1"}</tool_call>', "string that is not JSON"),
        ('<tool_call>["f"]</tool_call>', "must be a JSON object"),
    ],
    ids=[
        "unclosed",
        "unclosed-then-eos",
        "unclosed-then-another",
        "unclosed-json",
        "bad-json",
        "no-name",
        "list-arguments",
        "string-arguments",
        "not-an-object",
    ],
)
def test_hermes_malformed_calls(text, reason):
    parsed = HERMES.parse("Calling.\n" + text)
    assert parsed.status == "malformed" and reason in parsed.error
    assert parsed.calls == ()
    # the whole text, as TRL falls back to when parsing fails
    assert parsed.content == ("Calling.\n" + text).removesuffix("<|im_end|>").rstrip()
    assert parsed.message() == {"role": "assistant", "content": parsed.content}


# ---------------------------------------------------------------------------------------------
# Llama 3.x JSON
# ---------------------------------------------------------------------------------------------


def test_llama_plain_text_and_json_calls():
    assert LLAMA.parse("The answer is 6.<|eot_id|>") == ParsedResponse(content="The answer is 6.")
    assert LLAMA.parse("Use {braces} freely.").status == "none"
    parsed = LLAMA.parse('{"name": "multiply", "parameters": {"a": 2, "b": 3}}<|eot_id|>')
    assert parsed.status == "calls" and parsed.content == ""
    assert _calls(parsed) == [("multiply", {"a": 2, "b": 3})]
    assert parsed.calls[0].raw == '{"name": "multiply", "parameters": {"a": 2, "b": 3}}'


def test_llama_python_tag_several_calls_and_the_arguments_key():
    text = 'Let me check.<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "arguments": {}}<|eom_id|>'
    parsed = LLAMA.parse(text)
    assert parsed.content == "Let me check."
    assert _calls(parsed) == [("a", {"x": 1}), ("b", {})]


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ('{"name": "multiply", "parameters": {"a": 2, "b": 3}', "unclosed"),
        ('<|python_tag|>{"name": "multiply", "parameters": {"a": 2,', "unclosed"),
        ('{"name": "multiply", "parameters": {"a": 2}} trailing words', "invalid"),
        ("<|python_tag|>", "followed by no tool call"),
        ('<|python_tag|>{"parameters": {}}', "no 'name'"),
    ],
    ids=["unclosed", "tag-unclosed", "trailing-text", "empty-tag", "no-name"],
)
def test_llama_malformed_calls(text, reason):
    parsed = LLAMA.parse(text)
    assert parsed.status == "malformed" and reason in parsed.error and parsed.calls == ()


# ---------------------------------------------------------------------------------------------
# Mistral
# ---------------------------------------------------------------------------------------------


def test_mistral_json_list_with_ids():
    text = 'Sure.[TOOL_CALLS] [{"name": "multiply", "arguments": {"a": 2, "b": 3}, "id": "abc123def"}, {"name": "now", "arguments": {}}]</s>'
    parsed = MISTRAL.parse(text)
    assert parsed.content == "Sure."
    assert _calls(parsed) == [("multiply", {"a": 2, "b": 3}), ("now", {})]
    assert parsed.calls[0].id == "abc123def" and parsed.calls[1].id is None
    assert parsed.message()["tool_calls"][0]["id"] == "abc123def"
    assert _calls(MISTRAL.parse('[TOOL_CALLS] {"name": "now", "arguments": {}}')) == [("now", {})]


def test_mistral_name_args_form():
    parsed = MISTRAL.parse('[TOOL_CALLS]multiply[ARGS]{"a": 2, "b": 3}[TOOL_CALLS]now[ARGS]{}</s>')
    assert _calls(parsed) == [("multiply", {"a": 2, "b": 3}), ("now", {})]
    assert parsed.calls[0].raw == '[TOOL_CALLS]multiply[ARGS]{"a": 2, "b": 3}'


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ('[TOOL_CALLS] [{"name": "multiply", "arguments": {"a": 2}}', "unclosed"),
        ('[TOOL_CALLS] [{"name": "multiply", "arguments": {"a": 2}}] and more', "text follows"),
        ("[TOOL_CALLS] []", "empty list"),
        ("[TOOL_CALLS]", "followed by no tool call"),
        ('[TOOL_CALLS]multiply[ARGS]{"a": 2', "unclosed"),
        ('[TOOL_CALLS][ARGS]{"a": 2}', "no 'name[ARGS]' header"),
    ],
    ids=["unclosed", "trailing-text", "empty", "nothing", "args-unclosed", "no-name"],
)
def test_mistral_malformed_calls(text, reason):
    parsed = MISTRAL.parse(text)
    assert parsed.status == "malformed" and reason in parsed.error and parsed.calls == ()
    assert MISTRAL.parse("No tools needed.</s>") == ParsedResponse(content="No tools needed.")


# ---------------------------------------------------------------------------------------------
# what the test templates render parses back
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["hermes", "llama3", "mistral"])
def test_a_rendered_assistant_turn_parses_back_to_its_calls(family):
    tokenizer = install_tool_format(build_tiny_tokenizer(), family)
    calls = [
        {"type": "function", "function": {"name": "multiply", "arguments": {"a": 2, "b": 3}}},
        {"type": "function", "function": {"name": "search", "arguments": {"query": "cats", "limit": 2}}},
    ]
    user = {"role": "user", "content": "hi"}
    prompt = tokenizer.apply_chat_template([user], tokenize=False, add_generation_prompt=True)
    rendered = tokenizer.apply_chat_template(
        [user, {"role": "assistant", "content": "", "tool_calls": calls}], tokenize=False
    )
    # what the model samples: the assistant turn up to its end-of-turn token, decoded with special tokens kept
    sampled = rendered[len(prompt) :]
    sampled = sampled[: sampled.rindex(tokenizer.eos_token) + len(tokenizer.eos_token)]
    ids = tokenizer(sampled, add_special_tokens=False)["input_ids"]
    text = tokenizer.decode(ids, skip_special_tokens=False)
    parser = parser_for(tokenizer)
    parsed = parser.parse(text, prefix=prompt)
    assert parsed.status == "calls"
    assert [call.message_entry() for call in parsed.calls] == calls


# ---------------------------------------------------------------------------------------------
# parser_for
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("family", "parser"), [("hermes", HermesParser), ("llama3", Llama3JsonParser), ("mistral", MistralParser)]
)
def test_parser_for_reads_the_chat_template(family, parser):
    tokenizer = install_tool_format(build_tiny_tokenizer(), family)
    assert isinstance(parser_for(tokenizer), parser)
    assert isinstance(parser_for(tokenizer.chat_template), parser)  # a template string works too
    assert isinstance(parser_for({"default": "x", "tool_use": tokenizer.chat_template}), parser)


def test_parser_for_by_name_and_its_errors():
    plain = build_tiny_tokenizer()  # renders no tool format
    assert isinstance(parser_for(plain, tool_parser="mistral"), MistralParser)
    assert isinstance(parser_for(plain, tool_parser="qwen"), HermesParser)
    assert isinstance(parser_for(plain, tool_parser="llama3"), Llama3JsonParser)
    with pytest.raises(
        ConfigError, match=r"cannot tell which tool-call format the chat template uses.*tool_parser="
    ):
        parser_for(plain)
    plain.chat_template = None
    with pytest.raises(ConfigError, match="it has no chat template"):
        parser_for(plain)
    with pytest.raises(ConfigError, match=r"tool_parser='pythonic' is not a known.*'hermes'.*'transformers'"):
        parser_for(plain, tool_parser="pythonic")
    with pytest.raises(
        ConfigError, match=r"tool_parser='transformers' needs a tokenizer with a response schema"
    ):
        parser_for(install_tool_format(build_tiny_tokenizer(), "hermes"), tool_parser="transformers")
    assert template_family(TINY_CHAT_TEMPLATE) is None


# ---------------------------------------------------------------------------------------------
# transformers' response parsing
# ---------------------------------------------------------------------------------------------

RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "tool_calls": {
            "open": "<tool_call>",
            "close_pattern": r"</tool_call>\s*",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"},
    },
}
"""A Hermes response template in the form transformers >= 5.13 reads (`tokenizer.response_template`)."""

RESPONSE_SCHEMA = {
    "type": "object",
    "x-regex": r"^(?P<content>(?:(?!<tool_call>)[\s\S])*?)\s*(?P<tool_calls>(?:<tool_call>[\s\S]*?</tool_call>\s*)+)?(?:<\|im_end\|>)?\s*$",
    "properties": {
        "role": {"const": "assistant"},
        "content": {"type": "string"},
        "tool_calls": {
            "type": "array",
            "x-regex-iterator": r"<tool_call>\s*(.+?)\s*</tool_call>",
            "items": {
                "x-parser": "json",
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "arguments": {"type": "object", "additionalProperties": {}},
                },
            },
        },
    },
}
"""A Hermes response schema in the form transformers 5.0-5.12 read (`tokenizer.response_schema`), flat calls."""


def _with_response_parsing():
    """Returns a Hermes tokenizer with the response schema the installed transformers' parse_response reads."""
    tokenizer = install_tool_format(build_tiny_tokenizer(), "hermes")
    if "prefix" in inspect.signature(tokenizer.parse_response).parameters:
        tokenizer.response_template = RESPONSE_TEMPLATE
    else:
        tokenizer.response_schema = RESPONSE_SCHEMA
    return tokenizer


def test_a_tokenizer_with_a_response_schema_is_parsed_by_transformers():
    tokenizer = _with_response_parsing()
    parser = parser_for(tokenizer)
    assert isinstance(parser, TransformersParser) and parser.name == "transformers"
    text = (
        'Both.\n<tool_call>\n{"name": "multiply", "arguments": {"a": 2, "b": 3}}\n</tool_call>\n'
        '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call><|im_end|>'
    )
    parsed = parser.parse(text, prefix="<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    ours = HERMES.parse(text)
    assert parsed.status == "calls" and parsed.content == ours.content == "Both."
    assert _calls(parsed) == _calls(ours)
    assert parsed.calls[0].raw == '{"name": "multiply", "arguments": {"a": 2, "b": 3}}'
    assert parser.parse("Just text.<|im_end|>") == ParsedResponse(content="Just text.")


def test_transformers_parsing_still_reports_an_unclosed_call():
    parser = parser_for(_with_response_parsing())
    # transformers closes the open region at the end of the text; the family check sees the call never closed
    parsed = parser.parse('<tool_call>\n{"name": "multiply", "arguments": {"a": 2}}')
    assert parsed.status == "malformed" and "never closed" in parsed.error
    bad_json = parser.parse('<tool_call>\n{"name": multiply}\n</tool_call><|im_end|>')
    assert bad_json.status == "malformed"


def test_transformers_parsing_by_name_and_failures_it_reports():
    tokenizer = _with_response_parsing()
    parser = parser_for(tokenizer, tool_parser="transformers")
    assert isinstance(parser, TransformersParser)
    unchecked = TransformersParser(tokenizer)
    assert unchecked.parse('<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>').calls == (
        ToolCall(name="f", arguments={"a": 1}, raw='{"name": "f", "arguments": {"a": 1}}'),
    )
    failed = unchecked.parse('<tool_call>{"name": "f", "arg</tool_call>')
    assert failed.status == "malformed" and "transformers' response parser failed" in failed.error


def test_a_response_schema_the_installed_transformers_does_not_read_is_ignored():
    tokenizer = install_tool_format(build_tiny_tokenizer(), "hermes")
    reads_template = "prefix" in inspect.signature(tokenizer.parse_response).parameters
    if reads_template:
        tokenizer.response_schema = RESPONSE_SCHEMA  # transformers >= 5.13 no longer reads the legacy schema
    else:
        tokenizer.response_template = RESPONSE_TEMPLATE  # transformers < 5.13 has no response templates yet
    assert isinstance(parser_for(tokenizer), HermesParser)
