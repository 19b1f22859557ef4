"""The `code` reward: code extraction, the tests column, scoring, outcomes per kind, and how it is named."""

from __future__ import annotations

import json
import shutil

import pytest

from cohort.config import load_config
from cohort.data import DataError
from cohort.rewards import (
    BUILTIN_REWARDS,
    check_code_rows,
    code_reward,
    extract_code,
    make_code_reward,
    resolve_reward_funcs,
    reward_name,
    score,
)
from cohort.rewards.code import OUTCOMES, CodeTests, parse_tests, same_output

needs_bwrap = pytest.mark.skipif(
    shutil.which("bwrap") is None, reason="bubblewrap is not installed (CI installs it)"
)

ADD = ["assert add(2, 3) == 5", "assert add(-1, 1) == 0", "assert add(0, 0) == 0"]
DOUBLE = [{"input": "3\n", "output": "6\n"}, {"input": "-4\n", "output": "-8"}]


def _call(reward, completions, tests):
    """Returns (scores, outcomes, metric means) of one call, with TRL's log_metric / log_extra."""
    metrics: dict[str, list[float]] = {}
    extras: dict[str, list] = {}
    scores = reward(
        completions=completions,
        tests=tests,
        log_metric=lambda name, value: metrics.setdefault(name, []).append(value),
        log_extra=lambda column, values: extras.__setitem__(column, values),
    )
    means = {k: sum(v) / len(v) for k, v in metrics.items()}
    return scores, extras["code_outcome"], means


def test_extract_code_prefers_python_fences_then_any_fence_then_everything():
    assert extract_code("x = 1") == "x = 1"
    assert extract_code("Here:\n```\nprint(1)\n```\ndone") == "print(1)\n"
    text = "```js\nconsole.log(1)\n```\n```python\na = 1\n```\n```py\nb = 2\n```\n```\nc\n```"
    assert extract_code(text) == "b = 2\n"  # the last block tagged python
    assert (
        extract_code("think first\n```python\ndef f(x):\n    return x") == "def f(x):\n    return x"
    )  # cut off
    assert extract_code("  ```Python3 \nx = 3\n  ```") == "x = 3\n"


def test_parse_tests_reads_every_accepted_form():
    assert parse_tests(ADD) == CodeTests(asserts=tuple(ADD))
    assert parse_tests(json.dumps(ADD)) == CodeTests(asserts=tuple(ADD))
    assert parse_tests("assert f(1) == 1\nassert f(2) == 2") == CodeTests(
        asserts=("assert f(1) == 1\nassert f(2) == 2",)
    )
    assert parse_tests(DOUBLE) == CodeTests(cases=(("3\n", "6\n"), ("-4\n", "-8")))
    assert parse_tests({"inputs": ["1", "2"], "outputs": [2, 4]}) == CodeTests(cases=(("1", "2"), ("2", "4")))
    assert len(parse_tests(json.dumps(DOUBLE))) == 2


@pytest.mark.parametrize(
    "bad, message",
    [
        (None, "is empty \\(None\\)"),
        ([], "empty list"),
        ("", "empty list"),
        (42, "must be a list, got int"),
        (["assert f(1) ==", "x"], "test 0 .* is not valid Python"),
        ([{"input": "1"}], "case 0 has keys \\['input'\\]"),
        ([{"input": [1], "output": "1"}], "'input' must be a string"),
        (["assert True", {"input": "", "output": ""}], "mixes or holds unsupported entries"),
        ({"a": 1}, "is a mapping with keys \\['a'\\]"),
        ({"inputs": ["1"], "outputs": []}, "different lengths"),
    ],
)
def test_malformed_tests_are_an_error_naming_the_row(bad, message):
    rows = [{"prompt": "p", "tests": ADD}, {"prompt": "q", "tests": bad}]
    with pytest.raises(DataError, match=f"the training data: row 1: .*{message}"):
        check_code_rows(rows)


def test_a_missing_column_names_the_row_and_the_columns():
    with pytest.raises(
        DataError, match=r"held-out data: row 0 has no 'tests' column \(columns: \['answer', 'prompt'\]\)"
    ):
        check_code_rows([{"prompt": "p", "answer": "1"}], where="the held-out data")


