"""Chat templates and tool turns: the start-up checks a tool-calling template must pass, and the token ids of a
tool turn appended after the assistant's own tokens.

An episode's sequence is the prompt, then the tokens the policy sampled, then the tool results rendered by
the chat template, then more sampled tokens. The tool results are the difference between two renderings,
the conversation up to the assistant's tool call and the same plus the tool messages (as TRL does), which
is only sound when the template is prefix-preserving: appending a message must not re-render earlier turns.
`check_tool_template` verifies both that and that the template renders tools at all, before a model loads.

The three `ToolFormat`s here are small templates of our own that render the tool formats of the Qwen /
Hermes, Llama 3.x and Mistral families (tools in the system prompt, a `tool` role), for tests and for
tiny models that learn tool use from scratch.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from jinja2 import TemplateError
from transformers import AddedToken

from cohort.errors import ConfigError

HERMES_TOOL_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}"
    "{{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within '"
    ' \'<tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'user' or message.role == 'system' %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for call in message.tool_calls or [] %}"
    "{%- set function = call.function if call.function is defined else call %}"
    '{{- \'\\n<tool_call>\\n{"name": "\' + function.name + \'", "arguments": \' }}'
    "{%- if function.arguments is string %}{{- function.arguments }}{%- else %}{{- function.arguments | tojson }}"
    "{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""Qwen2.5 / Hermes tool format: tools as JSON lines in `<tools>` in the system turn, each call a
`<tool_call>` block, consecutive tool results `<tool_response>` blocks in one user turn, `<|im_end|>` ends
a turn."""

