"""cohort.episodes.templates: the three families' tool templates on a character tokenizer saved and loaded with
save_pretrained / from_pretrained, the start-up checks (tool support, prefix preservation) and the tool turn's
token ids appended after the assistant's own tokens."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from cohort.episodes import (
    TOOL_FORMATS,
    check_prefix_preserving,
    check_tool_support,
    check_tool_template,
    install_tool_format,
    render_tool_turn,
    supports_tools,
    tool_set,
)
from cohort.errors import ConfigError
from cohort.models import TINY_CHAT_TEMPLATE, build_tiny_tokenizer

FAMILIES = sorted(TOOL_FORMATS)


def multiply(a: int, b: int) -> int:
    """Multiplies two integers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return a * b


TOOLS = tool_set([multiply]).schemas
CALL = {"type": "function", "function": {"name": "multiply", "arguments": {"a": 2, "b": 3}}}
ASSISTANT_CALL = {"role": "assistant", "content": "", "tool_calls": [CALL]}
USER = {"role": "user", "content": "What is 2 * 3?"}
RESULT = {"role": "tool", "name": "multiply", "content": "6"}

GENERATED = {
    "hermes": '<tool_call>\n{"name": "multiply", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>',
    "llama3": '{"name": "multiply", "parameters": {"a": 2, "b": 3}}<|eot_id|>',
    "mistral": '[TOOL_CALLS] [{"name": "multiply", "arguments": {"a": 2, "b": 3}}]</s>',
}
"""What a model of each family samples for the call, ending with its end-of-turn token."""

TOOL_TURN = {
    "hermes": "\n<|im_start|>user\n<tool_response>\n6\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
    "llama3": "<|start_header_id|>ipython<|end_header_id|>\n\n6<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
    "mistral": '[TOOL_RESULTS] {"content": "6"}[/TOOL_RESULTS]',
}
"""The text each family's template writes after the assistant's end-of-turn token for one result "6"."""

# Like Qwen3's own template: the last assistant turn gets an empty thinking block, earlier ones do not, so a
# turn renders differently once a tool message follows it.
NOT_PREFIX_PRESERVING = TOOL_FORMATS["hermes"].chat_template.replace(
    "{{- '<|im_start|>assistant' }}",
    "{{- '<|im_start|>assistant' }}{%- if loop.last %}{{- '\\n<think>\\n\\n</think>\\n' }}{%- endif %}",
)


@pytest.fixture(scope="module", params=FAMILIES)
def family_tokenizer(request, tmp_path_factory):
    """(family, tokenizer): the tiny character tokenizer with the family's tool format, saved and loaded back."""
    folder = tmp_path_factory.mktemp(f"tok-{request.param}")
    install_tool_format(build_tiny_tokenizer(), request.param).save_pretrained(folder)
    return request.param, AutoTokenizer.from_pretrained(folder)


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_a_saved_and_loaded_tokenizer_keeps_the_format(family_tokenizer):
    family, tokenizer = family_tokenizer
    fmt = TOOL_FORMATS[family]
    assert tokenizer.chat_template == fmt.chat_template
    assert tokenizer.eos_token == fmt.end_of_turn
    for token in fmt.special_tokens:  # each special token is one id, never split into characters
        assert len(_ids(tokenizer, token)) == 1, token
    text = tokenizer.apply_chat_template([USER], tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert '"name": "multiply"' in text and "Multiplies two integers." in text  # tools in the system prompt
    assert text.index("multiply") < text.index("What is 2 * 3?")


def test_the_families_render_their_own_call_and_result_formats(family_tokenizer):
    family, tokenizer = family_tokenizer
    text = tokenizer.apply_chat_template(
        [USER, ASSISTANT_CALL, RESULT], tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    prompt = tokenizer.apply_chat_template([USER], tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert text == prompt + GENERATED[family] + TOOL_TURN[family]


def test_every_family_passes_the_start_up_checks(family_tokenizer):
    _, tokenizer = family_tokenizer
    assert supports_tools(tokenizer) is None
    check_tool_template(tokenizer)


def test_the_tool_turn_extends_the_sampled_tokens_to_the_templates_own_rendering(family_tokenizer):
    family, tokenizer = family_tokenizer
    prompt_ids = tokenizer.apply_chat_template(
        [USER], tools=TOOLS, add_generation_prompt=True, tokenize=False
    )
    prompt_ids = _ids(tokenizer, prompt_ids)
    sampled = _ids(tokenizer, GENERATED[family])
    assert sampled[-1] == tokenizer.eos_token_id

    suffix = render_tool_turn(tokenizer, [USER, ASSISTANT_CALL], [RESULT], tools=TOOLS)

    assert tokenizer.decode(suffix) == TOOL_TURN[family]
    full = tokenizer.apply_chat_template(
        [USER, ASSISTANT_CALL, RESULT], tools=TOOLS, add_generation_prompt=True, tokenize=False
    )
    assert prompt_ids + sampled + suffix == _ids(tokenizer, full)


def test_a_second_round_appends_after_the_first(family_tokenizer):
    family, tokenizer = family_tokenizer
    first = [USER, ASSISTANT_CALL]
    second_call = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "multiply", "arguments": {"a": 6, "b": 7}}}],
    }
    second_result = {"role": "tool", "name": "multiply", "content": "42"}
    ids = _ids(
        tokenizer,
        tokenizer.apply_chat_template([USER], tools=TOOLS, add_generation_prompt=True, tokenize=False),
    )
    ids += _ids(tokenizer, GENERATED[family])
    ids += render_tool_turn(tokenizer, first, [RESULT], tools=TOOLS)
    ids += _ids(tokenizer, GENERATED[family].replace('"a": 2, "b": 3', '"a": 6, "b": 7'))
    ids += render_tool_turn(tokenizer, [*first, RESULT, second_call], [second_result], tools=TOOLS)
    full = tokenizer.apply_chat_template(
        [*first, RESULT, second_call, second_result], tools=TOOLS, add_generation_prompt=True, tokenize=False
    )
    assert ids == _ids(tokenizer, full)


