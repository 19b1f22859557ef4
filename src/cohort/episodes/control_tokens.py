"""The text a tool parser reads of one sampled turn: a control token counts only where the model sampled its id.

A chat template's control tokens (`<tool_call>`, `</tool_call>`, `<|im_end|>`, `[TOOL_CALLS]`, ...) are added
tokens of the tokenizer. A model can also write one's spelling with ordinary tokens (`<`, `tool`, `_call`, `>`):
decoded, the two read the same, and a parser of the text would take the spelling for the delimiter. transformers
5.25 parses a turn's generated ids instead and reads such a spelling as plain text (so does TRL, which hands it
the ids); cohort does the same on every transformers version, with its own parsers too: in the text handed to a
parser each spelled-out control token carries `MARKER` between its characters, so no delimiter matches it, and
`unmark` takes the markers out of what the parser returns.

Which added tokens are control tokens follows transformers' rule: the special ones, and those the chat template
writes (whitespace tokens apart, which templates hold as ordinary text).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from itertools import groupby
from typing import Any

from cohort.episodes.parsers import ParsedResponse

MARKER = "\ufdd2"
"""A Unicode noncharacter (reserved for a program's internal use: no model writes it), put inside spelled-out
control tokens."""


def control_tokens(tokenizer: Any) -> dict[int, str]:
    """Returns {id: spelling} of the tokenizer's control tokens: its special added tokens and the added tokens its
    chat template(s) write."""
    template = getattr(tokenizer, "chat_template", None)
    templates = list(template.values()) if isinstance(template, dict) else [template or ""]
    text = "\n".join(t for t in templates if isinstance(t, str))
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return {
        int(token_id): token.content
        for token_id, token in decoder.items()
        if token.content and (token.special or (token.content in text and not token.content.isspace()))
    }


def parse_text(tokenizer: Any, ids: Sequence[int], control: dict[int, str]) -> str:
    """Returns the turn `ids` decoded with its special tokens kept, every control token's spelling that the model
    wrote with other tokens broken by `MARKER`: the plain decoding where there is none (almost always)."""
    text = tokenizer.decode(ids)
    if not control or not _spelled_out(text, ids, control):
        return text
    # Each run of ordinary tokens is the text its ids add to the decoding so far, so that what a decoder does at
    # the start of a sequence (a Metaspace decoder drops a leading space) happens only where the turn starts.
    pieces, start, before = [], 0, ""
    for is_control, run in groupby(ids, control.__contains__):
        end = start + len(list(run))
        upto = tokenizer.decode(ids[:end])
        piece = upto[len(before) :] if upto.startswith(before) else tokenizer.decode(ids[start:end])
        pieces.append(piece if is_control else _defuse(piece, control))
        start, before = end, upto
    return "".join(pieces)


def unmark(parsed: ParsedResponse) -> ParsedResponse:
    """Returns `parsed` without the markers `parse_text` put in its text (content, calls, error)."""
    calls = tuple(
        dataclasses.replace(
            call,
            name=_strip(call.name),
            arguments=_strip(call.arguments),
            raw=_strip(call.raw),
            id=_strip(call.id),
        )
        for call in parsed.calls
    )
    return ParsedResponse(content=_strip(parsed.content), calls=calls, error=_strip(parsed.error))


def _spelled_out(text: str, ids: Sequence[int], control: dict[int, str]) -> bool:
    """Returns whether a control token's spelling occurs in `text` more often than the turn sampled its id (or a
    longer control token holding it)."""
    sampled = [control[i] for i in ids if i in control]
    for spelling in set(control.values()):
        found = text.count(spelling)
        if found and found > sum(written.count(spelling) for written in sampled):
            return True
    return False


def _defuse(text: str, control: dict[int, str]) -> str:
    """Returns `text` with `MARKER` between the characters of every control token's spelling in it."""
    # a longer spelling first: broken, it no longer holds a shorter one it contains
    for spelling in sorted(set(control.values()), key=len, reverse=True):
        if spelling in text:
            text = text.replace(spelling, MARKER.join(spelling))
    return text


def _strip(value: Any) -> Any:
    """Returns `value` (a string, or JSON-like lists and dicts of them) without `MARKER`."""
    if isinstance(value, str):
        return value.replace(MARKER, "")
    if isinstance(value, list):
        return [_strip(item) for item in value]
    if isinstance(value, dict):
        return {_strip(key): _strip(item) for key, item in value.items()}
    return value


__all__ = ["MARKER", "control_tokens", "parse_text", "unmark"]