LLAMA3_TOOL_TEMPLATE = (
    "{{- bos_token if bos_token is defined and bos_token else '' }}"
    "{%- if messages[0].role == 'system' %}"
    "{%- set system_message = messages[0].content %}{%- set rest = messages[1:] %}"
    "{%- else %}{%- set system_message = '' %}{%- set rest = messages %}{%- endif %}"
    "{%- if tools or system_message %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{%- if tools %}"
    "{{- 'Environment: ipython\\n\\nYou have access to the following functions. To call a function, respond '"
    ' \'with JSON in the format {"name": function name, "parameters": dictionary of argument name and its \''
    " 'value}. Do not use variables.\\n\\n' }}"
    "{%- for tool in tools %}{{- tool | tojson }}{{- '\\n\\n' }}{%- endfor %}"
    "{%- endif %}"
    "{{- system_message + '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- for message in rest %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- for call in message.tool_calls %}"
    "{%- set function = call.function if call.function is defined else call %}"
    "{%- if not loop.first %}{{- '; ' }}{%- endif %}"
    '{{- \'{"name": "\' + function.name + \'", "parameters": \' }}'
    "{%- if function.arguments is string %}{{- function.arguments }}{%- else %}{{- function.arguments | tojson }}"
    "{%- endif %}"
    "{{- '}' }}"
    "{%- endfor %}"
    "{{- '<|eot_id|>' }}"
    "{%- elif message.role == 'tool' or message.role == 'ipython' %}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}"
    "{%- else %}"
    "{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
"""Llama 3.1 / 3.2 JSON tool format: tools in the system turn, a call `{"name": ..., "parameters": ...}` as
the whole assistant turn (several joined by "; "), results in an `ipython` turn, `<|eot_id|>` ends a turn."""

MISTRAL_TOOL_TEMPLATE = (
    "{{- bos_token if bos_token is defined and bos_token else '' }}"
    "{%- if tools %}{{- '[AVAILABLE_TOOLS] ' + (tools | tojson) + '[/AVAILABLE_TOOLS]' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' %}"
    "{{- '[SYSTEM_PROMPT] ' + message.content + '[/SYSTEM_PROMPT]' }}"
    "{%- elif message.role == 'user' %}"
    "{{- '[INST] ' + message.content + '[/INST]' }}"
    "{%- elif message.role == 'assistant' %}"
    "{%- if message.content %}{{- message.content }}{%- endif %}"
    "{%- if message.tool_calls %}"
    "{{- '[TOOL_CALLS] [' }}"
    "{%- for call in message.tool_calls %}"
    "{%- set function = call.function if call.function is defined else call %}"
    '{{- \'{"name": "\' + function.name + \'", "arguments": \' }}'
    "{%- if function.arguments is string %}{{- function.arguments }}{%- else %}{{- function.arguments | tojson }}"
    "{%- endif %}"
    "{%- if call.id is defined %}{{- ', \"id\": \"' + call.id + '\"' }}{%- endif %}"
    "{{- '}' }}{%- if not loop.last %}{{- ', ' }}{%- endif %}"
    "{%- endfor %}"
    "{{- ']' }}"
    "{%- endif %}"
    "{{- eos_token }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '[TOOL_RESULTS] {\"content\": ' + (message.content | tojson) }}"
    "{%- if message.tool_call_id is defined %}{{- ', \"call_id\": \"' + message.tool_call_id + '\"' }}{%- endif %}"
    "{{- '}[/TOOL_RESULTS]' }}"
    "{%- endif %}"
    "{%- endfor %}"
)
"""Mistral (v3 tokenizer) tool format: tools in `[AVAILABLE_TOOLS]` first, calls a JSON list after
`[TOOL_CALLS]`, each result in `[TOOL_RESULTS]`; the model writes right after `[/INST]` or
`[/TOOL_RESULTS]` (no generation prompt), `</s>` ends its turn."""


@dataclass(frozen=True)
class ToolFormat:
    """A family's tool format: its chat template, the special tokens it uses, the token that ends an assistant turn,
    and the name of its tool parser."""

    name: str
    chat_template: str
    special_tokens: tuple[str, ...]
    end_of_turn: str
    parser: str


TOOL_FORMATS: dict[str, ToolFormat] = {
    "hermes": ToolFormat(
        name="hermes",
        chat_template=HERMES_TOOL_TEMPLATE,
        special_tokens=(
            "<|im_start|>",
            "<|im_end|>",
            "<tool_call>",
            "</tool_call>",
            "<tool_response>",
            "</tool_response>",
        ),
        end_of_turn="<|im_end|>",
        parser="hermes",
    ),
    "llama3": ToolFormat(
        name="llama3",
        chat_template=LLAMA3_TOOL_TEMPLATE,
        special_tokens=(
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
            "<|eom_id|>",
            "<|python_tag|>",
        ),
        end_of_turn="<|eot_id|>",
        parser="llama3_json",
    ),
    "mistral": ToolFormat(
        name="mistral",
        chat_template=MISTRAL_TOOL_TEMPLATE,
        special_tokens=(
            "</s>",
            "[INST]",
            "[/INST]",
            "[TOOL_CALLS]",
            "[AVAILABLE_TOOLS]",
            "[/AVAILABLE_TOOLS]",
            "[TOOL_RESULTS]",
            "[/TOOL_RESULTS]",
            "[SYSTEM_PROMPT]",
            "[/SYSTEM_PROMPT]",
        ),
        end_of_turn="</s>",
        parser="mistral",
    ),
}
"""The tool formats of this module by name."""


def install_tool_format(tokenizer: Any, name: str) -> Any:
    """Returns `tokenizer` (changed in place) with a family's tool template, its special tokens added, and its
    end-of-turn token as EOS. A model trained with it needs an embedding row per added token (len(tokenizer))."""
    if name not in TOOL_FORMATS:
        raise ConfigError(f"unknown tool format {name!r}; choose one of {sorted(TOOL_FORMATS)}")
    fmt = TOOL_FORMATS[name]
    tokenizer.add_tokens([AddedToken(token, special=True, normalized=False) for token in fmt.special_tokens])
    tokenizer.eos_token = fmt.end_of_turn
    tokenizer.chat_template = fmt.chat_template
    return tokenizer


# A probe tool whose name, argument and result are sentinels: each must appear in a rendering that supports tools.
_PROBE_NAME = "probe_tool_a8f3e2"
_PROBE_ARG = "probe_arg_b9d4f5"
_PROBE_VALUE = "probe_value_d6e7a9"
_PROBE_RESULT = "probe_result_c4f9a8"
_PROBE_SCHEMA: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": _PROBE_NAME,
        "description": "A probe.",
        "parameters": {
            "type": "object",
            "properties": {_PROBE_ARG: {"type": "string", "description": "A value."}},
            "required": [_PROBE_ARG],
        },
    },
}


def _probe_call(arguments: Any) -> dict[str, Any]:
    """Returns an assistant message that calls the probe tool with `arguments`."""
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": _PROBE_NAME, "arguments": arguments}}],
    }


def _probe_result() -> dict[str, Any]:
    """Returns the tool message answering the probe call."""
    return {"role": "tool", "name": _PROBE_NAME, "content": _PROBE_RESULT}


def _render(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None,
    add_generation_prompt: bool,
    chat_template: str | None,
    chat_template_kwargs: Mapping[str, Any] | None,
) -> str:
    """Returns the chat template's text for `messages` (tools=None rather than [], which some templates render)."""
    text = tokenizer.apply_chat_template(
        [dict(message) for message in messages],
        tools=[dict(tool) for tool in tools] if tools else None,
        add_generation_prompt=add_generation_prompt,
        tokenize=False,
        chat_template=chat_template,
        **dict(chat_template_kwargs or {}),
    )
    if not isinstance(text, str):
        raise TypeError(f"apply_chat_template(tokenize=False) returned {type(text).__name__}, not text")
    return text


