"""Talking to a model outside training: batch generation from prompts, and a multi-turn chat session.

Both sample with the builtin rollout engine, stopping at the model's EOS tokens (:func:`cohort.models.
stop_token_ids`). The command line wraps them as ``cohort generate`` and ``cohort chat``.
"""

from __future__ import annotations

import dataclasses
import os
import unicodedata
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from cohort.data import encode_prompts, load_rows, prompt_text
from cohort.models import input_device, stop_token_ids, text_config
from cohort.rollout import RolloutEngine, SamplingParams, make_engine

__all__ = [
    "CHAT_TEMPLATE_MODES",
    "ChatSession",
    "ChatTurn",
    "chat_loop",
    "generate_rows",
    "printable",
    "read_prompts",
]

CHAT_TEMPLATE_MODES: dict[str, bool | None] = {"auto": None, "on": True, "off": False}
"""``--chat-template`` choices and the ``chat_template`` argument of :func:`cohort.data.encode_prompts`."""

Prompt = str | list[dict[str, Any]]


def read_prompts(path: str | os.PathLike, *, prompt_column: str = "prompt") -> list[Prompt]:
    """Returns the prompts of a file: the non-blank lines of a .txt, else the prompt column of a JSONL / JSON file."""
    file = Path(os.fspath(path)).expanduser()
    if file.suffix.lower() == ".txt":
        if not file.is_file():
            raise ValueError(f"prompts file {os.fspath(path)!r} not found")
        try:
            lines = file.read_text(encoding="utf-8").splitlines()
        except UnicodeDecodeError as exc:
            raise ValueError(f"prompts file {os.fspath(path)!r} is not UTF-8 text: {exc}") from exc
        prompts: list[Prompt] = [line for line in lines if line.strip()]
        if not prompts:
            raise ValueError(f"prompts file {os.fspath(path)!r} holds no prompt (only blank lines)")
        return prompts
    if not file.exists():
        raise ValueError(
            f"prompts file {os.fspath(path)!r} not found; pass a .txt (one prompt per line) or a "
            ".jsonl / .json file with a prompt column"
        )
    need = "`cohort generate` needs at least one prompt to generate from"
    return [row[prompt_column] for row in load_rows(file, prompt_column=prompt_column, need=need)]


def _engine(model: torch.nn.Module, tokenizer: Any, engine: RolloutEngine | None) -> RolloutEngine:
    """Returns ``engine``, or the builtin engine stopping at the model's EOS tokens when it is None."""
    if engine is not None:
        return engine
    eos_ids, pad = stop_token_ids(model, tokenizer)
    return make_engine("builtin", eos_token_ids=eos_ids, pad_token_id=pad)


def _generator(model: torch.nn.Module, seed: int) -> torch.Generator:
    """Returns a generator seeded with ``seed`` on the device type of the model's inputs."""
    return torch.Generator(device=input_device(model)).manual_seed(seed)