def test_several_results_of_one_turn_render_together():
    tokenizer = install_tool_format(build_tiny_tokenizer(), "hermes")
    calls = [CALL, {"type": "function", "function": {"name": "multiply", "arguments": {"a": 4, "b": 5}}}]
    assistant = {"role": "assistant", "content": "Two products.", "tool_calls": calls}
    results = [RESULT, {"role": "tool", "name": "multiply", "content": "20"}]
    suffix = render_tool_turn(tokenizer, [USER, assistant], results, tools=TOOLS)
    assert tokenizer.decode(suffix) == (
        "\n<|im_start|>user\n<tool_response>\n6\n</tool_response>\n<tool_response>\n20\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n"
    )


def test_explicit_end_of_turn_ids_cut_where_the_model_stops():
    """A tokenizer whose EOS is not the end-of-turn token (a base model's): the stop ids are given."""
    tokenizer = install_tool_format(build_tiny_tokenizer(), "hermes")
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    tokenizer.eos_token = "<|endoftext|>"
    without = render_tool_turn(tokenizer, [USER, ASSISTANT_CALL], [RESULT])
    assert tokenizer.decode(without) == TOOL_TURN["hermes"][1:]  # no EOS in the rendering: cut at its end
    given = render_tool_turn(tokenizer, [USER, ASSISTANT_CALL], [RESULT], end_of_turn=[im_end])
    assert tokenizer.decode(given) == TOOL_TURN["hermes"]


def test_a_template_that_re_renders_earlier_turns_is_refused_with_the_fix():
    tokenizer = install_tool_format(build_tiny_tokenizer(), "hermes")
    tokenizer.chat_template = NOT_PREFIX_PRESERVING
    check_tool_support(tokenizer)  # it does render tools: only prefix preservation fails
    with pytest.raises(ConfigError, match=r"not prefix-preserving.*<think>.*get_training_chat_template"):
        check_prefix_preserving(tokenizer)
    with pytest.raises(ConfigError, match="not prefix-preserving"):
        check_tool_template(tokenizer)
    with pytest.raises(ConfigError, match="re-rendered earlier turns"):
        render_tool_turn(tokenizer, [USER, ASSISTANT_CALL], [RESULT])


def test_the_check_passes_a_chat_template_override_and_template_kwargs():
    tokenizer = install_tool_format(build_tiny_tokenizer(), "hermes")
    check_prefix_preserving(tokenizer)
    with pytest.raises(ConfigError, match="not prefix-preserving"):
        check_prefix_preserving(tokenizer, chat_template=NOT_PREFIX_PRESERVING)
    switchable = NOT_PREFIX_PRESERVING.replace("{%- if loop.last %}", "{%- if loop.last and think %}")
    check_prefix_preserving(tokenizer, chat_template=switchable, chat_template_kwargs={"think": False})
    with pytest.raises(ConfigError):
        check_prefix_preserving(tokenizer, chat_template=switchable, chat_template_kwargs={"think": True})


@pytest.mark.parametrize(
    ("template", "lacking"),
    [
        (TINY_CHAT_TEMPLATE, "tool_calls"),  # renders content only
        (
            "{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tool role') }}{% endif %}"
            "{{ m.role }}: {{ m.content }}{% for c in m.tool_calls or [] %}{{ c.function | tojson }}{% endfor %}"
            "{% endfor %}",
            "no tool role",
        ),
        (
            "{% for m in messages %}{{ m.role }}: {{ m.content }}"
            "{% for c in m.tool_calls or [] %}{{ c.function | tojson }}{% endfor %}{% endfor %}",
            "tools= list",
        ),
    ],
    ids=["content-only", "raises-on-tool-role", "ignores-tools"],
)
def test_a_template_without_tool_support_is_a_clear_error(template, lacking):
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = template
    assert lacking in supports_tools(tokenizer)
    with pytest.raises(
        ConfigError, match=rf"does not support tool calling: .*{lacking}.*tokenizer.chat_template"
    ):
        check_tool_template(tokenizer)


def test_a_tokenizer_without_a_chat_template():
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = None
    with pytest.raises(ConfigError, match="has no chat template"):
        check_tool_support(tokenizer)


def test_unknown_format_and_bad_calls():
    with pytest.raises(ConfigError, match=r"unknown tool format 'qwen9'.*hermes"):
        install_tool_format(build_tiny_tokenizer(), "qwen9")
    tokenizer = install_tool_format(build_tiny_tokenizer(), "hermes")
    with pytest.raises(ValueError, match="at least one tool message"):
        render_tool_turn(tokenizer, [USER, ASSISTANT_CALL], [])
    with pytest.raises(ValueError, match="must end with the assistant message"):
        render_tool_turn(tokenizer, [USER], [RESULT])
