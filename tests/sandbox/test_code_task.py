"""The built-in code task: its rows, its reference programs (which pass their own tests), and a GRPO run on it."""

from __future__ import annotations

import json
import shutil

import pytest

from cohort.config import load_config
from cohort.data import TASKS, CodeTask, get_task, make_task, sft_completion
from cohort.data.code_tasks import CODE_TEMPLATES
from cohort.rewards import check_code_rows, code_reward

needs_bwrap = pytest.mark.skipif(
    shutil.which("bwrap") is None, reason="bubblewrap is not installed (CI installs it)"
)


def test_the_task_is_registered_and_its_rows_have_tests():
    assert TASKS["code"] is CodeTask
    task = get_task("code")
    assert task.size == sum(len(t.values) for t in CODE_TEMPLATES) == 1170
    assert task.problem(0) == {
        "prompt": "# add 1 to x\n",
        "tests": ["assert f(0) == 1", "assert f(5) == 6", "assert f(12) == 13", "assert f(-3) == -2"],
    }
    assert task.solution(0) == "def f(x):\n    return x+1"
    stdin_rows = [task.problem(i) for i in range(task.size - 2, task.size)]
    assert stdin_rows[-1]["tests"] == [
        {"input": "0\n", "output": "99\n"},
        {"input": "17\n", "output": "116\n"},
    ]
    assert get_task("code", stdin=False).size == task.size - 98 - 99
    with pytest.raises(IndexError, match="out of range"):
        task.problem(task.size)


def test_train_and_held_out_problems_are_disjoint_and_well_formed():
    train, held = make_task("code", n_train=600, n_eval=100, seed=3)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held}
    check_code_rows(train)
    check_code_rows(held, where="the held-out data")
    assert sft_completion("code", held[0]) == get_task("code").solution(
        next(i for i in range(1170) if get_task("code").problem(i)["prompt"] == held[0]["prompt"])
    )
    with pytest.raises(ValueError, match="not one of the task's prompts"):
        sft_completion("code", {"prompt": "# fly\n"})


@needs_bwrap
def test_every_templates_reference_passes_and_a_near_miss_does_not():
    task = get_task("code")
    rows, right, near = [], [], []
    index = 0
    for template in CODE_TEMPLATES:  # its first and last number
        for k in (0, len(template.values) - 1):
            a = template.values[k]
            rows.append(task.problem(index + k))
            right.append(template.solution.format(a=a))
            near.append(template.solution.format(a=a + 1))  # the number off by one
        index += len(template.values)
    tests = [r["tests"] for r in rows]
    assert code_reward(completions=right, tests=tests) == [1.0] * len(rows)
    missed = code_reward(completions=near, tests=tests)
    assert all(score < 1.0 for score in missed), [r["prompt"] for r, m in zip(rows, missed) if m == 1.0]


@needs_bwrap
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:step .* health check")  # an untrained model: every group scores 0
def test_grpo_runs_on_the_code_task_with_the_code_reward(tiny_model_dir, tmp_path):
    from cohort.trainer import GRPOTrainer

    cfg = load_config(
        None,
        {
            "model": {"name_or_path": str(tiny_model_dir)},
            "data": {"task": "code", "n_train": 32, "n_eval": 4},
            "rollout": {"group_size": 4, "batch_size": 16, "max_completion_length": 24},
            "rewards": ["code"],
            "steps": 2,
            "out_dir": str(tmp_path / "run"),
            "progress": False,
            "save_every": 0,
        },
    )
    trainer = GRPOTrainer(cfg)
    summary = trainer.train()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and summary["accuracy_after"] is not None
    for row in rows:
        shares = [row[f"rewards/code_reward/{kind}"] for kind in ("passed", "wrong", "syntax_error", "crash")]
        assert all(0.0 <= s <= 1.0 for s in shares)
        assert row["rewards/code_reward/syntax_error"] > 0.5  # an untrained model writes no Python
        assert "rewards/code_reward/seconds" in row
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert samples and all(s["code_outcome"] in ("syntax_error", "wrong", "crash", "passed") for s in samples)
