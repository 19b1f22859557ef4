"""Running parsed tool calls: sync tools on worker threads, async ones concurrently on one event loop, each under
a timeout, and TRL's tool metrics.

A call never raises into the episode: a tool that raises or times out, an unknown tool name and arguments
the tool does not take each give a failed `ToolResult` whose text is TRL's `{'error': ...}` (a Python
dict's str, as `GRPOTrainer` writes it) and which the metrics count. Sync tools run on daemon threads
because a thread cannot be stopped: one that never returns is abandoned at its timeout and cannot keep
the process from exiting (a `ThreadPoolExecutor` joins its workers at exit).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import json
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from cohort.episodes.parsers import ToolCall
from cohort.episodes.tools import Tool
from cohort.errors import ConfigError

ResultFormat = Literal["json", "str"]

MIN_RESULT_CHARS = 64
"""The smallest character budget for a tool result: the truncation note must fit in it."""

FailureKind = Literal["raised", "timeout", "unknown_tool", "bad_arguments"]


@dataclass(frozen=True)
class ToolResult:
    """The outcome of one call: the text the model sees, whether (and how) it failed, whether it was truncated."""

    name: str
    content: str
    failed: bool = False
    failure: FailureKind | None = None
    truncated: bool = False
    seconds: float = 0.0
    call_id: str | None = None

    def message(self) -> dict[str, Any]:
        """Returns the tool message TRL appends for this result: `{"role": "tool", "name", "content"}` (+ its call id)."""
        message: dict[str, Any] = {"role": "tool", "name": self.name, "content": self.content}
        if self.call_id is not None:
            message["tool_call_id"] = self.call_id
        return message


def error_text(message: str) -> str:
    """Returns a failed call's result text exactly as TRL writes it: `str({"error": message})`."""
    return str({"error": message})


def render_result(value: Any, result_format: ResultFormat = "json") -> str:
    """Returns a tool's return value as the text of its tool message.

    "json": strings as they are, dicts / lists / tuples as JSON (non-JSON values through str), anything
    else through str. "str": `str(value)` for everything, as TRL's GRPOTrainer renders a result.
    """
    if isinstance(value, str):
        return value
    if result_format == "json" and isinstance(value, (dict, list, tuple)):
        try:
            return json.dumps(value, ensure_ascii=False, default=str)
        except (TypeError, ValueError):
            return str(value)
    return str(value)


def truncate_result(text: str, max_chars: int | None) -> tuple[str, bool]:
    """Returns `text` cut to at most `max_chars` characters with a note saying so, and whether it was cut."""
    if max_chars is None or len(text) <= max_chars:
        return text, False
    note = f"\n[truncated: {{kept}} of {len(text)} characters shown]"
    kept = max(0, max_chars - len(note.format(kept=max_chars)))
    return text[:kept] + note.format(kept=kept), True


def _check_arguments(tool: Tool, arguments: Any) -> str | None:
    """Returns why `arguments` cannot be passed to the tool, or None when they bind to its signature."""
    if not isinstance(arguments, Mapping):
        return f"the arguments of {tool.name} must be an object of named arguments, got {type(arguments).__name__}"
    try:
        inspect.signature(tool.callable).bind(**arguments)
    except TypeError as exc:
        return f"{tool.name}() {exc}"
    return None


def _binding_error(tool: Tool, arguments: Any, problem: str) -> str:
    """Returns the text of a call whose arguments do not bind: Python's own TypeError, as TRL's call gives it
    (arguments that do not bind fail before the tool's body runs), or `problem` for non-object arguments."""
    if not isinstance(arguments, Mapping):
        return problem
    try:
        result = tool.callable(**arguments)
    except TypeError as exc:
        return str(exc)
    if inspect.iscoroutine(result):  # bound after all (a wrapper's *args): never awaited
        result.close()
    return problem


