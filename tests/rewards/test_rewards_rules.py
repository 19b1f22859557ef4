"""Built-in reward functions on hand-written strings."""

from __future__ import annotations

import sys
import types

import pytest

from cohort.rewards import (
    accuracy_reward,
    completion_text,
    extract_answer,
    format_reward,
    make_length_reward,
    make_overlong_reward,
    parse_number,
)


@pytest.mark.parametrize(
    "completion, answer, expected",
    [
        ("46", "46", 1.0),
        ("12+34=46", "46", 1.0),
        ("The sum is 46.", "46", 1.0),
        ("I think 45, no wait: 46", "46", 1.0),  # the last number counts
        ("46 then 47", "46", 0.0),
        ("no digits here", "46", 0.0),
        ("", "46", 0.0),
        ("=-13", "-13", 1.0),
        ("2-15+1=-13+1=-12", "-12", 1.0),  # worked chain: the final "=-12" is negative
        ("11-5", "-5", 0.0),  # a minus after a digit is subtraction, so the last number is 5
        ("answer: -7", "-7", 1.0),
        ("3.50", "3.5", 1.0),
        ("about 0.3", "0.30", 1.0),
        ("0.333", "1/3", 0.0),  # exact comparison, no tolerance
        ("that is 3/4", "0.75", 1.0),
        ("-3/4", "-0.75", 1.0),
        ("total 1,234,567 apples", "1234567", 1.0),
        ("1000", "1,000", 1.0),
        ("46.0", "46", 1.0),
        (r"so \boxed{46} and then 99", "46", 1.0),  # boxed beats the last number
        (r"\boxed{4} ... \boxed{46}", "46", 1.0),  # the last box counts
        (r"\boxed{\frac{3}{4}}", "0.75", 1.0),  # nested braces
        (r"\boxed{46 apples}", "46", 1.0),
        (r"\boxed{47}", "46", 0.0),
        ("Natalia sold 72 clips", "She sold 48 in April... #### 72", 1.0),  # GSM8K-style reference
        ("x^2+1", "x^2 + 1", 1.0),  # non-numeric reference: string equality without math_verify
        ("x^2+2", "x^2+1", 0.0),
        (r"thus \boxed{x^2 + 1}.", "x^2+1", 1.0),
    ],
)
def test_accuracy_hand_cases(completion, answer, expected, monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # numeric / string path only
    assert accuracy_reward(completions=[completion], answer=[answer]) == [expected]


def test_accuracy_accepts_numbers_none_and_conversations():
    completions = ["46", [{"role": "assistant", "content": "it is 46"}], "5"]
    assert accuracy_reward(completions=completions, answer=[46, "46", None], prompts=["a", "b", "c"]) == [
        1.0,
        1.0,
        None,
    ]
    with pytest.raises(ValueError, match="3 completions but 2 answers"):
        accuracy_reward(completions=completions, answer=["1", "2"])


def test_accuracy_asks_math_verify_only_when_the_exact_match_fails(monkeypatch):
    calls = []
    fake = types.SimpleNamespace(
        LatexExtractionConfig=lambda **options: options,
        parse=lambda text, **options: text,
        verify=lambda gold, pred: calls.append((gold, pred)) or pred.endswith("(x+1)^2$"),
    )
    monkeypatch.setitem(sys.modules, "math_verify", fake)
    assert accuracy_reward(completions=["so $(x+1)^2$"], answer=["x^2+2x+1"]) == [1.0]
    assert calls == [("$x^2+2x+1$", "so $(x+1)^2$")]
    assert accuracy_reward(completions=["46"], answer=["46"]) == [1.0]
    assert len(calls) == 1  # an exact match needs no second opinion


def test_extract_and_parse_helpers():
    assert extract_answer(r"a \boxed{x+1} b 7") == "x+1"
    assert extract_answer("nothing") is None
    assert extract_answer("1,234.5 and 6/8") == "6/8"
    assert parse_number("6/8") * 4 == 3 and parse_number("-2.5") * 2 == -5
    assert parse_number("1,00") is None and parse_number("3/0") is None and parse_number("--5") is None


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("<think>2+2 is 4</think><answer>4</answer>", 1.0),
        ("  <think>\nmulti\nline\n</think>\n\n<answer> 4 </answer>\n", 1.0),  # whitespace tolerant
        ("<think></think><answer>4</answer>", 1.0),
        ("<answer>4</answer>", 0.0),
        ("<think>x</think>", 0.0),
        ("<think>x</think><answer>4</answer> trailing text", 0.0),  # whole completion must match
        ("intro <think>x</think><answer>4</answer>", 0.0),
        ("<think>x</think><answer>4</answer><answer>5</answer>", 0.0),  # a repeated block
        ("<think>a<think>b</think><answer>4</answer>", 0.0),  # a nested tag
        ("<answer>4</answer><think>x</think>", 0.0),  # wrong order
    ],
)
def test_format_hand_cases(completion, expected):
    assert format_reward(completions=[completion]) == [expected]
    assert format_reward(completions=[[{"role": "assistant", "content": completion}]]) == [expected]


def test_overlong_soft_punishment():
    reward = make_overlong_reward(max_length=10, buffer=4)
    assert reward.__name__ == "overlong_reward"
    # penalty starts after 10 - 4 = 6 tokens: L=7 -> (6-7)/4 = -0.25, L=8 -> -0.5, L=10 -> -1, L=11 -> -1
    ids = [[1] * n for n in (0, 6, 7, 8, 10, 11)]
    assert reward(completions=[""] * 6, completion_ids=ids) == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0]
    assert make_overlong_reward(20).buffer == 4  # DAPO's 4096 / 20480 ratio
    with pytest.raises(ValueError, match="needs completion_ids"):
        reward(completions=["x"])
    with pytest.raises(ValueError, match=r"buffer=11 must be an integer in 1..max_length \(10\)"):
        make_overlong_reward(10, buffer=11)
    with pytest.raises(ValueError, match="max_length=0"):
        make_overlong_reward(0)


def test_length_reward():
    reward = make_length_reward(8)
    assert reward(completions=["", "", ""], completion_ids=[[], [1, 2], [1] * 12]) == [0.0, -0.25, -1.0]


def test_completion_text():
    assert completion_text("abc") == "abc"
    assert (
        completion_text([{"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}])
        == "ab"
    )
    assert completion_text({"role": "assistant", "content": [{"type": "text", "text": "hi"}]}) == "hi"
    with pytest.raises(TypeError, match="got int"):
        completion_text(5)
