"""A ``python`` tool for agents: the model writes code, the tool runs it in the sandbox and returns its output.

``python`` is a plain function with type hints and a Google-style docstring, the form TRL's ``tools=`` (and
transformers' ``get_json_schema``) takes. Each call runs in a fresh sandboxed interpreter: nothing persists
from one call to the next. For state that persists (variables, imports, files in ``/tmp``) across the calls
of one conversation, use a session: ``session = PythonSession()`` and pass ``session.python``, which has the
same name, signature and docstring; ``session.close()`` ends it. Output longer than ``max_chars`` is cut, and
the reply says so.
"""

from __future__ import annotations

import threading

from cohort.sandbox.limits import Limits
from cohort.sandbox.process import ExecResult
from cohort.sandbox.runner import Sandbox, Session

__all__ = ["MAX_CHARS", "TOOL_LIMITS", "PythonSession", "format_result", "python"]

MAX_CHARS = 4000
"""Characters of output the tool returns (stdout and stderr together); the rest is cut, and the reply says so."""

TOOL_LIMITS = Limits(timeout=10.0, memory_mb=1024)
"""The tool's limits: 10 s of wall clock and 1 GiB of address space per call; the rest as `Limits`."""

_tool_sandbox: Sandbox | None = None
_tool_lock = threading.Lock()


def _sandbox() -> Sandbox:
    """Returns the sandbox the tool runs in (created, and checked, on the first call)."""
    global _tool_sandbox
    with _tool_lock:
        if _tool_sandbox is None:
            _tool_sandbox = Sandbox(limits=TOOL_LIMITS)
        return _tool_sandbox


def _cut(text: str, room: int) -> tuple[str, int]:
    """Returns `text` cut to `room` characters and how many were left out."""
    if len(text) <= room:
        return text, 0
    return text[:room], len(text) - room


def format_result(result: ExecResult, *, max_chars: int = MAX_CHARS, restarted: bool = False) -> str:
    """Returns the tool's reply for `result`: stdout, then stderr, then how it ended when not normally, with
    every cut said in words."""
    stdout, cut_out = _cut(result.stdout, max_chars)
    stderr, cut_err = _cut(result.stderr, max(0, max_chars - len(stdout)))
    parts = []
    if stdout:
        parts.append(stdout if stdout.endswith("\n") else stdout + "\n")
    if cut_out:
        parts.append(f"[stdout truncated: {cut_out} more characters not shown]\n")
    if stderr:
        parts.append("stderr:\n" + (stderr if stderr.endswith("\n") else stderr + "\n"))
    if cut_err:
        parts.append(f"[stderr truncated: {cut_err} more characters not shown]\n")
    endings = {
        "timeout": f"[timed out after {result.seconds:.1f} s: the program was stopped]",
        "memory": "[ran out of memory]",
        "output_limit": "[stopped: the program printed more than the output limit; output truncated]",
        "killed": f"[killed by signal {-(result.returncode or 0)}]",
        "error": f"[exit status {result.returncode}]",
    }
    if result.status in endings:
        parts.append(endings[result.status] + "\n")
    if restarted:
        parts.append(
            "[the session ended: its variables are lost, the next call starts a fresh interpreter]\n"
        )
    return "".join(parts) or "[no output]\n"


def python(code: str) -> str:
    """Runs Python code in an isolated sandbox and returns what it printed.

    Each call starts a fresh Python interpreter: variables, imports and files do not persist between calls.
    The sandbox has no network and no access to the user's files; only /tmp is writable. A call may run
    10 seconds and use 1 GiB of memory.

    Args:
        code: The Python program to run. Use print() to show results.

    Returns:
        The program's standard output, then its standard error, then how it ended if not normally (timed
        out, ran out of memory, exit status), each cut to the output limit with the cut stated.
    """
    return format_result(_sandbox().run(code))


class PythonSession:
    """A ``python`` tool whose state persists between calls: one sandboxed interpreter per session.

    Pass ``session.python`` as the tool; variables, imports and files in ``/tmp`` persist from one call to
    the next until :meth:`close`. A call that runs past the timeout, crashes the interpreter or ends it
    loses the state, and its reply says so.

    Args:
        sandbox: the sandbox to run in (None: one with the tool's limits, TOOL_LIMITS).
        max_chars: characters of output returned per call.
    """

    def __init__(self, sandbox: Sandbox | None = None, *, max_chars: int = MAX_CHARS):
        self._session: Session = (sandbox or _sandbox()).session()
        self.max_chars = max_chars

    def python(self, code: str) -> str:
        """Runs Python code in this conversation's sandboxed interpreter and returns what it printed.

        Variables, functions, imports and files in /tmp persist from one call to the next (like a notebook).
        The sandbox has no network and no access to the user's files. A call may run 10 seconds.

        Args:
            code: The Python code to run. Use print() to show results.

        Returns:
            The code's standard output, then its standard error, then how it ended if not normally, each cut
            to the output limit with the cut stated; a reply says when the session's state was lost.
        """
        before = self._session.restarts
        result = self._session.run(code)
        return format_result(result, max_chars=self.max_chars, restarted=self._session.restarts > before)

    def close(self) -> None:
        """Returns None once the session's interpreter has ended."""
        self._session.close()

    def __enter__(self) -> PythonSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