def _run_in_daemon_thread(
    loop: asyncio.AbstractEventLoop, function: Callable[..., Any], arguments: Mapping[str, Any]
) -> asyncio.Future[Any]:
    """Returns a future of the loop that a new daemon thread resolves with `function(**arguments)`."""
    future: asyncio.Future[Any] = loop.create_future()

    def settle(outcome: Any, failed: bool) -> None:
        if future.done():  # timed out and cancelled meanwhile: nobody waits for this result any more
            return
        if failed:
            future.set_exception(outcome)
        else:
            future.set_result(outcome)

    def work() -> None:
        try:
            outcome, failed = function(**arguments), False
        except Exception as exc:
            outcome, failed = exc, True
        # SystemExit raised into the loop would stop it: a tool's SystemExit is the tool's failure too
        except BaseException as exc:
            outcome, failed = RuntimeError(f"{type(exc).__name__}: {exc}"), True
        try:
            loop.call_soon_threadsafe(settle, outcome, failed)
        except RuntimeError:  # the loop was closed while the tool ran
            pass

    threading.Thread(
        target=work, name=f"cohort-tool-{getattr(function, '__name__', 'tool')}", daemon=True
    ).start()
    return future


async def _guarded(awaitable: Awaitable[Any]) -> Any:
    """Returns what `awaitable` returns; a SystemExit it raises becomes a RuntimeError (it would stop the loop)."""
    try:
        return await awaitable
    except (Exception, asyncio.CancelledError):
        raise
    except BaseException as exc:
        raise RuntimeError(f"{type(exc).__name__}: {exc}") from exc