def test_same_output_ignores_trailing_whitespace_only():
    assert same_output("6\n", "6") and same_output("1 \n2\n\n", "1\n2") and same_output("a\r\nb", "a\nb")
    assert not same_output("6\n7", "6") and not same_output(" 6", "6") and not same_output("", "0")


@needs_bwrap
def test_scores_are_the_fraction_of_tests_passed():
    completions = [
        "def add(a, b):\n    return a + b",  # 3 of 3
        "```python\ndef add(a, b):\n    return a * b + (a == 0)\n```",  # add(0, 0) == 1: 0 of 3; (2,3) 7
        "def add(a, b):\n    return abs(a) + b",  # add(-1, 1) == 2: 2 of 3
        "def add(a, b) return a + b",  # syntax error
        "def add(a, b):\n    while True: pass",  # timeout
        "import ctypes\nctypes.string_at(0)",  # crash (signal)
        "raise ValueError('at the top')",  # crash (uncaught exception)
        "def add(a, b):\n    return a + b",  # the same program again: run once
    ]
    reward = make_code_reward(timeout=1.0)
    scores, outcomes, metrics = _call(reward, completions, [ADD] * len(completions))
    assert scores == [1.0, 0.0, pytest.approx(2 / 3), 0.0, 0.0, 0.0, 0.0, 1.0]
    assert outcomes == ["passed", "wrong", "wrong", "syntax_error", "timeout", "crash", "crash", "passed"]
    assert metrics["passed"] == 2 / 8 and metrics["crash"] == 2 / 8 and metrics["syntax_error"] == 1 / 8
    assert set(OUTCOMES) <= set(metrics)
    assert metrics["executions"] == 6  # 8 completions, 1 repeated, 1 that does not compile: 6 runs
    assert metrics["seconds"] > 0


@needs_bwrap
def test_runs_started_early_by_prefetch_are_what_the_call_scores():
    right, partial = "def add(a, b):\n    return a + b", "def add(a, b):\n    return abs(a) + b"
    reward = make_code_reward(timeout=2.0)
    reward.prefetch(right, {"tests": ADD})
    reward.prefetch([{"role": "assistant", "content": partial}], {"tests": ADD})  # a conversational one
    reward.prefetch("def add(a, b) return", {"tests": ADD})  # does not compile: nothing to run
    reward.prefetch("print('never scored')", {"tests": ADD})  # not among the call's completions: ignored
    reward.prefetch(right, {"prompt": "no tests column"})  # left to the call to report
    completions = [right, partial, "def add(a, b) return", "def add(a, b):\n    return a - b"]
    scores, outcomes, metrics = _call(reward, completions, [ADD] * 4)
    assert scores == [1.0, pytest.approx(2 / 3), 0.0, pytest.approx(1 / 3)]
    assert outcomes == ["passed", "wrong", "syntax_error", "wrong"]
    assert metrics["executions"] == 3 and metrics["overlapped"] == pytest.approx(2 / 3)  # the last ran late
    _, _, metrics = _call(reward, completions, [ADD] * 4)  # what was started early is used once
    assert metrics["overlapped"] == 0.0 and metrics["executions"] == 3


@needs_bwrap
def test_stdin_stdout_cases_each_run_fresh():
    completions = [
        "print(int(input()) * 2)",
        "n = int(input())\nprint(n * 2 if n > 0 else n)",  # right on 3, wrong on -4
        "n = int(input())\nprint(n * 2)\nif n < 0:\n    raise SystemExit(1)",  # exits 1 on one case: a crash
        "print(open('/tmp/seen', 'a').write('x'), int(input()) * 2)",  # no file survives from case to case
    ]
    scores, outcomes, _ = _call(make_code_reward(timeout=2.0), completions, [DOUBLE] * 4)
    assert scores == [1.0, 0.5, 0.0, 0.0] and outcomes == ["passed", "wrong", "crash", "wrong"]
    assert make_code_reward()(
        completions=["print(1 + 1, end='')"], tests=[[{"input": "", "output": "2\n"}]]
    ) == [1.0]


