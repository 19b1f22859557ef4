"""The built-in multiply task (seeded, disjoint, sized by digits) and its SFT pairs, which must be the very ids of
the conversation's rendering with the Hermes tool template (tool turns by render_tool_turn)."""

from __future__ import annotations

import re

import pytest

from cohort.data import TASKS, MultiplyTask, get_task, make_task
from cohort.data.tool_sft import (
    conversation_pairs,
    multiply_conversation,
    multiply_sft_pairs,
    multiply_tool_schemas,
)
from cohort.episodes import HermesParser, install_tool_format
from cohort.models import build_tiny_tokenizer

PROMPT = re.compile(r"What is (\d+) \* (\d+)\? You may call the multiply tool\. Reply with the number only\.")


def digits(n: int) -> int:
    return len(str(n))


def test_rows_are_conversations_with_the_exact_product():
    train, held = make_task("multiply", n_train=300, n_eval=100, seed=0)
    for row in train + held:
        assert set(row) == {"prompt", "answer", "factors"}
        (message,) = row["prompt"]
        assert message["role"] == "user"
        a, b = (int(x) for x in PROMPT.fullmatch(message["content"]).groups())
        assert row["factors"] == [a, b] and row["answer"] == str(a * b)
        assert 3 <= digits(a) <= 4 and 2 <= digits(b) <= 4  # the defaults: too large to multiply in the head
    assert {digits(r["factors"][0]) for r in train} == {3, 4}
    assert {digits(r["factors"][1]) for r in train} == {2, 3, 4}


def test_seeded_and_disjoint():
    train, held = make_task("multiply", n_train=500, n_eval=100, seed=7)
    assert make_task("multiply", n_train=500, n_eval=100, seed=7) == (train, held)
    assert make_task("multiply", n_train=500, n_eval=100, seed=8)[1] != held
    assert make_task("multiply", n_train=20, n_eval=100, seed=7)[1] == held  # held-out set fixed by the seed
    train_pairs = {tuple(r["factors"]) for r in train}
    held_pairs = {tuple(r["factors"]) for r in held}
    assert len(train_pairs) == 500 and len(held_pairs) == 100 and not train_pairs & held_pairs


def test_sizes_by_digits():
    assert TASKS["multiply"] is MultiplyTask and isinstance(get_task("multiply"), MultiplyTask)
    rows, _ = make_task("multiply", n_train=50, n_eval=0, seed=0, digits_a=5, digits_b=[1, 2])
    assert all(digits(r["factors"][0]) == 5 and 1 <= digits(r["factors"][1]) <= 2 for r in rows)
    one = get_task("multiply", digits_a=1, digits_b=1)
    assert one.size == 81  # 1..9 times 1..9
    train, held = make_task(one, n_train=71, n_eval=10, seed=0)
    assert {tuple(r["factors"]) for r in train + held} == {(a, b) for a in range(1, 10) for b in range(1, 10)}
    with pytest.raises(ValueError, match="only 81 distinct problems"):
        make_task("multiply", n_train=72, n_eval=10, seed=0, digits_a=1, digits_b=1)


@pytest.mark.parametrize(
    "options, needle",
    [
        ({"digits_a": 0}, "digits_a=0"),
        ({"digits_b": 10}, "digits_b=10"),
        ({"digits_a": [4, 3]}, "digits_a=[4, 3]"),
        ({"digits_a": [1, 2, 3]}, "digits_a=[1, 2, 3]"),
        ({"digits_b": "3"}, "digits_b='3'"),
        ({"digits_b": True}, "digits_b=True"),
        ({"digits_a": 2.0}, "digits_a=2.0"),
    ],
)
def test_bad_sizes_name_the_fix(options, needle):
    with pytest.raises(ValueError, match=re.escape(needle) + r" must be a number of digits in 1\.\.9"):
        make_task("multiply", n_train=1, n_eval=1, **options)
    with pytest.raises(ValueError, match="unsupported parameters"):
        make_task("multiply", n_train=1, n_eval=1, digits=3)


@pytest.fixture(scope="module")
def tokenizer():
    return install_tool_format(build_tiny_tokenizer(), "hermes")


def _rendered_ids(tokenizer, messages, tools):
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _through_last_end(ids, end):
    return ids[: max(i for i, t in enumerate(ids) if t == end) + 1]


def test_a_conversation_and_its_two_pairs(tokenizer):
    rows, _ = make_task("multiply", n_train=3, n_eval=0, seed=0)
    schemas = multiply_tool_schemas()
    end = tokenizer.eos_token_id
    for row in rows:
        messages = multiply_conversation(row)
        assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant"]
        assert messages[2]["content"] == messages[3]["content"] == row["answer"]
        (call_prompt, call), (answer_prompt, answer) = multiply_sft_pairs(tokenizer, [row])
        # each pair's prompt + completion is the rendering of the conversation up to that turn, through its end
        assert call_prompt + call == _through_last_end(_rendered_ids(tokenizer, messages[:2], schemas), end)
        assert answer_prompt + answer == _through_last_end(_rendered_ids(tokenizer, messages, schemas), end)
        assert answer_prompt[: len(call_prompt) + len(call)] == call_prompt + call
        assert call[-1] == answer[-1] == end and end not in call[:-1] + answer[:-1]
        # the prompt is what the loop renders (tools listed, assistant header), and the call parses back
        assert tokenizer.decode(call_prompt).startswith("<|im_start|>system\n# Tools")
        assert tokenizer.decode(call_prompt).endswith(
            "Reply with the number only.<|im_end|>\n<|im_start|>assistant\n"
        )
        parsed = HermesParser().parse(tokenizer.decode(call))
        assert parsed.status == "calls" and parsed.calls[0].arguments == dict(zip("ab", row["factors"]))
        assert tokenizer.decode(answer) == row["answer"] + "<|im_end|>"


def test_pairs_without_the_tool_list_and_over_several_rounds(tokenizer):
    (row,) = make_task("multiply", n_train=1, n_eval=0, seed=1)[0]
    short = multiply_sft_pairs(tokenizer, [row], tools=[])
    assert not tokenizer.decode(short[0][0]).startswith("<|im_start|>system")
    messages = multiply_conversation(row)
    rounds = [*messages[:3], *messages[1:3], messages[3]]  # the model calls the tool twice before answering
    pairs = conversation_pairs(tokenizer, rounds, tools=multiply_tool_schemas())
    assert len(pairs) == 3
    prompt, completion = pairs[-1]
    full = _through_last_end(
        _rendered_ids(tokenizer, rounds, multiply_tool_schemas()), tokenizer.eos_token_id
    )
    assert prompt + completion == full


def test_bad_conversations(tokenizer):
    (row,) = make_task("multiply", n_train=1, n_eval=0, seed=0)[0]
    messages = multiply_conversation(row)
    with pytest.raises(ValueError, match="at least one assistant message"):
        conversation_pairs(tokenizer, messages[:1])
    with pytest.raises(ValueError, match="must start with the prompt"):
        conversation_pairs(tokenizer, messages[1:])
    with pytest.raises(ValueError, match="consecutive assistant turns"):
        conversation_pairs(tokenizer, [messages[0], messages[3], messages[3]])
    with pytest.raises(ValueError, match="needs 'prompt'.*'factors'"):
        multiply_conversation({"prompt": row["prompt"], "answer": row["answer"]})
    plain = build_tiny_tokenizer()  # EOS <|endoftext|>, which the Hermes template never writes
    plain.chat_template = install_tool_format(build_tiny_tokenizer(), "hermes").chat_template
    with pytest.raises(ValueError, match="without an end-of-turn token"):
        conversation_pairs(plain, messages)