class ToolExecutor:
    """Runs tool calls, sync ones on daemon threads (at most `max_workers` at once) and async ones on this
    executor's event loop thread, each under `timeout` seconds; `submit` returns without waiting, so the
    episode loop can generate for other episodes while tools run."""

    def __init__(
        self,
        *,
        timeout: float,
        max_workers: int = 8,
        max_chars: int | None = None,
        result_format: ResultFormat = "json",
    ) -> None:
        if not timeout > 0:
            raise ConfigError(f"the tool timeout must be a positive number of seconds, got {timeout!r}")
        if max_workers < 1:
            raise ConfigError(f"max_workers must be at least 1, got {max_workers!r}")
        if max_chars is not None and max_chars < MIN_RESULT_CHARS:
            raise ConfigError(
                f"the tool result budget must be at least {MIN_RESULT_CHARS} characters (the truncation note has to "
                f"fit), got {max_chars!r}"
            )
        if result_format not in ("json", "str"):
            raise ConfigError(f"result_format must be 'json' or 'str', got {result_format!r}")
        self.timeout = float(timeout)
        self.max_workers = max_workers
        self.max_chars = max_chars
        self.result_format: ResultFormat = result_format
        self._loop = asyncio.new_event_loop()
        self._slots: asyncio.Semaphore | None = None
        ready = threading.Event()
        self._thread = threading.Thread(
            target=self._serve, args=(ready,), name="cohort-tool-loop", daemon=True
        )
        self._thread.start()
        ready.wait()
        self._closed = False

    def _serve(self, ready: threading.Event) -> None:
        """Runs the executor's event loop until close()."""
        asyncio.set_event_loop(self._loop)
        self._slots = asyncio.Semaphore(self.max_workers)
        ready.set()
        self._loop.run_forever()

    def submit(
        self, calls: Sequence[ToolCall], tools: Mapping[str, Tool]
    ) -> concurrent.futures.Future[list[ToolResult]]:
        """Returns a future of the calls' results, in the calls' order; every call starts at once."""
        if self._closed:
            raise RuntimeError("this ToolExecutor is closed")
        return asyncio.run_coroutine_threadsafe(self._run_all(list(calls), tools), self._loop)

    def run(self, calls: Sequence[ToolCall], tools: Mapping[str, Tool]) -> list[ToolResult]:
        """Returns the calls' results in their order, waiting for them."""
        return self.submit(calls, tools).result()

    async def _run_all(self, calls: list[ToolCall], tools: Mapping[str, Tool]) -> list[ToolResult]:
        """Returns the results of `calls`, run concurrently."""
        return list(await asyncio.gather(*(self._run_one(call, tools) for call in calls)))

    async def _run_one(self, call: ToolCall, tools: Mapping[str, Tool]) -> ToolResult:
        """Returns the result of one call, its failure turned into error text."""
        tool = tools.get(call.name)
        if tool is None:
            return self._failed(call, f"Tool {call.name} not found.", "unknown_tool", 0.0)
        problem = _check_arguments(tool, call.arguments)
        if problem is not None:
            return self._failed(call, _binding_error(tool, call.arguments, problem), "bad_arguments", 0.0)
        if tool.is_async:
            future: asyncio.Future[Any] = asyncio.ensure_future(_guarded(tool.callable(**call.arguments)))
            start = time.perf_counter()
            done, _ = await asyncio.wait({future}, timeout=self.timeout)
        else:
            assert self._slots is not None
            async with self._slots:
                # the timeout counts from the tool's start, not from its wait for a free worker
                start = time.perf_counter()
                future = _run_in_daemon_thread(self._loop, tool.callable, call.arguments)
                done, _ = await asyncio.wait({future}, timeout=self.timeout)
        seconds = time.perf_counter() - start
        if not done:
            future.cancel()
            return self._failed(
                call, f"Tool {call.name} timed out after {self.timeout:g} s.", "timeout", seconds
            )
        if future.cancelled():  # the tool itself raised CancelledError
            return self._failed(call, f"Tool {call.name} was cancelled.", "raised", seconds)
        error = future.exception()
        if error is not None:
            return self._failed(call, str(error), "raised", seconds)
        try:
            content = render_result(future.result(), self.result_format)
        except Exception as exc:  # a return value whose str() raises is the tool's failure too
            return self._failed(
                call, f"the result of {call.name} cannot be shown as text: {exc}", "raised", seconds
            )
        content, truncated = truncate_result(content, self.max_chars)
        return ToolResult(
            name=call.name, content=content, truncated=truncated, seconds=seconds, call_id=call.id
        )

    def _failed(self, call: ToolCall, message: str, failure: FailureKind, seconds: float) -> ToolResult:
        """Returns a failed result whose text is TRL's `{'error': ...}`."""
        content, truncated = truncate_result(error_text(message), self.max_chars)
        return ToolResult(
            name=call.name,
            content=content,
            failed=True,
            failure=failure,
            truncated=truncated,
            seconds=seconds,
            call_id=call.id,
        )

    def close(self) -> None:
        """Stops the event loop (tools still running on threads are abandoned)."""
        if self._closed:
            return
        self._closed = True
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5.0)
        if not self._thread.is_alive():
            self._loop.close()

    def __enter__(self) -> ToolExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def execute(
    calls: Sequence[ToolCall],
    tools: Mapping[str, Tool],
    *,
    timeout: float,
    max_chars: int | None = None,
    max_workers: int = 8,
    result_format: ResultFormat = "json",
) -> list[ToolResult]:
    """Returns the results of `calls` (in order), run by a ToolExecutor made for this one batch of calls."""
    with ToolExecutor(
        timeout=timeout, max_workers=max_workers, max_chars=max_chars, result_format=result_format
    ) as executor:
        return executor.run(calls, tools)


def call_frequency(num_calls: int, num_rollouts: int) -> float:
    """Returns TRL's `tools/call_frequency`: tool calls per rollout (0.0 with no rollouts)."""
    return num_calls / num_rollouts if num_rollouts > 0 else 0.0


def failure_frequency(num_failures: int, num_calls: int) -> float:
    """Returns TRL's `tools/failure_frequency`: failed calls per call (0.0 with no calls)."""
    return num_failures / num_calls if num_calls > 0 else 0.0


def tool_metrics(results_per_rollout: Sequence[Sequence[ToolResult]]) -> dict[str, float]:
    """Returns TRL's tool metrics, `tools/call_frequency` and `tools/failure_frequency`, of one process's rollouts
    (each rollout's results over all its turns). Across processes, sum the counts first and use the two functions."""
    calls = sum(len(results) for results in results_per_rollout)
    failures = sum(result.failed for results in results_per_rollout for result in results)
    return {
        "tools/call_frequency": call_frequency(calls, len(results_per_rollout)),
        "tools/failure_frequency": failure_frequency(failures, calls),
    }