@needs_bwrap
def test_all_or_nothing_and_conversational_completions():
    reward = make_code_reward(all_or_nothing=True)
    partial = "def add(a, b):\n    return abs(a) + b"
    assert reward(completions=[partial, "def add(a, b):\n    return a + b"], tests=[ADD, ADD]) == [0.0, 1.0]
    chat = [[{"role": "assistant", "content": "```python\ndef add(a, b):\n    return b + a\n```"}]]
    assert code_reward(completions=chat, tests=[ADD]) == [1.0]


@needs_bwrap
def test_trls_calling_convention_and_a_bad_row_at_call_time():
    assert code_reward(["def add(a, b):\n    return a + b"], tests=[ADD]) == [1.0]  # positional completions
    with pytest.raises(DataError, match="completion 1's row: .*empty list"):
        code_reward(completions=["x = 1", "x = 2"], tests=[ADD, []])
    with pytest.raises(ValueError, match="2 completions but 1 entries"):
        code_reward(completions=["x = 1", "x = 2"], tests=[ADD])


@needs_bwrap
def test_through_score_the_outcomes_become_step_metrics():
    from cohort.rewards import RewardLogs

    logs = RewardLogs()
    out = score(
        [code_reward],
        prompts=["p", "p"],
        completions=["def add(a, b):\n    return a + b", "def add(a, b):"],
        columns={"tests": [ADD, ADD]},
        logs=logs,
    )
    assert out[:, 0].tolist() == [1.0, 0.0]
    means = logs.metric_means()
    assert means["rewards/code_reward/passed"] == 0.5 and means["rewards/code_reward/syntax_error"] == 0.5
    assert logs.extras["code_outcome"] == ["passed", "syntax_error"]


def test_code_is_a_built_in_by_every_name():
    assert BUILTIN_REWARDS["code"] is code_reward
    for spec in ("code", "code_reward", ["code"]):
        assert resolve_reward_funcs(spec) == [code_reward]
    custom = resolve_reward_funcs("code(timeout=2, all_or_nothing=True)")[0]
    assert reward_name(custom) == "code_reward" and custom.all_or_nothing is True
    with pytest.raises(ValueError, match="timeout=0"):
        resolve_reward_funcs("code(timeout=0)")
    for bad in ("0", "-2", "1.5", "True"):
        with pytest.raises(ValueError, match=rf"concurrency={bad} must be a whole number >= 1.*omit it"):
            resolve_reward_funcs(f"code(concurrency={bad})")
    with pytest.raises(ValueError, match="unexpected keyword argument 'timout'"):
        resolve_reward_funcs("code(timout=2)")
    with pytest.raises(ValueError, match=r"built-in rewards are: accuracy, format, code, .*code\(timeout=5"):
        resolve_reward_funcs("cod")


def test_yaml_rewards_name_it(tmp_path):
    path = tmp_path / "code.yaml"
    path.write_text("model: {name_or_path: runs/tiny}\ndata: {task: code}\nrewards: [code]\n")
    cfg = load_config(path)
    assert cfg.rewards == ["code"] and resolve_reward_funcs(cfg.rewards) == [code_reward]


@needs_bwrap
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:step .* health check")  # an untrained model: every group scores 0
def test_the_trl_form_takes_reward_funcs_code(tiny_model_dir, tmp_path):
    from cohort import GRPOConfig, GRPOTrainer
    from cohort.data import make_task

    rows, _ = make_task("code", n_train=16, n_eval=0, seed=0)
    args = GRPOConfig(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=12,
        max_steps=1,
        logging_steps=1,
        use_cpu=True,
    )
    trainer = GRPOTrainer(model=str(tiny_model_dir), reward_funcs="code", args=args, train_dataset=rows)
    assert trainer.reward_funcs == [code_reward]
    trainer.train()
    logged = [row for row in trainer.state.log_history if "rewards/code_reward/mean" in row]
    assert logged and "rewards/code_reward/syntax_error" in logged[0]


