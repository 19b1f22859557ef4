"""The accuracy reward's answer matching: TRL's `solution` column, math_verify for every answer when installed,
and LaTeX thousands separators without it."""

from __future__ import annotations

import sys
import threading
import types

import pytest

from cohort.rewards import accuracy_reward, answers_match


@pytest.fixture
def without_math_verify(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # makes `import math_verify` raise ImportError


@pytest.fixture
def real_math_verify():
    return pytest.importorskip("math_verify")


@pytest.mark.parametrize(
    "completion, answer",
    [
        (r"\boxed{1{,}000}", "1000"),
        (r"so the total is $1{,}000$ dollars", "1000"),
        (r"\boxed{1,000}", "1000"),
        (r"\boxed{1\,000}", "1000"),
        ("1000", r"1{,}000"),
        (r"\boxed{12{,}345.5}", "12345.5"),
    ],
)
def test_thousands_separators_match_without_math_verify(completion, answer, without_math_verify):
    assert answers_match(completion, answer)
    assert accuracy_reward(completions=[completion], answer=[answer]) == [1.0]


@pytest.mark.parametrize(
    "completion, answer, expected",
    [
        (r"\boxed{1{,}000}", "1000", 1.0),
        (r"\boxed{1.5\times10^{3}}", "1500", 1.0),  # only math_verify reads scientific notation
        ("$0.3333333$", "1/3", 1.0),  # its numeric tolerance (6 decimals), where the exact path says no
        ("0.3333333", "1/3", 0.0),  # plain text is read by the exact path alone
        ("46+3", "46", 0.0),  # math_verify's plain-text reading would take the first number
        ("59-9=", "59", 0.0),
        (r"\boxed{\dfrac{1}{2}}", "0.5", 1.0),
        (r"$\frac{\sqrt{2}}{2}$", r"\frac{1}{\sqrt{2}}", 1.0),  # symbolic equivalence
        (r"\boxed{4} ... \boxed{46}", "46", 1.0),  # the last box is the answer
        (r"\boxed{4} ... \boxed{\frac{92}{2}}", "46", 1.0),
        (r"We get $12+34=46$.", "46", 1.0),
        ("46 then 47", "46", 0.0),
        ("12+34", "46", 0.0),  # echoing the problem is no answer, though it evaluates to one
        (r"\boxed{7*8}", "56", 0.0),
        ("no digits here", "46", 0.0),
        ("Natalia sold 72 clips", "She sold 48 in April... #### 72", 1.0),
    ],
)
def test_math_verify_judges_numeric_answers_too(completion, answer, expected, real_math_verify):
    assert accuracy_reward(completions=[completion], answer=[answer]) == [expected]


def test_math_verify_sees_what_the_exact_path_rejects(monkeypatch):
    calls = []
    fake = types.SimpleNamespace(
        LatexExtractionConfig=lambda **options: options,
        parse=lambda text, extraction_config=None: (
            [text] if extraction_config is None else [text, extraction_config]
        ),
        verify=lambda gold, pred: calls.append((gold, pred)) or True,
    )
    monkeypatch.setitem(sys.modules, "math_verify", fake)
    assert accuracy_reward(completions=["46"], answer=["46"]) == [1.0]
    assert calls == []  # an exact match needs no second opinion
    assert accuracy_reward(completions=[r"\boxed{x^{2}+1}"], answer=["1 + x^2"]) == [1.0]
    assert calls == [(["$1 + x^2$"], [r"\boxed{x^{2}+1}", [{"boxed_match_priority": 0}]])]
    # a numeric reference reaches math_verify too, but its verdict needs a number, and text is none
    assert accuracy_reward(completions=[r"\boxed{forty-six}"], answer=["46"]) == [0.0]
    assert len(calls) == 1
    # a completion without LaTeX ($ or a backslash) has nothing for math_verify to read: never asked
    assert accuracy_reward(completions=["x^2 + 2x + 1 = 0", "46+3"], answer=["(x+1)^2", "46"]) == [0.0, 0.0]
    assert len(calls) == 1


def test_math_verify_off_the_main_thread(real_math_verify):
    """math_verify's timeout uses SIGALRM, which only the main thread may set: other threads run without it."""
    results = []
    worker = threading.Thread(
        target=lambda: results.append(
            accuracy_reward(completions=[r"\boxed{\sqrt{8}}"], answer=[r"2\sqrt{2}"])
        )
    )
    worker.start()
    worker.join()
    assert results == [[1.0]]


def test_solution_column_when_there_is_no_answer_column(without_math_verify):
    completions = ["it is 46", r"\boxed{7}", "5"]
    assert accuracy_reward(completions=completions, solution=["46", "8", None]) == [1.0, 0.0, None]
    # `answer` wins when a dataset has both
    assert accuracy_reward(completions=["46"], answer=["46"], solution=["0"]) == [1.0]
    with pytest.raises(ValueError, match=r"`answer` \(or TRL's `solution`\).*received \['prompts'\]"):
        accuracy_reward(completions=completions, prompts=["a", "b", "c"])
    with pytest.raises(ValueError, match="3 completions but 2 answers; the `solution` column"):
        accuracy_reward(completions=completions, solution=["1", "2"])