def generate_rows(
    model: torch.nn.Module,
    tokenizer: Any,
    prompts: Sequence[Prompt],
    params: SamplingParams,
    *,
    n: int = 1,
    seed: int = 0,
    chat_template: bool | None = None,
    batch_size: int = 16,
    engine: RolloutEngine | None = None,
) -> list[dict[str, Any]]:
    """Returns one ``{"prompt", "completions", "finish_reasons"}`` dict per prompt, with ``n`` completions each.

    A finish reason is ``"eos"`` (the model ended the completion) or ``"length"`` (it reached
    ``params.max_completion_length``, or the end of the model's context, first). ``chat_template`` is that of :func:`cohort.data.encode_prompts`.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1 completions per prompt, got {n}")
    prompt_ids = encode_prompts(tokenizer, list(prompts), chat_template=chat_template)
    engine = _engine(model, tokenizer, engine)
    generator = _generator(model, seed)
    # Past the model's context the positions were never trained: each completion is cut to the room its
    # prompt leaves (as ChatSession does), and prompts are generated in runs of equal limits.
    limits = _completion_limits(model, prompt_ids, params.max_completion_length)
    runs: dict[int, list[int]] = {}
    for i, limit in enumerate(limits):
        runs.setdefault(limit, []).append(i)
    rows: list[dict[str, Any] | None] = [None] * len(prompt_ids)
    for limit, indices in runs.items():
        run_params = dataclasses.replace(params, max_completion_length=limit)
        for start in range(0, len(indices), batch_size):
            chunk = indices[start : start + batch_size]
            batch = engine.generate(model, [prompt_ids[i] for i in chunk], n, run_params, generator)
            texts = tokenizer.batch_decode(batch.completion_ids, skip_special_tokens=True)
            reasons = ["length" if t else "eos" for t in batch.truncated.tolist()]
            for j, i in enumerate(chunk):
                rows[i] = {
                    "prompt": prompts[i],
                    "completions": texts[j * n : (j + 1) * n],
                    "finish_reasons": reasons[j * n : (j + 1) * n],
                }
    return [row for row in rows if row is not None]


def _completion_limits(model: torch.nn.Module, prompt_ids: Sequence[Sequence[int]], wanted: int) -> list[int]:
    """Returns the most new tokens each prompt may get within the model's context (`wanted` at most)."""
    context = getattr(text_config(model), "max_position_embeddings", None)
    if not isinstance(context, int) or context <= 0:
        return [wanted] * len(prompt_ids)
    full = [i for i, ids in enumerate(prompt_ids) if len(ids) >= context]
    if full:
        longest = max(len(prompt_ids[i]) for i in full)
        raise ValueError(
            f"{len(full)} prompt(s) (prompt {full[0]} first, the longest {longest} tokens) fill the model's "
            f"context of {context} tokens (max_position_embeddings), leaving no room for a completion; "
            "shorten them"
        )
    return [min(wanted, context - len(ids)) for ids in prompt_ids]


def printable(text: str) -> str:
    """Returns ``text`` with control characters other than newline and tab written as escapes (safe for a terminal)."""
    return "".join(c if c in "\n\t" or unicodedata.category(c) != "Cc" else repr(c)[1:-1] for c in text)


@dataclass
class ChatTurn:
    """One reply of a :class:`ChatSession`."""

    reply: str
    """The decoded reply (special tokens removed)."""
    finish_reason: str
    """``"eos"`` or ``"length"``."""
    prompt: str
    """The templated text the reply was sampled from."""
    dropped: int
    """How many old messages were left out of the prompt so that it fits the model's context."""