def test_the_reward_needs_the_tests_column_before_the_model_loads():
    from cohort.rewards import check_reward_columns

    with pytest.raises(ValueError, match="'code_reward' .*'tests'"):
        check_reward_columns([code_reward], ["answer"])
    check_reward_columns([code_reward], ["tests"])


@needs_bwrap
def test_check_rows_checks_the_data_and_starts_the_sandbox():
    from cohort.rewards import check_reward_rows

    code_reward.check_rows([{"prompt": "p", "tests": ADD}])
    with pytest.raises(DataError, match="row 0"):
        code_reward.check_rows([{"prompt": "p", "tests": "assert ("}])
    plain = resolve_reward_funcs("accuracy")[0]
    check_reward_rows([plain, code_reward], [{"prompt": "p", "tests": ADD}])  # accuracy has no row check
    with pytest.raises(DataError, match=r"the held-out data: row 1: .*empty list"):
        check_reward_rows(code_reward, [{"tests": ADD}, {"tests": []}], where="the held-out data")


@needs_bwrap
def test_a_trl_style_custom_code_reward_keeps_working_beside_the_built_in():
    from cohort import sandbox

    def test_code_solution(completions, tests, **kwargs):
        """TRL's shape of a hand-written code reward: run code + tests, 1.0 when the script exits cleanly."""
        scripts = [extract_code(c) + "\n" + "\n".join(t) for c, t in zip(completions, tests)]
        return [float(sandbox.run(s, timeout=2).ok) for s in scripts]

    out = score(
        [test_code_solution, code_reward],
        prompts=["p", "p"],
        completions=["def add(a, b):\n    return a + b", "def add(a, b):\n    return abs(a) + b"],
        columns={"tests": [ADD, ADD]},
    )
    assert out.tolist() == [[1.0, 1.0], [0.0, pytest.approx(2 / 3)]]


@needs_bwrap
@pytest.mark.parametrize("held_out", [False, True])
def test_the_trainer_refuses_a_malformed_row_before_the_model_loads(tmp_path, monkeypatch, held_out):
    from cohort import GRPOTrainer
    from cohort.train import build

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the rows were checked")

    monkeypatch.setattr(build, "load_model", no_model)
    monkeypatch.setattr(build, "load_tokenizer", no_model)
    good = [{"prompt": "write add", "tests": ADD}] * 4
    bad = [*good[:2], {"prompt": "write add", "tests": ["assert add(1,"]}]
    cfg = load_config(
        None,
        [f"out_dir={tmp_path / 'run'}", "model.name_or_path=not-loaded", "rewards=[code]",
         "rollout.group_size=2", "rollout.batch_size=4", "eval_every=0", "eval_at_ends=false"],
    )  # fmt: skip
    rows = (good, bad) if held_out else (bad, good)
    where = "the held-out data" if held_out else "the training data"
    with pytest.raises(DataError, match=f"{where}: row 2: .*not valid Python"):
        GRPOTrainer(cfg, train_rows=rows[0], eval_rows=rows[1])


def test_code_data_errors_name_the_files_line(tmp_path):
    """Rows read from a file are named by their line there (1-based, blank lines counted), as the loader's own
    errors are; in-memory rows by their index."""
    from cohort.data import load_rows
    from cohort.rewards.code import check_code_rows

    path = tmp_path / "code.jsonl"
    good = json.dumps({"prompt": "write add", "tests": ADD})
    path.write_text(f"{good}\n\n{good}\n" + json.dumps({"prompt": "write add", "tests": []}) + "\n")
    with pytest.raises(DataError, match=rf"the training data: line 4 of {path}: .*empty list"):
        check_code_rows(load_rows(path))
    path.write_text(f"{good}\n" + json.dumps({"prompt": " ", "tests": ADD}) + "\n")
    with pytest.raises(DataError, match=rf"line 2 of {path} has a prompt of only whitespace"):
        load_rows(path)
    with pytest.raises(DataError, match=r"the training data: row 1: .*empty list"):
        check_code_rows([{"tests": ADD}, {"tests": []}])
