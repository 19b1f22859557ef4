"""A delimiter counts only where the model sampled its token: a `<tool_call>` spelled out with ordinary tokens is
plain text to every parser (cohort.episodes.control_tokens), as transformers 5.25 parses generated ids."""

from __future__ import annotations

import pytest
import torch
from _scripted_lm import ScriptedLM, script_of
from tokenizers import AddedToken

from cohort.config import EpisodeConfig
from cohort.episodes.control_tokens import MARKER, control_tokens, parse_text, unmark
from cohort.episodes.multiturn import EpisodeGeneration
from cohort.episodes.parsers import TOOL_PARSERS, TransformersParser
from cohort.episodes.spec import build_episode_spec
from cohort.episodes.templates import install_tool_format, render_prompt
from cohort.models import build_tiny_tokenizer
from cohort.rollout import SamplingParams

CALL = '<tool_call>\n{"name": "echo", "arguments": {"text": "hi"}}\n</tool_call>'


def echo(text: str) -> str:
    """Echoes its text.

    Args:
        text: What to echo.
    """
    return text


@pytest.fixture(scope="module")
def tok():
    return install_tool_format(build_tiny_tokenizer(), "hermes")


def sampled(tok, text):
    """Returns the ids of `text` as a model samples a template's tokens: each added token as its id."""
    return tok(text, add_special_tokens=False)["input_ids"]


def spelled(tok, text):
    """Returns the ids of `text` written with ordinary tokens only (every added token spelled out)."""
    return tok(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]


def test_the_control_tokens_are_the_special_ones_and_those_the_template_writes(tok):
    tok = install_tool_format(build_tiny_tokenizer(), "hermes")
    tok.add_tokens(
        [AddedToken("<note>", special=False, normalized=False), AddedToken("  ", normalized=False)]
    )
    control = control_tokens(tok)
    spellings = set(control.values())
    assert {"<tool_call>", "</tool_call>", "<|im_start|>", "<|im_end|>"} <= spellings
    assert "<note>" not in spellings and "  " not in spellings  # neither special nor written by the template
    tok.chat_template += "{# <note> #}"
    assert "<note>" in set(control_tokens(tok).values())
    assert all(tok.convert_ids_to_tokens(i) == s for i, s in control.items())


def test_a_turn_without_a_spelled_out_control_token_reads_as_its_plain_decoding(tok):
    control = control_tokens(tok)
    for text in (CALL, "no call here", CALL + "\nafter", "<tool_call>\n{broken"):
        ids = sampled(tok, text)
        assert parse_text(tok, ids, control) == tok.decode(ids)


def test_a_spelled_out_delimiter_is_broken_by_markers_and_nothing_else_changes(tok):
    control = control_tokens(tok)
    text = parse_text(tok, spelled(tok, CALL), control)
    assert "<tool_call>" not in text and "</tool_call>" not in text
    assert MARKER.join("<tool_call>") in text and MARKER.join("</tool_call>") in text
    assert text.replace(MARKER, "") == CALL
    # one real token beside a spelled one: only the spelled one is broken
    ids = sampled(tok, "<tool_call>") + spelled(tok, '\n{"name": "echo"}\n</tool_call>')
    text = parse_text(tok, ids, control)
    assert text.startswith("<tool_call>\n") and MARKER.join("</tool_call>") in text


def test_a_sampled_token_whose_text_holds_a_delimiter_is_read_as_written(tok):
    """An added special token that writes a whole call is a control token: its delimiters count (the TRL agent
    tests' scripted models use one)."""
    tok = install_tool_format(build_tiny_tokenizer(), "hermes")
    tok.add_tokens([AddedToken(CALL + "\n" + CALL, special=True, normalized=False)])
    ids = tok(CALL + "\n" + CALL, add_special_tokens=False)["input_ids"]
    assert len(ids) == 1
    assert parse_text(tok, ids, control_tokens(tok)) == CALL + "\n" + CALL


@pytest.mark.parametrize("parser", ["hermes", "transformers"])
def test_no_parser_takes_a_spelled_out_call_and_a_sampled_one_is_unchanged(tok, parser):
    if parser == "transformers":
        trl = pytest.importorskip("trl.chat_template_utils")
        tok = install_tool_format(build_tiny_tokenizer(), "hermes")
        tok.response_template = trl.qwen3_template
        try:
            chosen = TransformersParser(tok)
        except Exception as exc:  # a transformers without response templates
            pytest.skip(f"transformers' response parsing is not available here: {exc}")
    else:
        chosen = TOOL_PARSERS[parser]()
    control = control_tokens(tok)
    real = unmark(chosen.parse(parse_text(tok, sampled(tok, CALL), control), prefix=""))
    assert (
        real.status == "calls" and real.calls[0].name == "echo" and real.calls[0].arguments == {"text": "hi"}
    )
    fake = unmark(chosen.parse(parse_text(tok, spelled(tok, CALL), control), prefix=""))
    assert fake.status == "none" and fake.content == CALL  # the text as the model wrote it, no marker left


def test_a_spelled_out_token_inside_a_sampled_call_is_the_arguments_text(tok):
    control = control_tokens(tok)
    ids = (
        sampled(tok, '<tool_call>\n{"name": "echo", "arguments": {"text": "')
        + spelled(tok, "say <|im_end|> and <tool_call>")
        + sampled(tok, '"}}\n</tool_call>')
    )
    parsed = unmark(TOOL_PARSERS["hermes"]().parse(parse_text(tok, ids, control)))
    assert parsed.status == "calls"
    (call,) = parsed.calls
    assert call.arguments == {"text": "say <|im_end|> and <tool_call>"}
    assert MARKER not in call.raw and "say <|im_end|>" in call.raw


def test_an_episode_runs_a_sampled_call_and_not_a_spelled_one(tok):
    spec = build_episode_spec(EpisodeConfig(), tools=[echo])
    messages = [{"role": "user", "content": "say hi"}]
    prompt = render_prompt(tok, messages, tools=spec.schemas(None))
    eos = [tok.eos_token_id]
    for ids, calls in ((sampled(tok, CALL) + eos, 1), (spelled(tok, CALL) + eos, 0)):
        model = ScriptedLM(len(tok), tok.eos_token_id, script_of(len(prompt), [(True, ids)]))
        loop = EpisodeGeneration(spec, model, tok, end_of_turn_ids=eos, pad_token_id=tok.pad_token_id)
        try:
            batch = loop.generate(
                [prompt],
                1,
                SamplingParams(max_completion_length=len(ids)),
                torch.Generator(),
                rows=[{"prompt": messages}],
            )
        finally:
            loop.close()
        record = batch.episodes[0]
        assert record.calls == calls
        if not calls:
            assert record.stop == "answer" and record.messages == [{"role": "assistant", "content": CALL}]