class ChatSession:
    """A conversation with a model: the message history, rendered with the tokenizer's chat template each turn."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        params: SamplingParams,
        *,
        system: str | None = None,
        seed: int = 0,
        engine: RolloutEngine | None = None,
    ) -> None:
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError(
                "the tokenizer has no chat template, which a chat needs; use `cohort generate --prompt TEXT` "
                "for plain-text prompts"
            )
        self.model = model
        self.tokenizer = tokenizer
        self.params = params
        self.system = system
        self.engine = _engine(model, tokenizer, engine)
        self.generator = _generator(model, seed)
        self.messages: list[dict[str, str]] = []
        config = text_config(model)
        limit = getattr(config, "max_position_embeddings", None)
        self.context_limit: int | None = limit if isinstance(limit, int) and limit > 0 else None

    def reset(self) -> None:
        """Returns None after clearing the history (the system message stays)."""
        self.messages = []

    def _conversation(self, messages: Sequence[dict[str, str]]) -> list[dict[str, str]]:
        """Returns ``messages`` behind the system message, if any."""
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + list(messages)

    @staticmethod
    def check_text(user_text: str) -> None:
        """Returns None when `user_text` is text a tokenizer can encode; raises ValueError naming the first
        character that is not (a byte that was not UTF-8, which stdin hands over as a lone surrogate, or NUL)."""
        try:
            user_text.encode("utf-8")
        except UnicodeEncodeError as exc:
            char = user_text[exc.start]
            byte = f"byte 0x{ord(char) - 0xDC00:02x}" if 0xDC80 <= ord(char) <= 0xDCFF else repr(char)
            raise ValueError(
                f"that line is not UTF-8 text ({byte} at character {exc.start + 1}); type it again, or set the "
                "terminal's encoding to UTF-8"
            ) from None
        nul = user_text.find("\x00")
        if nul >= 0:
            raise ValueError(
                f"that line holds a NUL byte at character {nul + 1}, which is not text; type it again"
            )

    def prompt_for(self, user_text: str) -> tuple[str, list[int], int]:
        """Returns (templated prompt, its token ids, messages dropped) for the history plus ``user_text``.

        The oldest exchanges are left out while the prompt plus ``max_completion_length`` new tokens
        would not fit the model's ``max_position_embeddings``.
        """
        self.check_text(user_text)
        history = [*self.messages, {"role": "user", "content": user_text}]
        while True:
            conversation = self._conversation(history)
            text = prompt_text(self.tokenizer, conversation, chat_template=True)
            ids = encode_prompts(self.tokenizer, [conversation], chat_template=True)[0]
            room = None if self.context_limit is None else self.context_limit - len(ids)
            if room is None or room >= self.params.max_completion_length or len(history) == 1:
                break
            history = history[2:] if len(history) > 2 and history[0]["role"] == "user" else history[1:]
        if room is not None and room < 1:
            raise ValueError(
                f"this message makes a prompt of {len(ids)} tokens, which leaves no room for a reply in the "
                f"model's context of {self.context_limit} tokens; send a shorter one"
            )
        return text, ids, len(self.messages) + 1 - len(history)

    def reply(self, user_text: str) -> ChatTurn:
        """Returns the model's reply to ``user_text``; the history gains both messages only once the reply is done.

        A reply is shortened to what is left of the model's context when the prompt leaves less room
        than ``max_completion_length``.
        """
        text, ids, dropped = self.prompt_for(user_text)
        params = self.params
        if self.context_limit is not None and len(ids) + params.max_completion_length > self.context_limit:
            params = dataclasses.replace(params, max_completion_length=self.context_limit - len(ids))
        batch = self.engine.generate(self.model, [ids], 1, params, self.generator)
        reply = self.tokenizer.decode(batch.completion_ids[0], skip_special_tokens=True)
        self.messages += [{"role": "user", "content": user_text}, {"role": "assistant", "content": reply}]
        reason = "length" if bool(batch.truncated[0]) else "eos"
        return ChatTurn(reply=reply, finish_reason=reason, prompt=text, dropped=dropped)


HELP = "commands: /reset clears the history, /exit (or Ctrl-D) quits; Ctrl-C stops a reply"


def chat_loop(
    session: ChatSession,
    *,
    read: Callable[[str], str] = input,
    write: Callable[[str], None] = print,
    show_prompt: bool = False,
) -> int:
    """Returns 0 after running the read-reply loop until /exit or end of input; Ctrl-C aborts only the reply.

    ``read`` gets the "you> " prompt and returns a line (EOFError ends the chat); ``write`` prints one line.
    """
    write(HELP)
    while True:
        try:
            line = read("you> ")
        except EOFError:
            write("")
            return 0
        except KeyboardInterrupt:  # Ctrl-C at the prompt drops the line being typed, as a shell does
            write("")
            continue
        except UnicodeDecodeError as exc:
            # A terminal or pipe in another encoding: that line is lost, not the chat.
            write(f"error: that line is not UTF-8 text ({exc.reason} at byte {exc.start}); type it again")
            continue
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            return 0
        if text == "/reset":
            session.reset()
            write("(history cleared)")
            continue
        if text in ("/help", "/?"):
            write(HELP)
            continue
        try:
            turn = session.reply(line)
        except KeyboardInterrupt:
            write("\n(reply interrupted; the history is unchanged)")
            continue
        except ValueError as exc:
            write(f"error: {exc}")
            continue
        if turn.dropped:
            write(f"(left the {turn.dropped} oldest message(s) out of the prompt to fit the model's context)")
        if show_prompt:
            write("prompt> " + repr(turn.prompt))
        write(f"model> {printable(turn.reply)}")
        if turn.finish_reason == "length":
            write("(the reply reached --max-new-tokens)")
