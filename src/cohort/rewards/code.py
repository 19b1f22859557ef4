"""The built-in ``code`` reward: run the completion's code against the row's tests, in the sandbox.

Dataset format: a ``tests`` column per row, either

- a list of Python statements, usually asserts (``["assert add(2, 3) == 5", "assert add(-1, 1) == 0"]``),
  run one by one after the completion's code in its namespace (one sandboxed process per completion); a
  test passes when it raises nothing; or
- a list of stdin/stdout cases (``[{"input": "2 3\\n", "output": "5\\n"}]``), competitive-programming style:
  the code runs once per case (a fresh process each) with ``input`` as stdin, and passes when its stdout
  equals ``output`` line by line, trailing whitespace and trailing empty lines ignored.

The column may also hold that list as a JSON string (as many datasets store it), APPS' ``{"inputs": [...],
"outputs": [...]}``, or one string of statements (one test). A row whose tests are missing or malformed is an
error naming the row: :func:`check_code_rows` checks a whole dataset before any model loads.

The code is the last fenced block tagged python (```python, ```py), else the last fenced block, else the
whole completion (an unclosed last fence counts, for completions cut at the length limit).

Score: the fraction of the row's tests passed (1.0 or 0.0 with ``all_or_nothing``). A completion that does
not compile, runs out of time or memory, writes past the output cap or crashes (the program ends on an uncaught
exception or a signal: with stdin/stdout cases, on any case) scores 0. Each completion's outcome is one of
:data:`OUTCOMES`, logged per step as ``rewards/code_reward/<outcome>`` (the share of the step's completions),
with ``rewards/code_reward/seconds`` (wall seconds per call) and ``.../executions`` (sandbox runs per call),
and in the logged samples as ``code_outcome``. Identical (code, tests) pairs within a call run once.

Overlap: ``code_reward.prefetch(completion, row)`` starts a finished completion's runs at once; the trainer
calls it for each completion that ends while the rest of its batch is still being generated, so the sandbox
works during generation, and the reward's call then waits only for what is left
(``rewards/code_reward/overlapped``: the share of the call's runs started that way).
"""

from __future__ import annotations

import json
import re
import sys
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from cohort.data.sources import DataError, row_place
from cohort.rewards.rules import completion_text
from cohort.sandbox import ExecResult, Job, Limits, Sandbox, default_sandbox

__all__ = [
    "OUTCOMES",
    "TESTS_COLUMN",
    "CodeTests",
    "check_code_rows",
    "check_reward_rows",
    "code_reward",
    "extract_code",
    "make_code_reward",
    "parse_tests",
    "same_output",
]

TESTS_COLUMN = "tests"
"""The dataset column the code reward reads."""

OUTCOMES = ("passed", "wrong", "syntax_error", "timeout", "memory", "output_limit", "crash")
"""A completion's outcome, worst first from the right: every test passed; ran but failed a test; did not
compile; ran out of wall-clock or CPU time; ran out of memory; wrote past the output cap; ended on an
uncaught exception or a signal. All but ``passed`` and ``wrong`` score 0."""

_SEVERITY = {name: i for i, name in enumerate(OUTCOMES)}
_SYNTAX_ERRORS = frozenset({"SyntaxError", "IndentationError", "TabError"})
_STATUS_OUTCOME = {
    "timeout": "timeout",
    "memory": "memory",
    "output_limit": "output_limit",
    "killed": "crash",
}
_FENCE = re.compile(
    r"^[ \t]*```[ \t]*([\w+#.-]*)[^\n]*\n(.*?)(?:^[ \t]*```[ \t]*$|\Z)", re.DOTALL | re.MULTILINE
)
_PYTHON_TAGS = frozenset({"python", "py", "python3", "py3"})
_FORMAT_HELP = (
    "give a list of assert statements (['assert f(2) == 4', ...]) or of stdin/stdout cases "
    "([{'input': '2\\n', 'output': '4\\n'}, ...]), or such a list as a JSON string"
)


def extract_code(text: str) -> str:
    """Returns the code of a completion: its last ```python block, else its last fenced block, else all of it."""
    blocks = [(m.group(1).lower(), m.group(2)) for m in _FENCE.finditer(text)]
    python = [body for tag, body in blocks if tag in _PYTHON_TAGS]
    if python:
        return python[-1]
    if blocks:
        return blocks[-1][1]
    return text


