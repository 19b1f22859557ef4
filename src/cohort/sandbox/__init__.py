"""Run untrusted Python (model completions, tool calls) isolated under bubblewrap, with resource limits.

``run(code, stdin=..., timeout=..., memory_mb=...)`` returns an :class:`ExecResult` (``status`` one of
``ok``, ``error``, ``timeout``, ``memory``, ``output_limit``, ``killed``; ``returncode``, ``stdout``,
``stderr``, ``seconds``) and never raises for anything the program does. It uses one process-wide
:class:`Sandbox`, created on first use; build your own for other limits, another interpreter, a pool of
another size, or the explicit ``unsafe=True``. docs/sandbox.md says what is isolated and what is not.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from cohort.sandbox.bwrap import KINDS, SandboxUnavailable
from cohort.sandbox.limits import Limits
from cohort.sandbox.process import EXIT_STATUSES, ExecResult, SandboxError
from cohort.sandbox.runner import Job, Sandbox, Session, UnsafeSandboxWarning, default_concurrency

__all__ = [
    "EXIT_STATUSES",
    "KINDS",
    "ExecResult",
    "Job",
    "Limits",
    "Sandbox",
    "SandboxError",
    "SandboxUnavailable",
    "Session",
    "UnsafeSandboxWarning",
    "default_concurrency",
    "default_sandbox",
    "run",
    "run_many",
]

_default: Sandbox | None = None
_default_lock = threading.Lock()


def default_sandbox() -> Sandbox:
    """Returns the process-wide Sandbox with the default limits (created, and checked, on first use)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Sandbox()
        return _default


def run(
    code: str,
    *,
    stdin: str = "",
    timeout: float | None = None,
    memory_mb: int | None = None,
    tests: Sequence[str] | None = None,
) -> ExecResult:
    """Returns how `code` ended in the default sandbox (see :meth:`Sandbox.run`); never raises for what it does.

    `timeout` is wall-clock seconds (default 5), `memory_mb` the address space (default 512); where no
    isolation is possible the first call raises SandboxUnavailable saying how to install or enable bubblewrap.
    """
    return default_sandbox().run(code, stdin=stdin, timeout=timeout, memory_mb=memory_mb, tests=tests)


def run_many(jobs: Sequence[Job]) -> list[ExecResult]:
    """Returns the results of `jobs` in order, run in the default sandbox's bounded pool."""
    return default_sandbox().run_many(jobs)
