"""Tool calls out of an assistant message, in the formats real models emit.

A parser turns the text of one assistant turn (decoded with its special tokens kept: `[TOOL_CALLS]` and
`<|python_tag|>` are special tokens; a control token the model spelled out with ordinary tokens is broken first,
so only a sampled one is a delimiter: cohort.episodes.control_tokens) into a `ParsedResponse`: the text before the
calls, the calls, and which of three cases it is: no call, complete call(s), or a malformed call (invalid JSON, a
call without a name, a `<tool_call>` the model never closed). A malformed turn executes nothing: its content is the
whole text, as TRL falls back to when parsing fails.

Families shipped here: Hermes-style `<tool_call>{json}</tool_call>` (Qwen2.5, Qwen3, Hermes, several
calls per turn), Llama 3.x JSON (`{"name": ..., "parameters": ...}`, optionally after `<|python_tag|>`)
and Mistral `[TOOL_CALLS]` (a JSON list, or the newer `name[ARGS]{json}`). `parser_for` picks one from
the chat template, or transformers' own response parsing when the tokenizer carries a response
schema the installed transformers can read.
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from cohort import choices
from cohort.errors import ConfigError

Status = Literal["none", "calls", "malformed"]


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: the tool's name, its arguments, the text it was parsed from, and its id if the model gave one."""

    name: str
    arguments: dict[str, Any]
    raw: str
    """The call as the model wrote it (its JSON re-serialised where transformers parsed it)."""
    id: str | None = None

    def message_entry(self) -> dict[str, Any]:
        """Returns the call as an entry of an assistant message's `tool_calls` (TRL's and the chat templates' form)."""
        entry: dict[str, Any] = {
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        if self.id is not None:
            entry["id"] = self.id
        return entry


@dataclass(frozen=True)
class ParsedResponse:
    """One parsed assistant turn: its text before the calls, the calls, and why it is malformed if it is."""

    content: str
    calls: tuple[ToolCall, ...] = ()
    error: str | None = None
    """Why the turn is malformed (then `calls` is empty and `content` the whole text); None otherwise."""

    @property
    def status(self) -> Status:
        """Returns "malformed", "calls" (at least one complete call) or "none"."""
        if self.error is not None:
            return "malformed"
        return "calls" if self.calls else "none"

    def message(self) -> dict[str, Any]:
        """Returns the turn as an assistant message in TRL's format (`tool_calls` only when there are calls)."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.calls:
            message["tool_calls"] = [call.message_entry() for call in self.calls]
        return message


class ToolParser(Protocol):
    """Parses the text of one assistant turn; `prefix` is the prompt before it (read by transformers' parsing only)."""

    name: str

    def parse(self, text: str, *, prefix: str = "") -> ParsedResponse: ...


class _CallError(ValueError):
    """A call's text is not a valid call; the message says why."""


def _strip_end(text: str, markers: Sequence[str]) -> str:
    """Returns `text` without trailing whitespace and end-of-turn markers."""
    text = text.rstrip()
    changed = True
    while changed:
        changed = False
        for marker in markers:
            if text.endswith(marker):
                text = text[: -len(marker)].rstrip()
                changed = True
    return text


def _call_from_object(obj: Any, raw: str, *, arguments_keys: Sequence[str]) -> ToolCall:
    """Returns the ToolCall of one decoded JSON object `{"name": ..., <arguments key>: {...}}`."""
    if not isinstance(obj, dict):
        raise _CallError(f"a tool call must be a JSON object, got {type(obj).__name__}")
    if isinstance(obj.get("function"), dict):  # the OpenAI shape {"type": "function", "function": {...}}
        return _call_from_object(obj["function"], raw, arguments_keys=arguments_keys)
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        raise _CallError("a tool call has no 'name' string")
    arguments: Any = None
    for key in arguments_keys:
        if key in obj:
            arguments = obj[key]
            break
    if isinstance(arguments, str):
        # Some models write the arguments as a JSON string, as OpenAI's API returns them.
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as exc:
            raise _CallError(f"the arguments of {name!r} are a string that is not JSON ({exc.msg})") from exc
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        raise _CallError(f"the arguments of {name!r} must be a JSON object, got {type(arguments).__name__}")
    call_id = obj.get("id")
    return ToolCall(name=name, arguments=arguments, raw=raw, id=call_id if isinstance(call_id, str) else None)


def _json_error(exc: json.JSONDecodeError, text: str) -> str:
    """Returns why `text` is not JSON, saying "unclosed" when the text ended before the JSON did."""
    if exc.pos >= len(text.rstrip()):
        return f"the JSON of a tool call is unclosed ({exc.msg} at the end of the text)"
    return f"the JSON of a tool call is invalid ({exc.msg} at character {exc.pos})"


class HermesParser:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call (Qwen2.5, Qwen3, Hermes)."""

    name = "hermes"
    open_tag = "<tool_call>"
    close_tag = "</tool_call>"
    end_markers = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "</s>")

    def parse(self, text: str, *, prefix: str = "") -> ParsedResponse:
        """Returns the calls in `<tool_call>` blocks after any `</think>`; an unclosed block or bad JSON is malformed."""
        text = _strip_end(text, self.end_markers)
        # A thinking model may mention the tag while reasoning; only what follows its reasoning is a call.
        think_end = text.rfind("</think>")
        search_from = think_end + len("</think>") if think_end >= 0 else 0
        start = text.find(self.open_tag, search_from)
        if start < 0:
            return ParsedResponse(content=text)
        calls: list[ToolCall] = []
        position = start
        try:
            while True:
                position = text.find(self.open_tag, position)
                if position < 0:
                    break
                body_start = position + len(self.open_tag)
                end = text.find(self.close_tag, body_start)
                following = text.find(self.open_tag, body_start)
                if end < 0 or 0 <= following < end:
                    raise _CallError(f"a {self.open_tag} is never closed by {self.close_tag}")
                body = text[body_start:end].strip()
                try:
                    obj = json.loads(body)
                except json.JSONDecodeError as exc:
                    raise _CallError(_json_error(exc, body)) from exc
                calls.append(
                    _call_from_object(
                        obj,
                        text[position : end + len(self.close_tag)],
                        arguments_keys=("arguments", "parameters"),
                    )
                )
                position = end + len(self.close_tag)
        except _CallError as exc:
            return ParsedResponse(content=text, error=str(exc))
        return ParsedResponse(content=text[:start].rstrip(), calls=tuple(calls))


class Llama3JsonParser:
    """Llama 3.x JSON calls: `{"name": ..., "parameters": {...}}`, optionally after `<|python_tag|>`, `;`-separated."""

    name = "llama3_json"
    python_tag = "<|python_tag|>"
    end_markers = ("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>")
    _call_start = re.compile(r'\{\s*"name"\s*:')

    def parse(self, text: str, *, prefix: str = "") -> ParsedResponse:
        """Returns the JSON calls the turn consists of (after `<|python_tag|>` if present); plain text is no call."""
        text = _strip_end(text, self.end_markers)
        tag = text.find(self.python_tag)
        if tag >= 0:
            content, body = text[:tag].rstrip(), text[tag + len(self.python_tag) :].strip()
        else:
            # Without the tag a call is the whole message, as the Llama 3.1 / 3.2 templates render it.
            stripped = text.lstrip()
            if not self._call_start.match(stripped):
                return ParsedResponse(content=text)
            content, body = "", stripped
        try:
            calls = self._calls(body)
        except _CallError as exc:
            return ParsedResponse(content=text, error=str(exc))
        return ParsedResponse(content=content, calls=tuple(calls))

    def _calls(self, body: str) -> list[ToolCall]:
        """Returns the calls of `body`: JSON objects separated by ';' or whitespace."""
        decoder = json.JSONDecoder()
        calls: list[ToolCall] = []
        position = 0
        while True:
            while position < len(body) and (body[position].isspace() or body[position] == ";"):
                position += 1
            if position >= len(body):
                break
            try:
                obj, end = decoder.raw_decode(body, position)
            except json.JSONDecodeError as exc:
                raise _CallError(_json_error(exc, body)) from exc
            calls.append(
                _call_from_object(obj, body[position:end], arguments_keys=("parameters", "arguments"))
            )
            position = end
        if not calls:
            raise _CallError(f"{self.python_tag} is followed by no tool call")
        return calls


class MistralParser:
    """Mistral `[TOOL_CALLS]`: a JSON list of `{"name", "arguments", "id"?}`, or `[TOOL_CALLS]name[ARGS]{json}` per call."""

    name = "mistral"
    marker = "[TOOL_CALLS]"
    args_marker = "[ARGS]"
    end_markers = ("</s>",)

    def parse(self, text: str, *, prefix: str = "") -> ParsedResponse:
        """Returns the calls after the first `[TOOL_CALLS]`; a list or object that does not close is malformed."""
        text = _strip_end(text, self.end_markers)
        start = text.find(self.marker)
        if start < 0:
            return ParsedResponse(content=text)
        body = text[start + len(self.marker) :]
        try:
            if self.args_marker in body:
                calls = self._name_args_calls(text[start:])
            else:
                calls = self._json_calls(body.strip())
        except _CallError as exc:
            return ParsedResponse(content=text, error=str(exc))
        return ParsedResponse(content=text[:start].rstrip(), calls=tuple(calls))

    def _json_calls(self, body: str) -> list[ToolCall]:
        """Returns the calls of a JSON list (or a single object) that must be all of `body`."""
        if not body:
            raise _CallError(f"{self.marker} is followed by no tool call")
        try:
            obj, end = json.JSONDecoder().raw_decode(body)
        except json.JSONDecodeError as exc:
            raise _CallError(_json_error(exc, body)) from exc
        if body[end:].strip():
            raise _CallError(f"text follows the tool calls: {body[end:].strip()[:40]!r}")
        items = obj if isinstance(obj, list) else [obj]
        if not items:
            raise _CallError(f"{self.marker} is followed by an empty list")
        return [
            _call_from_object(
                item, json.dumps(item, ensure_ascii=False), arguments_keys=("arguments", "parameters")
            )
            for item in items
        ]

    def _name_args_calls(self, body: str) -> list[ToolCall]:
        """Returns the calls of `[TOOL_CALLS]name[ARGS]{json}` blocks, one per call."""
        decoder = json.JSONDecoder()
        calls: list[ToolCall] = []
        for block in body.split(self.marker)[1:]:
            name, sep, args = block.partition(self.args_marker)
            name = name.strip()
            if not sep or not name:
                raise _CallError(f"a {self.marker} block has no 'name{self.args_marker}' header")
            args = args.strip()
            try:
                arguments, end = decoder.raw_decode(args)
            except json.JSONDecodeError as exc:
                raise _CallError(_json_error(exc, args)) from exc
            if args[end:].strip():
                raise _CallError(f"text follows the arguments of {name!r}: {args[end:].strip()[:40]!r}")
            raw = f"{self.marker}{block}".rstrip()
            calls.append(
                _call_from_object({"name": name, "arguments": arguments}, raw, arguments_keys=("arguments",))
            )
        return calls


def _response_parsing(tokenizer: Any) -> Literal["template", "schema"] | None:
    """Returns which of transformers' response parsers the tokenizer can use with the installed transformers.

    transformers 5.0-5.12 read a regex `response_schema`; 5.13 replaced it with a `response_template`
    whose `parse_response` takes `prefix=` (and drops `response_schema` silently), so the attribute a
    tokenizer carries only counts when the installed `parse_response` reads it.
    """
    method = getattr(tokenizer, "parse_response", None)
    if method is None:
        return None
    takes_prefix = "prefix" in inspect.signature(method).parameters
    if takes_prefix and getattr(tokenizer, "response_template", None) is not None:
        return "template"
    if not takes_prefix and getattr(tokenizer, "response_schema", None) is not None:
        return "schema"
    return None


def _call_from_parsed(entry: Any) -> ToolCall:
    """Returns the ToolCall of one entry of transformers' parsed `tool_calls` (nested or flat)."""
    if not isinstance(entry, dict):
        raise _CallError(f"a parsed tool call is a {type(entry).__name__}, not an object")
    function = entry.get("function", entry)
    if not isinstance(function, dict):
        raise _CallError("a parsed tool call's 'function' is not an object")
    raw = json.dumps(
        {"name": function.get("name"), "arguments": function.get("arguments")},
        ensure_ascii=False,
        default=str,
    )
    call = _call_from_object(function, raw, arguments_keys=("arguments",))
    call_id = entry.get("id")
    if isinstance(call_id, str) and call.id is None:
        return ToolCall(name=call.name, arguments=call.arguments, raw=call.raw, id=call_id)
    return call


class TransformersParser:
    """transformers' own response parsing (`tokenizer.parse_response`) with the tokenizer's response schema.

    `check`, a parser of the template's family, vets the turn's structure first: transformers closes an
    open region at the end of the text, so a `<tool_call>` the model never closed would otherwise parse as
    a complete call.
    """

    name = "transformers"

    def __init__(
        self,
        tokenizer: Any,
        *,
        tools: Sequence[dict[str, Any]] | None = None,
        check: ToolParser | None = None,
    ) -> None:
        kind = _response_parsing(tokenizer)
        if kind is None:
            raise ConfigError(
                "tool_parser='transformers' needs a tokenizer with a response schema the installed transformers "
                "reads (`response_template` on transformers >= 5.13, `response_schema` before); this tokenizer has "
                "none: set one, or choose a parser by name (tool_parser="
                + " / ".join(sorted(TOOL_PARSERS))
                + ")"
            )
        self._tokenizer = tokenizer
        self._kind = kind
        self._tools = list(tools) if tools else None
        self._takes_tools = "tools" in inspect.signature(tokenizer.parse_response).parameters
        self._check = check

    def parse(self, text: str, *, prefix: str = "") -> ParsedResponse:
        """Returns transformers' parse of `text` (after `prefix`, the prompt, on transformers >= 5.13)."""
        if self._check is not None:
            checked = self._check.parse(text, prefix=prefix)
            if checked.status == "malformed":
                return checked
        kwargs: dict[str, Any] = {}
        if self._kind == "template":
            kwargs["prefix"] = prefix
            if self._takes_tools and self._tools:
                kwargs["tools"] = self._tools
        try:
            parsed = self._tokenizer.parse_response(text, **kwargs)
        except (ValueError, TypeError, KeyError) as exc:
            return ParsedResponse(content=text, error=f"transformers' response parser failed: {exc}")
        if not isinstance(parsed, dict):
            return ParsedResponse(content=text, error="transformers' response parser returned nothing")
        content = parsed.get("content")
        content = content if isinstance(content, str) else ""
        eos = getattr(self._tokenizer, "eos_token", None)
        if eos:
            # transformers/issues/42249: an end-of-turn token can be left at the end of the content
            content = content.removesuffix(eos).rstrip()
        try:
            calls = tuple(_call_from_parsed(entry) for entry in parsed.get("tool_calls") or [])
        except _CallError as exc:
            return ParsedResponse(content=text, error=str(exc))
        return ParsedResponse(content=content, calls=calls)


TOOL_PARSERS: dict[str, Callable[[], ToolParser]] = {
    "hermes": HermesParser,
    "qwen": HermesParser,
    "llama3_json": Llama3JsonParser,
    "llama3": Llama3JsonParser,
    "mistral": MistralParser,
}
if (*TOOL_PARSERS, "transformers") != choices.TOOL_PARSERS:  # the config validates against the light list
    raise ImportError(f"cohort.choices.TOOL_PARSERS must name {(*TOOL_PARSERS, 'transformers')}")
"""Tool parsers by the name `tool_parser=` takes ("transformers" too, which needs a response schema)."""


def _template_text(source: Any) -> str | None:
    """Returns the chat template of a tokenizer, processor or template string (a dict's tool_use or default one)."""
    template = source if isinstance(source, (str, dict)) else getattr(source, "chat_template", None)
    if template is None and hasattr(source, "tokenizer"):
        template = getattr(source.tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("tool_use") or template.get("default")
    return template if isinstance(template, str) else None


def template_family(template: str) -> str | None:
    """Returns the name of the tool parser whose format a chat template renders, or None when none matches."""
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|start_header_id|>" in template and (
        "<|python_tag|>" in template or '"parameters"' in template or "ipython" in template
    ):
        return "llama3_json"
    return None


def parser_for(
    tokenizer_or_template: Any,
    *,
    tool_parser: str | None = None,
    tools: Sequence[dict[str, Any]] | None = None,
) -> ToolParser:
    """Returns the tool parser for a tokenizer (or a chat template string): `tool_parser` by name when given;
    else transformers' response parsing when the tokenizer has a response schema the installed transformers
    reads; else the parser of the family the chat template renders. `tools` (JSON schemas) let transformers
    >= 5.15 type the arguments."""
    template = _template_text(tokenizer_or_template)
    family = template_family(template) if template else None
    if tool_parser is not None:
        if tool_parser == "transformers":
            check = TOOL_PARSERS[family]() if family else None
            return TransformersParser(tokenizer_or_template, tools=tools, check=check)
        if tool_parser not in TOOL_PARSERS:
            raise ConfigError(
                f"tool_parser={tool_parser!r} is not a known tool-call format; choose one of "
                f"{sorted([*TOOL_PARSERS, 'transformers'])}"
            )
        return TOOL_PARSERS[tool_parser]()
    tokenizer = None if isinstance(tokenizer_or_template, (str, dict)) else tokenizer_or_template
    if tokenizer is not None and _response_parsing(tokenizer) is not None:
        check = TOOL_PARSERS[family]() if family else None
        return TransformersParser(tokenizer, tools=tools, check=check)
    if family is None:
        what = "the chat template" if template else "this tokenizer (it has no chat template)"
        raise ConfigError(
            f"cannot tell which tool-call format {what} uses: it renders none of <tool_call> (Qwen / Hermes), "
            f"[TOOL_CALLS] (Mistral) or Llama 3's JSON calls, and the tokenizer has no response schema for "
            f"transformers' parse_response. Name the format with tool_parser= (one of "
            f"{sorted([*TOOL_PARSERS, 'transformers'])}) or use a chat template that supports tools"
        )
    return TOOL_PARSERS[family]()