@dataclass(frozen=True)
class CodeTests:
    """One row's tests: assert statements, or stdin/stdout cases (exactly one of the two is non-empty)."""

    asserts: tuple[str, ...] = ()
    cases: tuple[tuple[str, str], ...] = ()
    """(stdin, expected stdout) pairs."""

    def __len__(self) -> int:
        return len(self.asserts) or len(self.cases)


def _text(value: Any, what: str, where: str) -> str:
    """Returns a case's input or output as text (numbers written out), or raises naming the row."""
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    raise DataError(
        f"{where}: a stdin/stdout case's {what!r} must be a string (or a number), got "
        f"{type(value).__name__}: {str(value)[:80]}; {_FORMAT_HELP}"
    )


def parse_tests(value: Any, where: str = "row") -> CodeTests:
    """Returns the CodeTests of one row's ``tests`` value, or raises DataError saying what is wrong with it."""
    if value is None:
        raise DataError(f"{where}: the {TESTS_COLUMN!r} column is empty (None); {_FORMAT_HELP}")
    if isinstance(value, str):
        stripped = value.strip()
        if stripped[:1] in ("[", "{"):
            try:
                decoded = json.loads(stripped)
            except ValueError:
                decoded = None
            if isinstance(decoded, (list, dict)):
                return parse_tests(decoded, where)
        value = [value] if stripped else []
    if isinstance(value, Mapping):
        if set(value) >= {"inputs", "outputs"} and isinstance(value["inputs"], list):
            if not isinstance(value["outputs"], list) or len(value["inputs"]) != len(value["outputs"]):
                raise DataError(f"{where}: {TESTS_COLUMN!r} has 'inputs' and 'outputs' of different lengths")
            value = [{"input": i, "output": o} for i, o in zip(value["inputs"], value["outputs"])]
        else:
            raise DataError(
                f"{where}: {TESTS_COLUMN!r} is a mapping with keys {sorted(value)[:6]}; {_FORMAT_HELP} "
                "(or APPS' {'inputs': [...], 'outputs': [...]})"
            )
    if not isinstance(value, (list, tuple)):
        raise DataError(
            f"{where}: {TESTS_COLUMN!r} must be a list, got {type(value).__name__}: {str(value)[:80]}; {_FORMAT_HELP}"
        )
    if not value:
        raise DataError(f"{where}: {TESTS_COLUMN!r} is an empty list: the row has no tests; {_FORMAT_HELP}")
    if all(isinstance(t, str) for t in value):
        for i, test in enumerate(value):
            try:
                compile(test, f"<test {i}>", "exec", dont_inherit=True)
            except (SyntaxError, ValueError) as exc:
                raise DataError(f"{where}: test {i} ({test[:80]!r}) is not valid Python: {exc}") from None
        return CodeTests(asserts=tuple(value))
    if all(isinstance(t, Mapping) for t in value):
        cases = []
        for i, case in enumerate(value):
            if "input" not in case or "output" not in case:
                raise DataError(
                    f"{where}: case {i} has keys {sorted(case)}; a stdin/stdout case needs 'input' and 'output'"
                )
            cases.append((_text(case["input"], "input", where), _text(case["output"], "output", where)))
        return CodeTests(cases=tuple(cases))
    kinds = sorted({type(t).__name__ for t in value})
    raise DataError(f"{where}: {TESTS_COLUMN!r} mixes or holds unsupported entries ({kinds}); {_FORMAT_HELP}")


def check_code_rows(rows: Sequence[Mapping[str, Any]], *, where: str = "the training data") -> None:
    """Returns None when every row has a well-formed ``tests`` column; raises DataError naming the first row that
    does not (missing column, None, empty, not a list, a test that is not valid Python, a case without output)."""
    for i, row in enumerate(rows):
        if TESTS_COLUMN not in row:
            raise DataError(
                f"{where}: {row_place(rows, i)} has no {TESTS_COLUMN!r} column (columns: {sorted(row)}); the code "
                f"reward runs each completion against its row's tests: {_FORMAT_HELP}"
            )
        parse_tests(row[TESTS_COLUMN], f"{where}: {row_place(rows, i)}")


def check_reward_rows(
    funcs: Sequence[Callable] | Callable,
    rows: Sequence[Mapping[str, Any]],
    *,
    where: str = "the training data",
) -> None:
    """Returns None when every reward function that checks rows (a ``check_rows`` attribute, as the code reward
    has) accepts `rows`; raises what the first refusal raises (DataError naming the row, SandboxUnavailable).

    Meant to run where the dataset's columns are checked, before the model loads."""
    for func in [funcs] if callable(funcs) else funcs:
        check = getattr(func, "check_rows", None)
        if callable(check):
            check(rows, where=where)


