"""Built-in tasks: seeded, disjoint splits; answers checked against an independent evaluation."""

from __future__ import annotations

import re

import pytest

from cohort.data import TASKS, get_task, make_task, sft_completion
from cohort.data.tasks import parse_expression, reduction_steps

EXPR = re.compile(r"\d+(?:[-+*]\d+)*")


def independent_value(expression: str) -> int:
    """Python's own evaluation of a +-* expression (guarded by a strict regex, so eval is safe)."""
    assert EXPR.fullmatch(expression), expression
    return eval(expression)  # noqa: S307 - digits and +-* only


@pytest.mark.parametrize("name", sorted(TASKS))
def test_seeded_reproducible_and_disjoint(name):
    train, held = make_task(name, n_train=300, n_eval=100, seed=3)
    assert (len(train), len(held)) == (300, 100)
    again = make_task(name, n_train=300, n_eval=100, seed=3)
    assert again == (train, held)
    other = make_task(name, n_train=300, n_eval=100, seed=4)
    assert other[0] != train
    # repr: the multiply task's prompts are conversations (lists), which a set cannot hold
    train_prompts = {repr(r["prompt"]) for r in train}
    held_prompts = {repr(r["prompt"]) for r in held}
    assert len(train_prompts) == 300 and len(held_prompts) == 100  # no duplicates inside a split
    assert not train_prompts & held_prompts


@pytest.mark.parametrize("name", sorted(TASKS))
def test_held_out_set_does_not_depend_on_n_train(name):
    _, held_small = make_task(name, n_train=10, n_eval=50, seed=0)
    _, held_big = make_task(name, n_train=500, n_eval=50, seed=0)
    assert held_small == held_big


def test_addition_rows_are_correct_and_short():
    train, held = make_task("addition", n_train=500, n_eval=100, seed=0)
    for row in train + held:
        assert re.fullmatch(r"\d{1,2}\+\d{1,2}=", row["prompt"]), row
        assert row["answer"] == str(independent_value(row["prompt"][:-1]))
        assert set(row) == {"prompt", "answer"}
    one_digit, _ = make_task("addition", n_train=100, n_eval=0, seed=0, digits_a=1, digits_b=1)
    assert all(re.fullmatch(r"\d\+\d=", r["prompt"]) for r in one_digit)


def test_addition_can_use_the_whole_space():
    train, held = make_task("addition", n_train=90, n_eval=10, seed=0, digits_a=1, digits_b=1)
    assert len({r["prompt"] for r in train + held}) == 100  # every a+b with a, b in 0..9
    with pytest.raises(ValueError, match="only 100 distinct problems"):
        make_task("addition", n_train=91, n_eval=10, seed=0, digits_a=1, digits_b=1)


def test_multistep_rows_follow_precedence():
    train, held = make_task("multistep", n_train=1000, n_eval=100, seed=1)
    counts = set()
    for row in train + held:
        expression = row["prompt"][:-1]
        assert row["prompt"].endswith("=")
        assert row["answer"] == str(independent_value(expression)), row
        counts.add(len(re.findall(r"\d+", expression)))
    assert counts == {3, 4}
    assert any("*" in r["prompt"] and int(r["answer"]) < 0 for r in train)  # precedence and signs exercised


def test_reduction_steps_hand_example():
    # 3+4*2-5: multiply first (4*2=8), then left to right: 3+8=11, 11-5=6
    assert reduction_steps([3, 4, 2, 5], ["+", "*", "-"]) == ["3+4*2-5", "3+8-5", "11-5", "6"]
    # 2-5*3+1: 5*3=15, 2-15=-13, -13+1=-12
    assert reduction_steps([2, 5, 3, 1], ["-", "*", "+"]) == ["2-5*3+1", "2-15+1", "-13+1", "-12"]
    assert parse_expression("-13+1") == ([-13, 1], ["+"])


def test_sft_completions():
    train, _ = make_task("multistep", n_train=300, n_eval=0, seed=2)
    for row in train:
        chain = sft_completion("multistep", row)
        assert chain.rsplit("=", 1)[-1] == row["answer"]
        for part in chain.split("="):  # every worked step still has the prompt's value
            assert str(eval(part)) == row["answer"], (row, chain)  # noqa: S307
    assert sft_completion(get_task("multistep", worked=False), {"prompt": "3+4*2-5=", "answer": "6"}) == "6"
    assert sft_completion("multistep", {"prompt": "3+4*2-5=", "answer": "6"}) == "3+8-5=11-5=6"
    assert sft_completion("addition", {"prompt": "12+34=", "answer": "46"}) == "46"
    assert sft_completion("addition", {"prompt": "1+1=", "answer": "2", "completion": "two"}) == "two"


def test_task_errors():
    with pytest.raises(
        ValueError, match=r"unknown task 'subtraction'.*\['addition', 'code', 'multiply', 'multistep'\]"
    ):
        make_task("subtraction", n_train=1, n_eval=1)
    with pytest.raises(ValueError, match="n_eval=-1"):
        make_task("addition", n_train=1, n_eval=-1)
    with pytest.raises(ValueError, match="digits_a=0"):
        make_task("addition", n_train=1, n_eval=1, digits_a=0)
    with pytest.raises(ValueError, match=re.escape("operators='+/'")):
        make_task("multistep", n_train=1, n_eval=1, operators="+/")
    with pytest.raises(ValueError, match="unsupported parameters"):
        make_task("addition", n_train=1, n_eval=1, operands=3)