def _encode(tokenizer: Any, text: str) -> list[int]:
    """Returns the ids of rendered chat text, tokenized without added special tokens as apply_chat_template does."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _tokenizer_label(tokenizer: Any) -> str:
    """Returns how an error names a tokenizer: its name or path when it has one."""
    name = getattr(tokenizer, "name_or_path", "") or ""
    return f"the chat template of {name}" if name else "the chat template"


def supports_tools(
    tokenizer: Any, *, chat_template: str | None = None, chat_template_kwargs: Mapping[str, Any] | None = None
) -> str | None:
    """Returns None when the chat template renders tools, tool calls and tool results; else what it lacks."""
    if chat_template is None and getattr(tokenizer, "chat_template", None) is None:
        return "the tokenizer has no chat template"

    def render(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
        return _render(
            tokenizer,
            messages,
            tools=tools,
            add_generation_prompt=True,
            chat_template=chat_template,
            chat_template_kwargs=chat_template_kwargs,
        )

    conversation = None
    failure = ""
    # Some templates take the arguments as a JSON string only (DeepSeek-V3), others as a mapping only.
    for arguments in ({_PROBE_ARG: _PROBE_VALUE}, json.dumps({_PROBE_ARG: _PROBE_VALUE})):
        messages = [{"role": "user", "content": "hi"}, _probe_call(arguments), _probe_result()]
        try:
            conversation = render(messages, None)
            break
        except (TemplateError, TypeError) as exc:
            failure = f"rendering a tool-calling conversation fails ({type(exc).__name__}: {exc})"
    if conversation is None:
        return failure
    missing = []
    if not all(probe in conversation for probe in (_PROBE_NAME, _PROBE_ARG, _PROBE_VALUE)):
        missing.append("the assistant's tool_calls")
    if _PROBE_RESULT not in conversation:
        missing.append("the tool message")
    try:
        listed = render([{"role": "user", "content": "hi"}], [_PROBE_SCHEMA])
    except (TemplateError, TypeError) as exc:
        return f"rendering a prompt with tools= fails ({type(exc).__name__}: {exc})"
    if _PROBE_NAME not in listed:
        missing.append("the tools= list")
    if missing:
        return f"it drops {' and '.join(missing)} when rendering"
    return None


def check_tool_support(
    tokenizer: Any, *, chat_template: str | None = None, chat_template_kwargs: Mapping[str, Any] | None = None
) -> None:
    """Raises ConfigError, naming the fix, when the chat template cannot render a tool-calling conversation."""
    problem = supports_tools(
        tokenizer, chat_template=chat_template, chat_template_kwargs=chat_template_kwargs
    )
    if problem is not None:
        raise ConfigError(
            f"{_tokenizer_label(tokenizer)} does not support tool calling: {problem}. Training with tools needs a "
            f"template that renders the tools (tools=), an assistant message's tool_calls and a tool-role message, "
            f"as the chat templates of Qwen2.5 / Qwen3, Llama 3.1+ and Mistral do; use the tokenizer of an "
            f"instruct model trained for tool use, or set tokenizer.chat_template to such a template"
        )


def _first_difference(before: str, after: str) -> str:
    """Returns where the longer rendering stops extending the shorter one, quoted with context."""
    index = next((i for i, (a, b) in enumerate(zip(before, after)) if a != b), min(len(before), len(after)))
    start = max(0, index - 30)
    return (
        f"at character {index}, {before[start : index + 30]!r} is rendered as {after[start : index + 30]!r} "
        f"once a tool message follows"
    )


def check_prefix_preserving(
    tokenizer: Any, *, chat_template: str | None = None, chat_template_kwargs: Mapping[str, Any] | None = None
) -> None:
    """Raises ConfigError, naming the fix, when appending a tool message re-renders earlier turns of the template.

    Renders [user, assistant with a tool call] and the same plus a tool message (with the generation
    prompt), then the same one round later, and requires each second rendering's ids to extend the
    first's, as TRL's `is_chat_template_prefix_preserving` does for the first round.
    """
    user = {"role": "user", "content": "What is 2 * 3?"}
    rounds = [[user, _probe_call({_PROBE_ARG: _PROBE_VALUE})]]
    rounds.append(rounds[0] + [_probe_result(), _probe_call({_PROBE_ARG: _PROBE_VALUE})])
    for before in rounds:
        after = before + [_probe_result()]
        try:
            text_before = _render(
                tokenizer,
                before,
                tools=[_PROBE_SCHEMA],
                add_generation_prompt=False,
                chat_template=chat_template,
                chat_template_kwargs=chat_template_kwargs,
            )
            text_after = _render(
                tokenizer,
                after,
                tools=[_PROBE_SCHEMA],
                add_generation_prompt=True,
                chat_template=chat_template,
                chat_template_kwargs=chat_template_kwargs,
            )
        except (TemplateError, TypeError) as exc:
            raise ConfigError(
                f"{_tokenizer_label(tokenizer)} fails to render a tool-calling conversation "
                f"({type(exc).__name__}: {exc}); use a template that supports tool calling"
            ) from exc
        ids_before = _encode(tokenizer, text_before)
        ids_after = _encode(tokenizer, text_after)
        if ids_after[: len(ids_before)] != ids_before:
            raise ConfigError(
                f"{_tokenizer_label(tokenizer)} is not prefix-preserving: appending a tool message re-renders "
                f"earlier turns ({_first_difference(text_before, text_after)}). Multi-turn training appends the "
                f"tool results after the tokens the model sampled, so a turn must render the same whatever follows "
                f"it. Fix: use a prefix-preserving template: for Qwen3 and the other families TRL patches, set "
                f"tokenizer.chat_template = trl.chat_template_utils.get_training_chat_template(tokenizer); "
                f"otherwise edit the template so no turn depends on later ones (typically a `loop.last` or "
                f"'last assistant turn' condition that adds or strips thinking tags)"
            )


def check_tool_template(
    tokenizer: Any, *, chat_template: str | None = None, chat_template_kwargs: Mapping[str, Any] | None = None
) -> None:
    """Raises ConfigError when the chat template cannot render tools or is not prefix-preserving (the start-up check)."""
    check_tool_support(tokenizer, chat_template=chat_template, chat_template_kwargs=chat_template_kwargs)
    check_prefix_preserving(tokenizer, chat_template=chat_template, chat_template_kwargs=chat_template_kwargs)


def _end_of_turn_ids(tokenizer: Any, end_of_turn: Sequence[int] | None) -> set[int]:
    """Returns the ids that end an assistant turn: `end_of_turn`, else the tokenizer's EOS."""
    if end_of_turn is not None:
        return set(end_of_turn)
    eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(eos, int):
        return {eos}
    return set(eos or ())


