"""score(): the [N, R] tensor, NaN for None, and loud errors for every bad reward output."""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch

from cohort.rewards import (
    RewardFunctionError,
    accuracy_reward,
    format_reward,
    reward_name,
    reward_weights,
    score,
)

PROMPTS = ["1+1=", "1+1=", "2+3=", "2+3="]
COMPLETIONS = ["2", "3", "<think>x</think><answer>5</answer>", "5"]
IDS = [[5], [6], [1, 2, 3], [9]]
COLUMNS = {"answer": ["2", "2", "5", "5"]}


def call(*funcs, **overrides):
    kwargs = {"prompts": PROMPTS, "completions": COMPLETIONS, "completion_ids": IDS, "columns": COLUMNS}
    kwargs.update(overrides)
    return score(list(funcs), **kwargs)


def test_score_shape_values_and_none():
    def only_second_prompt(prompts, completions, **kwargs):
        return [None if p == "1+1=" else 0.5 for p in prompts]

    out = call(accuracy_reward, format_reward, only_second_prompt)
    assert out.dtype == torch.float32 and out.shape == (4, 3)
    assert out[:, 0].tolist() == [1.0, 0.0, 1.0, 1.0]
    assert out[:, 1].tolist() == [0.0, 0.0, 1.0, 0.0]
    assert torch.isnan(out[:2, 2]).all() and out[2:, 2].tolist() == [0.5, 0.5]


def test_every_argument_reaches_the_function():
    seen = {}

    def spy(**kwargs):
        seen.update(kwargs)
        return [0] * len(kwargs["completions"])

    call(spy, columns={"answer": ["a"] * 4, "level": [1, 1, 2, 2]})
    assert seen == {
        "prompts": PROMPTS,
        "completions": COMPLETIONS,
        "completion_ids": IDS,
        "answer": ["a"] * 4,
        "level": [1, 1, 2, 2],
    }


def test_accepts_ints_numpy_scalars_tuples_and_arrays():
    out = call(
        lambda **kw: (1, np.float32(0.5), np.int64(-2), 0.25),
        lambda **kw: np.array([1.0, 2.0, 3.0, 4.0]),
        lambda **kw: torch.tensor([0.0, 1.0, 0.0, 1.0]),
    )
    assert out.tolist() == [[1.0, 1.0, 0.0], [0.5, 2.0, 1.0], [-2.0, 3.0, 0.0], [0.25, 4.0, 1.0]]


def test_a_function_cannot_corrupt_the_inputs_of_the_next():
    def mutate(completions, **kwargs):
        completions[:] = ["999"] * len(completions)
        return [0.0] * len(completions)

    assert call(mutate, accuracy_reward)[:, 1].tolist() == [1.0, 0.0, 1.0, 1.0]


def broken(**kwargs):
    raise KeyError("ground_truth")


@pytest.mark.parametrize(
    "func, pattern",
    [
        (broken, r"'broken' raised KeyError: 'ground_truth'"),
        (lambda **kw: [1.0, 0.0], r"returned 2 values for 4 completions: \[1.0, 0.0\]"),
        (lambda **kw: [1.0] * 5, "returned 5 values for 4 completions"),
        (lambda **kw: 1.0, "returned float 1.0; it must return a list"),
        (lambda **kw: {"a": 1}, "returned dict"),
        (lambda **kw: [1.0, "0.5", 0.0, 1.0], r"returned a str \('0.5'\) at index 1"),
        (lambda **kw: [1.0, 0.0, True, 1.0], r"returned a bool \(True\) at index 2"),
        (lambda **kw: [1.0, 0.0, 1.0, np.bool_(False)], r"returned a bool.* at index 3"),
        (lambda **kw: [1.0, math.nan, 1.0, 1.0], "returned nan at index 1.*use None"),
        (lambda **kw: [1.0, 0.0, -math.inf, 1.0], "returned -inf at index 2"),
        (lambda **kw: [torch.tensor(1.0)] * 4, r"returned a Tensor .* at index 0"),
        (lambda **kw: np.ones((4, 1)), r"array of shape \(4, 1\)"),
    ],
)
def test_bad_outputs_raise_naming_the_function(func, pattern):
    with pytest.raises(RewardFunctionError, match=pattern) as info:
        call(accuracy_reward, func)
    assert info.value.func_name == reward_name(func)
    assert str(info.value).startswith(f"reward function {reward_name(func)!r}")


def test_raised_error_keeps_its_cause():
    with pytest.raises(RewardFunctionError) as info:
        call(broken)
    assert isinstance(info.value.__cause__, KeyError)


def test_long_outputs_are_truncated_in_the_message():
    with pytest.raises(RewardFunctionError) as info:
        call(lambda **kw: list(range(10_000)))
    assert "10000 values for 4 completions" in str(info.value) and len(str(info.value)) < 300


def test_input_errors():
    with pytest.raises(ValueError, match="3 prompts for 4 completions"):
        call(accuracy_reward, prompts=PROMPTS[:3])
    with pytest.raises(ValueError, match="3 completion_ids rows"):
        call(accuracy_reward, completion_ids=IDS[:3])
    with pytest.raises(ValueError, match="column 'answer' has 2 values for 4 completions"):
        call(accuracy_reward, columns={"answer": ["2", "5"]})
    with pytest.raises(ValueError, match=r"\['completions'\] clash"):
        call(accuracy_reward, columns={"answer": ["2"] * 4, "completions": [0] * 4})
    with pytest.raises(ValueError, match="at least one reward function"):
        call()


def test_reward_weights_are_one_finite_number_per_function():
    both = [accuracy_reward, format_reward]
    assert reward_weights(None, both).tolist() == [1.0, 1.0]
    got = reward_weights([2, 0.5], both)
    assert got.dtype == torch.float32 and got.tolist() == [2.0, 0.5]
    assert reward_weights(np.array([1.0]), ["accuracy"]).tolist() == [1.0]  # specs stand for their functions
    with pytest.raises(
        ValueError, match=r"1 values but there are 2 reward functions \['accuracy_reward', 'format_reward'\]"
    ):
        reward_weights([1.0], both)
    for bad in (math.nan, math.inf, -math.inf):
        with pytest.raises(
            ValueError, match=rf"reward_weights\[1\]={bad} \(for 'format_reward'\) is not finite"
        ):
            reward_weights([1.0, bad], both)
    with pytest.raises(ValueError, match=r"reward_weights\[0\]='2' \(for 'accuracy'\) is not a number"):
        reward_weights(["2"], ["accuracy"])
    with pytest.raises(ValueError, match="must be a list of numbers"):
        reward_weights(2.0, ["accuracy"])


def test_reward_name():
    assert reward_name(accuracy_reward) == "accuracy_reward"
    assert reward_name(functools.partial(functools.partial(format_reward))) == "format_reward"
