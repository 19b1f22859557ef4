"""cohort.episodes.execution: sync tools on threads and async ones on an event loop, concurrently, each under a
timeout; failures as TRL's `{'error': ...}` text, never an exception; results as text within a budget; TRL's tool
metrics."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from cohort.episodes import (
    ToolCall,
    ToolExecutor,
    ToolResult,
    call_frequency,
    error_text,
    execute,
    failure_frequency,
    render_result,
    tool_metrics,
    tool_set,
    truncate_result,
)
from cohort.errors import ConfigError

RELEASE = threading.Event()
"""Set at the end of the module: lets the tool that never returns finish, so no thread outlives the tests."""


@pytest.fixture(scope="module", autouse=True)
def _release_hung_tools():
    yield
    RELEASE.set()


def multiply(a: int, b: int) -> int:
    """Multiplies two integers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return a * b


def nap(seconds: float) -> str:
    """Sleeps.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return f"slept {seconds}"


async def async_nap(seconds: float) -> str:
    """Sleeps without blocking.

    Args:
        seconds: How long.
    """
    await asyncio.sleep(seconds)
    return f"napped {seconds}"


def explode(reason: str) -> str:
    """Raises.

    Args:
        reason: The message.
    """
    raise ZeroDivisionError(reason)


async def async_explode(reason: str) -> str:
    """Raises, asynchronously.

    Args:
        reason: The message.
    """
    raise KeyError(reason)


def hang(note: str) -> str:
    """Never returns while the tests run.

    Args:
        note: Ignored.
    """
    RELEASE.wait()
    return note


def leave(code: int) -> str:
    """Calls sys.exit.

    Args:
        code: The exit code.
    """
    raise SystemExit(code)


def structured(kind: str) -> object:
    """Returns structured data.

    Args:
        kind: Which shape.
    """
    return {"dict": {"value": 6, "unit": "m²"}, "list": [1, "two"], "none": None, "tuple": (1, 2), "int": 6}[
        kind
    ]


def essay(length: int) -> str:
    """Writes a long text.

    Args:
        length: Its length in characters.
    """
    return "x" * length


TOOLS = tool_set([multiply, nap, async_nap, explode, async_explode, hang, leave, structured, essay])


def call(name: str, **arguments) -> ToolCall:
    return ToolCall(name=name, arguments=arguments, raw="")


def test_sync_and_async_tools_return_text_in_call_order():
    results = execute([call("multiply", a=6, b=7), call("async_nap", seconds=0.01)], TOOLS, timeout=5)
    assert [r.content for r in results] == ["42", "napped 0.01"]
    assert all(isinstance(r, ToolResult) and not r.failed and r.failure is None for r in results)
    assert results[0].message() == {"role": "tool", "name": "multiply", "content": "42"}
    with_id = execute([ToolCall("multiply", {"a": 1, "b": 1}, raw="", id="abc123def")], TOOLS, timeout=5)
    assert with_id[0].message() == {
        "role": "tool",
        "name": "multiply",
        "content": "1",
        "tool_call_id": "abc123def",
    }


def test_calls_run_concurrently():
    calls = [call("nap", seconds=0.4) for _ in range(3)] + [call("async_nap", seconds=0.4) for _ in range(3)]
    start = time.perf_counter()
    results = execute(calls, TOOLS, timeout=5)
    assert time.perf_counter() - start < 1.2  # six 0.4 s tools, not 2.4 s in a row
    assert not any(r.failed for r in results)
    assert all(r.seconds >= 0.39 for r in results)


def test_sync_workers_are_bounded():
    start = time.perf_counter()
    execute([call("nap", seconds=0.3) for _ in range(4)], TOOLS, timeout=5, max_workers=2)
    assert time.perf_counter() - start >= 0.59  # two at a time: two rounds


def test_a_tool_that_raises_returns_trls_error_text_and_is_counted():
    results = execute(
        [call("explode", reason="boom"), call("async_explode", reason="gone")], TOOLS, timeout=5
    )
    assert [r.content for r in results] == ["{'error': 'boom'}", "{'error': \"'gone'\"}"]  # str(exc), as TRL
    assert all(r.failed and r.failure == "raised" for r in results)
    assert error_text("boom") == str({"error": "boom"})


def test_a_tool_calling_sys_exit_does_not_stop_the_executor():
    with ToolExecutor(timeout=5) as executor:
        (result,) = executor.run([call("leave", code=3)], TOOLS)
        assert result.failed and result.content == "{'error': 'SystemExit: 3'}"
        assert executor.run([call("multiply", a=2, b=2)], TOOLS)[0].content == "4"


def test_timeouts_return_quickly_and_leave_the_executor_usable():
    with ToolExecutor(timeout=0.2) as executor:
        start = time.perf_counter()
        results = executor.run(
            [call("hang", note="x"), call("async_nap", seconds=30), call("multiply", a=1, b=2)], TOOLS
        )
        assert time.perf_counter() - start < 2.0
        assert [r.failure for r in results] == ["timeout", "timeout", None]
        assert results[0].content == "{'error': 'Tool hang timed out after 0.2 s.'}"
        assert results[2].content == "2"
        # the abandoned thread no longer holds a worker slot
        assert [r.content for r in executor.run([call("multiply", a=3, b=3)] * 9, TOOLS)] == ["9"] * 9


def test_unknown_tools_and_bad_arguments_are_failed_calls_not_exceptions():
    results = execute(
        [
            call("divide", a=1, b=2),
            call("multiply", a=1),
            call("multiply", a=1, b=2, c=3),
            ToolCall("multiply", ["not", "a", "dict"], raw=""),  # type: ignore[arg-type]
        ],
        TOOLS,
        timeout=5,
    )
    assert [r.failure for r in results] == ["unknown_tool", "bad_arguments", "bad_arguments", "bad_arguments"]
    assert results[0].content == "{'error': 'Tool divide not found.'}"  # TRL's words
    assert "multiply() missing 1 required positional argument: 'b'" in results[1].content  # Python's, as TRL
    assert "unexpected keyword argument 'c'" in results[2].content
    assert "must be an object of named arguments, got list" in results[3].content


def test_results_are_rendered_as_text():
    results = execute(
        [call("structured", kind=k) for k in ("dict", "list", "none", "tuple", "int")], TOOLS, timeout=5
    )
    assert [r.content for r in results] == ['{"value": 6, "unit": "m²"}', '[1, "two"]', "None", "[1, 2]", "6"]
    as_trl = execute([call("structured", kind="dict")], TOOLS, timeout=5, result_format="str")
    assert as_trl[0].content == "{'value': 6, 'unit': 'm²'}"  # str(result), as TRL's GRPOTrainer
    assert render_result({"tags": {"a"}}) == '{"tags": "{\'a\'}"}'  # values JSON cannot hold go through str


def test_long_results_are_truncated_and_say_so():
    (result,) = execute([call("essay", length=5000)], TOOLS, timeout=5, max_chars=200)
    assert result.truncated and not result.failed
    note = "\n[truncated: 158 of 5000 characters shown]"
    assert result.content == "x" * 158 + note and len(result.content) == 200
    (short,) = execute([call("essay", length=200)], TOOLS, timeout=5, max_chars=200)
    assert short.content == "x" * 200 and not short.truncated
    assert truncate_result("abc", None) == ("abc", False)


def test_bad_executor_settings_are_config_errors():
    with pytest.raises(ConfigError, match="timeout must be a positive"):
        ToolExecutor(timeout=0)
    with pytest.raises(ConfigError, match="at least 64 characters"):
        ToolExecutor(timeout=1, max_chars=10)
    with pytest.raises(ConfigError, match="max_workers"):
        ToolExecutor(timeout=1, max_workers=0)
    with pytest.raises(ConfigError, match="result_format"):
        ToolExecutor(timeout=1, result_format="yaml")  # type: ignore[arg-type]


def test_submit_returns_before_the_tools_finish():
    with ToolExecutor(timeout=5) as executor:
        start = time.perf_counter()
        future = executor.submit([call("nap", seconds=0.3)], TOOLS)
        assert time.perf_counter() - start < 0.2 and not future.done()
        assert future.result()[0].content == "slept 0.3"
    with pytest.raises(RuntimeError, match="closed"):
        executor.submit([call("multiply", a=1, b=1)], TOOLS)
    executor.close()  # closing twice is harmless


def test_trls_tool_metrics():
    ok = ToolResult(name="multiply", content="6")
    bad = ToolResult(name="multiply", content="{'error': 'x'}", failed=True, failure="raised")
    metrics = tool_metrics([[ok, bad], [], [ok, ok]])
    assert metrics == {"tools/call_frequency": 4 / 3, "tools/failure_frequency": 1 / 4}
    assert tool_metrics([[], []]) == {"tools/call_frequency": 0.0, "tools/failure_frequency": 0.0}
    assert tool_metrics([]) == {"tools/call_frequency": 0.0, "tools/failure_frequency": 0.0}
    assert call_frequency(6, 4) == 1.5 and failure_frequency(1, 4) == 0.25 and failure_frequency(0, 0) == 0.0