def same_output(got: str, expected: str) -> bool:
    """Returns whether two program outputs are equal line by line, trailing whitespace and blank end lines aside."""

    def lines(text: str) -> list[str]:
        out = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
        while out and not out[-1]:
            out.pop()
        return out

    return lines(got) == lines(expected)


def _compiles(code: str) -> bool:
    """Returns whether `code` compiles (checked here, without running it, to spare sandbox runs)."""
    try:
        with (
            warnings.catch_warnings()
        ):  # "invalid decimal literal" and the like concern the program, not cohort
            warnings.simplefilter("ignore")
            compile(code, "<completion>", "exec", dont_inherit=True)
    except (SyntaxError, ValueError, OverflowError, RecursionError, MemoryError):
        return False
    return True


def _job_kwargs(job: Job) -> dict[str, Any]:
    """Returns `job` as the keyword arguments of Sandbox.submit."""
    return {
        "code": job.code,
        "stdin": job.stdin,
        "tests": job.tests,
        "timeout": job.timeout,
        "memory_mb": job.memory_mb,
    }


def _run_outcome(result: ExecResult) -> str | None:
    """Returns the outcome a run forces on its completion (None when it ran to the end normally)."""
    if result.error in _SYNTAX_ERRORS:
        return "syntax_error"
    if result.status in _STATUS_OUTCOME:
        return _STATUS_OUTCOME[result.status]
    if result.status == "error":
        return "crash"
    return None


def _judge(suite: CodeTests, results: list[ExecResult]) -> tuple[str, int]:
    """Returns (outcome, tests passed) of one completion from its sandbox runs (one for asserts, one per case)."""
    forced = [o for o in (_run_outcome(r) for r in results) if o is not None]
    if forced:
        return max(forced, key=_SEVERITY.__getitem__), 0
    if suite.asserts:
        passed = sum(outcome == "pass" for outcome in (results[0].tests or ()))
    else:
        passed = sum(same_output(r.stdout, expected) for r, (_, expected) in zip(results, suite.cases))
    return ("passed" if passed == len(suite) else "wrong"), passed


