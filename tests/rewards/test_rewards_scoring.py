"""score(): the [N, R] tensor, NaN for None, loud errors for every bad reward output; async functions, TRL's
extra arguments (trainer_state, log_metric, log_extra), and the column check run before the model loads."""

from __future__ import annotations

import asyncio
import functools
import math
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from cohort.rewards import (
    RewardFunctionError,
    RewardLogs,
    accuracy_reward,
    check_reward_columns,
    format_reward,
    resolve_reward_funcs,
    reward_name,
    reward_signature,
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


def test_every_argument_reaches_a_function_with_kwargs():
    seen = {}

    def spy(**kwargs):
        seen.update(kwargs)
        return [0] * len(kwargs["completions"])

    state = SimpleNamespace(global_step=3, max_steps=10, epoch=0.5)
    call(spy, columns={"answer": ["a"] * 4, "level": [1, 1, 2, 2]}, trainer_state=state)
    assert {k: v for k, v in seen.items() if k not in ("log_metric", "log_extra")} == {
        "prompts": PROMPTS,
        "completions": COMPLETIONS,
        "completion_ids": IDS,
        "answer": ["a"] * 4,
        "level": [1, 1, 2, 2],
        "trainer_state": state,
    }
    assert callable(seen["log_metric"]) and callable(seen["log_extra"])


def test_a_function_without_kwargs_gets_only_what_it_names():
    seen = []

    def plain(completions, answer):
        seen.append("called")
        return [float(c == a) for c, a in zip(completions, answer)]

    def with_state(completions, trainer_state, level=None):
        seen.append((trainer_state.global_step, level))
        return [trainer_state.global_step / trainer_state.max_steps] * len(completions)

    state = SimpleNamespace(global_step=2, max_steps=8, epoch=0.25)
    out = call(plain, with_state, trainer_state=state)
    assert out[:, 0].tolist() == [1.0, 0.0, 0.0, 1.0] and out[:, 1].tolist() == [0.25] * 4
    assert seen == ["called", (2, None)]


@pytest.mark.parametrize(
    "returned",
    [
        [1.0, 0.0, 0.5, -2.0],
        [1, 0, 3, -2],
        [True, False, True, np.bool_(False)],
        [np.float32(0.5), np.float64(1.5), np.int64(-2), np.float16(0.25)],
        (1.0, None, 0, None),
        [torch.tensor(1.0), np.array(2.0), torch.tensor(3, dtype=torch.int32), None],
        np.array([1.0, 2.0, 3.0, 4.0], dtype=np.float32),
        np.array([True, False, False, True]),
        np.array([1.0, None, 2.0, None], dtype=object),
        torch.tensor([0.0, 1.0, 0.0, 1.0], dtype=torch.bfloat16),
        torch.tensor([True, False, True, True]),
        torch.tensor([1.0, 2.0, 3.0, 4.0], requires_grad=True),
    ],
    ids=lambda v: type(v).__name__ + ("" if not isinstance(v, (list, tuple)) else "-" + type(v[0]).__name__),
)
def test_accepted_return_values(returned):
    expected = [
        math.nan if v is None else float(v)
        for v in list(returned.detach() if torch.is_tensor(returned) else returned)
    ]
    got = call(lambda **kw: returned)[:, 0].tolist()
    assert [math.isnan(x) for x in got] == [math.isnan(x) for x in expected]
    assert [x for x in got if not math.isnan(x)] == [x for x in expected if not math.isnan(x)]


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
        (lambda **kw: [1.0, 0.0, 1j, 1.0], r"returned a complex \(1j\) at index 2"),
        (lambda **kw: [1.0, 0.0, 1.0, np.array([1.0])], r"returned a ndarray.* at index 3"),
        (lambda **kw: [1.0, math.nan, 1.0, 1.0], "returned nan at index 1.*use None"),
        (lambda **kw: [1.0, 0.0, -math.inf, 1.0], "returned -inf at index 2"),
        (lambda **kw: [torch.tensor([1.0])] * 4, r"returned a Tensor .* at index 0"),
        (lambda **kw: np.array([1.0, np.nan, 1.0, 1.0]), "returned nan at index 1.*use None"),
        (lambda **kw: torch.ones(3), "returned 3 values for 4 completions"),
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


# ---------------------------------------------------------------------------------------------- async
async def slow_one(completions, **kwargs):
    await asyncio.sleep(0.3)
    return [1.0] * len(completions)


async def slow_two(completions, answer, **kwargs):
    await asyncio.sleep(0.3)
    return [float(c == a) for c, a in zip(completions, answer)]


def test_async_functions_of_a_step_run_concurrently():
    start = time.perf_counter()
    out = call(slow_one, accuracy_reward, slow_two)
    elapsed = time.perf_counter() - start
    assert elapsed < 0.5, f"two 0.3 s async rewards took {elapsed:.2f} s: they were not awaited together"
    assert out[:, 0].tolist() == [1.0] * 4
    assert out[:, 1].tolist() == [1.0, 0.0, 1.0, 1.0]
    assert out[:, 2].tolist() == [1.0, 0.0, 0.0, 1.0]


def test_async_callables_in_every_form():
    class Judge:
        async def __call__(self, completions, **kwargs):
            await asyncio.sleep(0)
            return [0.5] * len(completions)

    async def scaled(completions, scale, **kwargs):
        return [scale] * len(completions)

    out = call(Judge(), functools.partial(scaled, scale=2.0))
    assert out.tolist() == [[0.5, 2.0]] * 4


def test_async_functions_work_inside_a_running_event_loop():
    async def main():  # a notebook or an async application calling the (blocking) scorer
        return call(slow_one, slow_two)

    start = time.perf_counter()
    out = asyncio.run(main())
    assert time.perf_counter() - start < 0.5
    assert out[:, 0].tolist() == [1.0] * 4


def test_async_errors_name_the_function_and_pending_coroutines_are_closed(recwarn):
    async def flaky(completions, **kwargs):
        raise ConnectionError("judge unreachable")

    with pytest.raises(RewardFunctionError, match="'flaky' raised ConnectionError: judge unreachable"):
        call(slow_one, flaky)
    with pytest.raises(RewardFunctionError, match="'broken' raised KeyError"):
        call(slow_one, broken)  # slow_one's coroutine is never started

    async def short(completions, **kwargs):
        return [1.0]

    with pytest.raises(RewardFunctionError, match="'short' returned 1 values for 4 completions"):
        call(short)
    assert not [w for w in recwarn if "never awaited" in str(w.message)]


# ---------------------------------------------------------------------------------------------- log_metric, log_extra
def test_log_metric_and_log_extra_are_collected():
    def judged(completions, log_metric, log_extra, **kwargs):
        log_metric("length", float(np.mean([len(c) for c in completions])))
        log_metric("length", np.float32(0.0))
        log_metric("calls", True)
        log_extra("verdict", ["ok" if c else "empty" for c in completions])
        log_extra("score", [np.float32(0.5), torch.tensor(1.0), None, {"a": np.int64(2)}])
        return [1.0] * len(completions)

    def quiet(completions):  # takes no extras: not given them, not broken by them
        return [0.0] * len(completions)

    logs = RewardLogs()
    call(judged, quiet, logs=logs)
    mean_length = sum(len(c) for c in COMPLETIONS) / 4
    assert logs.metric_means() == {"rewards/judged/length": mean_length / 2, "rewards/judged/calls": 1.0}
    assert logs.extras_at(0) == {"verdict": "ok", "score": 0.5}
    assert logs.extras_at(3) == {"verdict": "ok", "score": {"a": 2}}
    call(judged)  # without a collector the calls still work, their values are dropped


@pytest.mark.parametrize(
    "body, pattern",
    [
        ("log_metric('mean', 1.0)", r"'rewards/bad/mean' is logged by cohort itself"),
        ("log_metric('', 1.0)", "the name must be a non-empty string"),
        ("log_metric('x', 'high')", r"log_metric\('x', 'high'\): the value must be a real number"),
        ("log_extra('x', [1, 2])", r"log_extra\('x', ...\): 2 values for 4 completions"),
        ("log_extra('x', 'abcd')", "give a list with one value per completion"),
        (
            "log_extra('reward', [0] * 4)",
            r"'reward', 'step', 'truncated'\] and rewards/\* are the sample's own",
        ),
        ("log_extra('x', [0] * 4) or log_extra('x', [0] * 4)", "the column was already logged in this step"),
    ],
)
def test_bad_log_calls_raise_naming_the_function(body, pattern):
    namespace: dict = {}
    exec(
        f"def bad(completions, log_metric, log_extra):\n    {body}\n    return [0.0] * len(completions)",
        namespace,
    )
    with pytest.raises(RewardFunctionError, match=r"reward function 'bad' raised ValueError: .*" + pattern):
        call(namespace["bad"], logs=RewardLogs())


# ---------------------------------------------------------------------------------------------- columns
def test_check_reward_columns():
    def needs_level(
        completions, level, answer, trainer_state, log_metric, log_extra, prompts, completion_ids
    ):
        return [0.0] * len(completions)

    def optional(completions, level=1, **kwargs):
        return [0.0] * len(completions)

    check_reward_columns([format_reward, needs_level], ["answer", "level"])
    check_reward_columns(optional, [])  # defaults and **kwargs need nothing
    with pytest.raises(
        ValueError,
        match=r"reward function 'needs_level' requires the argument 'level', which is not a column of the training "
        r"data; columns besides the prompt \(which arrives as `prompts`\): \['answer', 'id'\]",
    ):
        check_reward_columns([needs_level], ["id", "answer"])
    with pytest.raises(
        ValueError,
        match=r"requires the argument 'level' \(and \['answer'\]\).*the data has no column besides the prompt",
    ):
        check_reward_columns(needs_level, [])
    with pytest.raises(ValueError, match=r"column\(s\) \['trainer_state'\], which clash"):
        check_reward_columns([optional], ["trainer_state"])


def test_signatures_are_read_once_at_resolve_time(monkeypatch):
    def mine(completions, **kwargs):
        return [0.0] * len(completions)

    (func,) = resolve_reward_funcs(mine)
    assert reward_signature(func).var_keyword
    monkeypatch.setattr("inspect.signature", lambda *a, **k: pytest.fail("signature read again"))
    call(func)
    check_reward_columns(func, [])


def test_missing_column_is_reported_before_the_model_loads(tiny_model_dir, tmp_path, monkeypatch):
    from test_trainer import _cfg

    from cohort.trainer import GRPOTrainer

    def needs_difficulty(completions, difficulty, **kwargs):
        return [0.0] * len(completions)

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the reward functions were checked")

    monkeypatch.setattr("cohort.train.build.load_model", no_loading)
    monkeypatch.setattr("cohort.train.build.load_tokenizer", no_loading)
    with pytest.raises(
        ValueError,
        match=r"'needs_difficulty' requires the argument 'difficulty', which is not a column of the training "
        r"data; columns besides the prompt \(which arrives as `prompts`\): \['answer'\]",
    ):
        GRPOTrainer(_cfg(tiny_model_dir, tmp_path / "run"), reward_funcs=needs_difficulty)


def test_trainer_passes_its_state_and_keeps_what_rewards_log(tiny_model_dir, tmp_path):
    from test_trainer import _cfg

    from cohort.trainer import GRPOTrainer

    seen = []

    def shaped(completions, trainer_state, log_metric, log_extra, **kwargs):
        seen.append((trainer_state.global_step, trainer_state.max_steps, trainer_state.epoch))
        log_metric("progress", trainer_state.global_step / trainer_state.max_steps)
        log_extra("n_chars", [len(c) for c in completions])
        return [float(len(c)) for c in completions]

    t = GRPOTrainer(
        _cfg(tiny_model_dir, tmp_path / "run", steps=2, num_samples_logged=2), reward_funcs=shaped
    )
    result = t.train()
    assert result["steps"] == 2
    n = t.cfg.prompts_per_step
    assert [(g, m) for g, m, _ in seen] == [(0, 2), (1, 2)]
    assert [e for _, _, e in seen] == [n / 64, 2 * n / 64]  # 64 training prompts
    import json

    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["rewards/shaped/progress"] for m in metrics] == [0.0, 0.5]
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert samples and all(s["n_chars"] == len(s["completion"]) for s in samples)
