"""The accuracy reward on multi-turn completions in TRL's format: the answer is the last assistant message, never
a tool's result; single-turn completions score as before."""

from __future__ import annotations

import sys

import pytest

from cohort.data import make_task
from cohort.rewards import accuracy_reward, completion_text, final_text, resolve_reward_funcs

CALL = {
    "role": "assistant",
    "content": "",
    "tool_calls": [{"type": "function", "function": {"name": "multiply", "arguments": {"a": 4821, "b": 37}}}],
}
RESULT = {"role": "tool", "name": "multiply", "content": "178377"}


def assistant(text):
    return {"role": "assistant", "content": text}


@pytest.fixture(autouse=True)
def _exact_path_only(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # the exact comparison alone decides here


@pytest.mark.parametrize(
    "completion, expected",
    [
        ([CALL, RESULT, assistant("178377")], 1.0),
        ([CALL, RESULT, assistant("The product is 178377.")], 1.0),
        ([CALL, RESULT, assistant("178376")], 0.0),  # the tool's right number does not rescue a wrong answer
        ([CALL, RESULT, assistant("")], 0.0),  # an empty final message
        ([CALL, RESULT, {"role": "assistant", "content": None}], 0.0),
        ([CALL, RESULT], 0.0),  # the episode ended on the tool's result: the model never answered
        ([RESULT], 0.0),  # tool messages only
        ([RESULT, RESULT], 0.0),
        ([], 0.0),
        ([assistant("178377"), RESULT], 1.0),  # the last assistant message, even with a result after it
        ([CALL, RESULT, CALL, RESULT, assistant("178377")], 1.0),  # several tool rounds
        ([assistant("178377"), assistant("I am not sure")], 0.0),  # the last turn answers
    ],
)
def test_the_answer_is_the_last_assistant_message(completion, expected):
    assert accuracy_reward(completions=[completion], answer=["178377"]) == [expected]


def test_single_turn_completions_score_as_before():
    completions = ["178377", [assistant("it is 178377")], [{"content": "178"}, {"content": "377"}]]
    assert accuracy_reward(completions=completions, answer=["178377"] * 3) == [1.0, 1.0, 1.0]
    # messages without roles are still one text, as completion_text joins them
    assert final_text([{"content": "178"}, {"content": "377"}]) == completion_text(
        [{"content": "178"}, {"content": "377"}]
    )
    assert final_text("x") == "x" and final_text([assistant("y")]) == "y"


def test_final_text_of_conversations():
    assert final_text([CALL, RESULT, assistant("6")]) == "6"
    assert final_text([CALL, RESULT]) == ""
    assert final_text([RESULT]) == ""
    assert final_text([assistant([{"type": "text", "text": "6"}])]) == "6"  # content parts
    assert completion_text({"role": "assistant", "content": None}) == ""


def test_the_multiply_task_is_scored_by_the_builtin_accuracy_reward():
    rows, _ = make_task("multiply", n_train=4, n_eval=0, seed=0)
    (reward,) = resolve_reward_funcs(["accuracy"])
    right = [[CALL, {**RESULT, "content": r["answer"]}, assistant(r["answer"])] for r in rows]
    tool_only = [[CALL, {**RESULT, "content": r["answer"]}, assistant("")] for r in rows]
    answers = [r["answer"] for r in rows]
    assert reward(completions=right, answer=answers, factors=[r["factors"] for r in rows]) == [1.0] * 4
    assert reward(completions=tool_only, answer=answers) == [0.0] * 4