def make_code_reward(
    *,
    timeout: float | None = None,
    memory_mb: int | None = None,
    all_or_nothing: bool = False,
    concurrency: int | None = None,
    unsafe: bool = False,
    python: str | None = None,
    site_packages: bool = False,
) -> Callable[..., list[float]]:
    """Returns a code reward named ``code_reward`` (module docstring) with its own sandbox options.

    `timeout` (wall-clock seconds per run, default 5) and `memory_mb` (default 512) set the runs' limits;
    `all_or_nothing` scores 1.0 only when every test passes; `concurrency` bounds the runs at once (default:
    the cores); `unsafe` runs without isolation (resource limits only; loudly logged); `python` is the
    interpreter (default: cohort's, without site-packages); `site_packages` lets programs import its packages.
    The sandbox starts (and is checked) on the first call or on ``code_reward.check_rows(rows)``.
    """
    if not isinstance(all_or_nothing, bool):
        raise ValueError(f"code reward: all_or_nothing={all_or_nothing!r} must be true or false")
    limits = Limits().with_(timeout=timeout, memory_mb=memory_mb)  # checks the values now, before any run
    if concurrency is not None and (
        isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1
    ):
        raise ValueError(
            f"code reward: concurrency={concurrency!r} must be a whole number >= 1 (the programs run at once); "
            "omit it to run one per core"
        )
    custom = any([timeout is not None, memory_mb is not None, concurrency, unsafe, python, site_packages])
    holder: list[Sandbox] = []
    lock = threading.Lock()

    def sandbox() -> Sandbox:
        """Returns this reward's sandbox, started on first use (the shared default one unless options differ)."""
        with lock:
            if not holder:
                if not custom:
                    holder.append(default_sandbox())
                else:
                    holder.append(
                        Sandbox(
                            limits=limits,
                            concurrency=concurrency,
                            unsafe=unsafe,
                            python=python,
                            site_packages=site_packages,
                        )
                    )
            return holder[0]

    # (code, tests) -> the runs started by `prefetch` while the rest of the batch was still being generated
    # (None: it does not compile). Consumed, then emptied, by the next call of the reward.
    early: dict[tuple[str, CodeTests], list[Future[ExecResult]] | None] = {}
    early_lock = threading.Lock()

    def plan(box: Sandbox, code: str, suite: CodeTests) -> list[Job] | None:
        """Returns the sandbox runs that judge `code` against `suite` (None: it does not compile)."""
        if box.interpreter.version >> 16 == sys.hexversion >> 16 and not _compiles(code):
            return None
        if suite.asserts:
            return [Job(code, tests=suite.asserts)]
        return [Job(code, stdin=stdin) for stdin, _ in suite.cases]

    def prefetch(completion: Any, row: Mapping[str, Any]) -> None:
        """Returns None after starting, in the sandbox's pool, the runs that will judge one finished completion of
        `row`, so they overlap the generation of the others; the reward's call then waits on them."""
        try:
            suite = parse_tests(row[TESTS_COLUMN])
        except (KeyError, DataError):
            return  # the reward's own call reports it
        key = (extract_code(completion_text(completion)), suite)
        box = sandbox()
        with early_lock:
            if key in early:
                return
            runs = plan(box, *key)
            early[key] = None if runs is None else [box.submit(**_job_kwargs(job)) for job in runs]

    def code_reward(completions: Sequence[Any], tests: Sequence[Any], **kwargs: Any) -> list[float]:
        """Returns per completion the fraction of its row's tests its code passes (0 when it does not compile,
        times out, runs out of memory or crashes), running it in the sandbox."""
        started = time.perf_counter()
        if len(tests) != len(completions):
            raise ValueError(
                f"code_reward: {len(completions)} completions but {len(tests)} entries of the {TESTS_COLUMN!r} "
                "column; give one per completion"
            )
        box = sandbox()
        suites = [parse_tests(t, f"code_reward: completion {i}'s row") for i, t in enumerate(tests)]
        codes = [extract_code(completion_text(c)) for c in completions]
        with early_lock:
            started_early = dict(early)
            early.clear()
        # One list of runs per distinct (code, tests) pair, started early or now; None: nothing to run.
        planned: dict[tuple[str, CodeTests], list[Future[ExecResult]] | None] = {}
        runs_early = runs_now = 0
        for key in zip(codes, suites):
            if key in planned:
                continue
            if key in started_early:
                planned[key] = started_early[key]
                runs_early += len(planned[key] or ())
            else:
                runs = plan(box, *key)
                planned[key] = None if runs is None else [box.submit(**_job_kwargs(j)) for j in runs]
                runs_now += len(runs or ())
        verdicts: dict[tuple[str, CodeTests], tuple[str, int]] = {
            key: ("syntax_error", 0) if runs is None else _judge(key[1], [f.result() for f in runs])
            for key, runs in planned.items()
        }
        scores: list[float] = []
        outcomes: list[str] = []
        for key in zip(codes, suites):
            outcome, passed = verdicts[key]
            outcomes.append(outcome)
            if all_or_nothing:
                scores.append(float(outcome == "passed"))
            else:
                scores.append(passed / len(key[1]))
        log_metric = kwargs.get("log_metric")
        if callable(log_metric):
            for outcome in outcomes:
                for name in OUTCOMES:
                    log_metric(name, float(outcome == name))
            log_metric("executions", float(runs_early + runs_now))
            log_metric("overlapped", runs_early / max(runs_early + runs_now, 1))
            log_metric("seconds", time.perf_counter() - started)
        log_extra = kwargs.get("log_extra")
        if callable(log_extra):
            log_extra("code_outcome", outcomes)
        return scores

    def check_rows(rows: Sequence[Mapping[str, Any]], where: str = "the training data") -> None:
        """Returns None when every row has well-formed tests and the sandbox starts; raises naming the problem."""
        check_code_rows(rows, where=where)
        sandbox()

    code_reward.check_rows = check_rows  # type: ignore[attr-defined]
    code_reward.prefetch = prefetch  # type: ignore[attr-defined]
    code_reward.all_or_nothing = all_or_nothing  # type: ignore[attr-defined]
    return code_reward


make_code_reward.spec_example = "timeout=5, all_or_nothing=True"  # type: ignore[attr-defined]

code_reward = make_code_reward()
"""The ``code`` built-in (``rewards: [code]``, ``reward_funcs="code"``): default limits, fraction of tests passed."""