def render_tool_turn(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    tool_messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    end_of_turn: Sequence[int] | None = None,
    chat_template: str | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> list[int]:
    """Returns the token ids to append after the assistant's tokens (which end with an end-of-turn id) for
    `tool_messages`: the tool turn and the next assistant header, as the difference of two renderings.

    `messages` is the conversation up to and including the assistant message that made the calls; the
    first rendering is cut after its last end-of-turn id (`end_of_turn`, default the tokenizer's EOS),
    where the model's own tokens stop, so a newline the template writes after the turn is part of the
    result.
    """
    if not tool_messages:
        raise ValueError("render_tool_turn needs at least one tool message")
    if not messages or messages[-1].get("role") != "assistant":
        raise ValueError(
            "render_tool_turn: messages must end with the assistant message that made the tool calls"
        )
    text_before = _render(
        tokenizer,
        messages,
        tools=tools,
        add_generation_prompt=False,
        chat_template=chat_template,
        chat_template_kwargs=chat_template_kwargs,
    )
    text_after = _render(
        tokenizer,
        [*messages, *tool_messages],
        tools=tools,
        add_generation_prompt=True,
        chat_template=chat_template,
        chat_template_kwargs=chat_template_kwargs,
    )
    ids_before = _encode(tokenizer, text_before)
    ids_after = _encode(tokenizer, text_after)
    ends = _end_of_turn_ids(tokenizer, end_of_turn)
    cut = next((i + 1 for i in range(len(ids_before) - 1, -1, -1) if ids_before[i] in ends), len(ids_before))
    if ids_after[:cut] != ids_before[:cut]:
        raise ConfigError(
            f"{_tokenizer_label(tokenizer)} re-rendered earlier turns when tool results were appended "
            f"({_first_difference(text_before, text_after)}); the template is not prefix-preserving for this "
            f"conversation: run check_prefix_preserving at start-up and use a prefix-preserving template"
        )
    return ids_after[cut:]


def render_prompt(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> list[int]:
    """Returns the token ids of `messages` rendered by the chat template with `tools` and the generation prompt
    (the ids an episode starts from, tokenized as `render_tool_turn` tokenizes what follows)."""
    text = _render(
        tokenizer,
        messages,
        tools=tools,
        add_generation_prompt=True,
        chat_template=None,
        chat_template_kwargs=chat_template_kwargs,
    )
    return _encode(tokenizer, text)
