"""The sandbox: run one program, many at once in a bounded pool, or a session that keeps its state.

``Sandbox()`` finds how to isolate programs on this machine (``bwrap.py``) and checks it by running one
before it accepts work; where nothing works it refuses with :class:`SandboxUnavailable`, saying how to install
or enable bubblewrap. ``Sandbox(unsafe=True)`` runs programs without isolation, under the resource limits
only, and says so loudly. A process is never reused: every run (every completion, every tool call outside a
session) starts a fresh interpreter in a fresh sandbox.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import shutil
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from cohort.sandbox.bwrap import (
    INSTALL_HELP,
    SLOT_UID_BASE,
    Isolation,
    SandboxUnavailable,
    candidates,
    inspect_interpreter,
    unreadable_by_others,
)
from cohort.sandbox.launcher import frame, new_tag, parse_report, payload
from cohort.sandbox.limits import Limits
from cohort.sandbox.process import ExecResult, SandboxError, SandboxProcess, classify

__all__ = ["Job", "Sandbox", "Session", "UnsafeSandboxWarning", "default_concurrency", "slot_uid"]

logger = logging.getLogger("cohort.sandbox")

_NO_PAYLOAD = 121  # the launcher's exit status when it got no payload (the host side failed, not the program)
_SESSION_CPU_SECONDS = 300


class UnsafeSandboxWarning(UserWarning):
    """Programs run without isolation (``unsafe=True``): only resource limits stand between them and the machine."""


def default_concurrency() -> int:
    """Returns the number of programs run at once by default: the cores this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


@dataclass(frozen=True)
class Job:
    """One program for :meth:`Sandbox.run_many`: the same arguments as :meth:`Sandbox.run`."""

    code: str
    stdin: str = ""
    tests: tuple[str, ...] | None = None
    timeout: float | None = None
    memory_mb: int | None = None


class _Slots:
    """Hands out slot numbers (a uid each when run as root) so concurrent runs never share a uid."""

    def __init__(self) -> None:
        self._free: list[int] = []
        self._next = 0
        self._lock = threading.Lock()

    def take(self) -> int:
        """Returns a slot no running program holds."""
        with self._lock:
            if self._free:
                return self._free.pop()
            self._next += 1
            return self._next - 1

    def give(self, slot: int) -> None:
        """Returns None; `slot` may be handed out again."""
        with self._lock:
            self._free.append(slot)


_SLOTS = _Slots()  # process-wide: two Sandbox objects never run under one uid at the same time


def slot_uid(slot: int) -> int:
    """Returns the uid a program in `slot` runs as when cohort runs as root: this process's block of 4096 uids
    (by process id, so processes on one machine rarely collide) from SLOT_UID_BASE."""
    return SLOT_UID_BASE + (os.getpid() % 4096) * 4096 + slot % 4096


class Sandbox:
    """Runs Python programs isolated under bubblewrap with resource limits (module docstring).

    Args:
        limits: the default limits of every run (`Limits`); `run`'s `timeout` / `memory_mb` override per run.
        python: the interpreter to run (a path or a name on PATH); None: the one running cohort, without its
            site-packages.
        site_packages: also mount the interpreter's installed packages (read-only) and put them on sys.path
            (``.pth`` files are not read, so editable installs are not seen).
        paths: further host folders to mount read-only and put on sys.path (e.g. helper modules).
        concurrency: how many programs run at once (`run_many`, and calls from several threads); None: the
            number of cores this process may use.
        unsafe: run without isolation (resource limits only). Any program can then read and write what cohort
            can, use the network and, as root, start any number of processes.
        bwrap: the bubblewrap binary (None: ``bwrap`` on PATH).
    """

    def __init__(
        self,
        *,
        limits: Limits | None = None,
        python: str | None = None,
        site_packages: bool = False,
        paths: Sequence[str] = (),
        concurrency: int | None = None,
        unsafe: bool = False,
        bwrap: str | None = None,
    ):
        if concurrency is not None and (not isinstance(concurrency, int) or concurrency < 1):
            raise ValueError(
                f"sandbox concurrency={concurrency!r} must be a positive integer (or None: the cores)"
            )
        self.limits = limits or Limits()
        self.interpreter = inspect_interpreter(python)
        extra = [os.path.realpath(p) for p in paths]
        missing = [p for p in extra if not os.path.isdir(p)]
        if missing:
            raise ValueError(f"sandbox paths {missing} are not folders; give existing folders to mount")
        closed = [p for p in extra if os.stat(p).st_mode & 0o005 != 0o005]
        if closed and os.geteuid() == 0 and not unsafe:
            raise ValueError(
                f"sandbox path {closed[0]!r} is not readable by other users (mode "
                f"{oct(os.stat(closed[0]).st_mode & 0o777)}), and programs run as an unprivileged uid when cohort "
                "runs as root; make it readable (chmod o+rx) or mount another folder"
            )
        if site_packages:
            extra = [*self.interpreter.site_packages, *extra]
        self.python_path = tuple(dict.fromkeys(extra))
        self.concurrency = concurrency or default_concurrency()
        self._gate = threading.BoundedSemaphore(self.concurrency)
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        if unsafe:
            self.isolation = Isolation("unsafe", self.interpreter)
            message = (
                "cohort sandbox in UNSAFE mode: programs run WITHOUT isolation, under resource limits only; they can "
                "read and write every file cohort can, reach the network, and see this machine's processes"
            )
            logger.warning(message)
            warnings.warn(message, UnsafeSandboxWarning, stacklevel=2)
        else:
            self.isolation = self._choose(bwrap)

    @property
    def kind(self) -> str:
        """Returns how programs are isolated: ``userns``, ``root``, ``drop`` or ``unsafe`` (bwrap.py)."""
        return self.isolation.kind

    def _choose(self, bwrap: str | None) -> Isolation:
        """Returns the first isolation that runs a test program correctly, or raises SandboxUnavailable."""
        found, why = candidates(self.interpreter, self.python_path, bwrap=bwrap)
        failures = [why] if why else []
        for isolation in found:
            if isolation.kind == "drop":
                hidden = unreadable_by_others([self.interpreter.executable, *self.python_path])
                if hidden:
                    failures.append(
                        f"{isolation.kind}: the interpreter or a mounted folder is inside {hidden[0]!r}, which an "
                        "unprivileged uid cannot enter; use an interpreter outside it (python=/usr/bin/python3) "
                        "or let root use privileged bubblewrap (CAP_SYS_ADMIN)"
                    )
                    continue
            try:
                result = self._execute(
                    isolation, "import sys; print(6 * 7, sys.hexversion)", "", self.limits, None, 0
                )
            except SandboxError as exc:
                failures.append(f"{isolation.kind}: {exc}")
                continue
            if result.ok and result.stdout.split() == ["42", str(self.interpreter.version)]:
                return isolation
            if result.ok:  # it started another Python: the interpreter's own library is out of reach
                failures.append(
                    f"{isolation.kind}: the interpreter started as another Python ({result.stdout.strip()!r}); its "
                    "shared library is in a folder the sandbox does not mount"
                )
                continue
            failures.append(
                f"{isolation.kind}: a test program ended {result.status}: {result.stderr.strip()[:500]}"
            )
        reasons = "; ".join(failures) or "no isolation applies"
        raise SandboxUnavailable(
            f"cannot isolate programs on this machine ({reasons}). To fix: {INSTALL_HELP}"
        )

    @contextmanager
    def _slot(self) -> Iterator[int]:
        """Yields a slot for one run, waiting while `concurrency` runs are under way."""
        with self._gate:
            slot = _SLOTS.take()
            try:
                yield slot
            finally:
                _SLOTS.give(slot)

    def run(
        self,
        code: str,
        *,
        stdin: str = "",
        timeout: float | None = None,
        memory_mb: int | None = None,
        tests: Sequence[str] | None = None,
    ) -> ExecResult:
        """Returns how `code` ended (an ExecResult); never raises for anything the program does.

        `stdin` is the program's standard input; `timeout` (wall-clock seconds) and `memory_mb` override the
        sandbox's limits for this run. `tests`: Python statements (``assert f(1) == 2``) run one by one after
        the program, in its namespace; each one's outcome is in ``ExecResult.tests``.
        Raises SandboxError only when the sandbox itself fails (not the program).
        """
        if not isinstance(code, str):
            raise TypeError(f"sandbox run: code must be a str, got {type(code).__name__}")
        if isinstance(tests, str):  # one test, as the code reward reads a string (not one per character)
            tests = [tests]
        limits = self.limits.with_(timeout=timeout, memory_mb=memory_mb)
        with self._slot() as slot:
            return self._execute(self.isolation, code, stdin, limits, tests, slot)

    def _execute(
        self,
        isolation: Isolation,
        code: str,
        stdin: str,
        limits: Limits,
        tests: Sequence[str] | None,
        slot: int,
    ) -> ExecResult:
        """Returns the result of one run of `code` under `isolation` in `slot`."""
        tag = new_tag()
        data = payload(code, tag=tag, tests=tests, mode="run", path=self.python_path)
        data += stdin.encode("utf-8", "surrogateescape")
        with self._started(isolation, limits, slot) as process:
            try:
                process.pump(
                    data, close_stdin=True, deadline=process.started + limits.timeout, cap=limits.output_bytes
                )
            except BaseException:  # an interrupt (Ctrl-C) in cohort: the program must not outlive the call
                process.kill("closed")
                process.finish()
                raise
            returncode, signal_number = process.finish()
        return _result(process, tag, returncode, signal_number, tests is not None)

    @contextmanager
    def _started(self, isolation: Isolation, limits: Limits, slot: int) -> Iterator[SandboxProcess]:
        """Yields a started sandbox process (in a fresh working folder when unsafe, removed afterwards)."""
        argv, extra = isolation.command(limits, slot_uid(slot))
        env = isolation.environment
        workdir = None
        if isolation.kind == "unsafe":
            workdir = tempfile.mkdtemp(prefix="cohort-sandbox-")
            env.update(HOME=workdir, TMPDIR=workdir)
        try:
            yield SandboxProcess.start(argv, env, workdir, extra, info=isolation.kind != "unsafe")
        finally:
            if workdir is not None:
                shutil.rmtree(workdir, ignore_errors=True)

    def submit(self, code: str, **kwargs) -> concurrent.futures.Future[ExecResult]:
        """Returns a Future of ``run(code, **kwargs)`` run in the sandbox's pool (at most `concurrency` at once),
        so the caller can do other work meanwhile."""
        return self._executor().submit(self.run, code, **kwargs)

    def run_many(self, jobs: Sequence[Job]) -> list[ExecResult]:
        """Returns the results of `jobs`, in order, run `concurrency` at a time."""
        futures = [
            self.submit(j.code, stdin=j.stdin, tests=j.tests, timeout=j.timeout, memory_mb=j.memory_mb)
            for j in jobs
        ]
        return [f.result() for f in futures]

    def _executor(self) -> concurrent.futures.ThreadPoolExecutor:
        """Returns the thread pool that runs submitted programs (created on first use)."""
        with self._pool_lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    max_workers=self.concurrency, thread_name_prefix="cohort-sandbox"
                )
            return self._pool

    def session(self, *, timeout: float | None = None, memory_mb: int | None = None) -> Session:
        """Returns a new Session: one sandboxed interpreter whose variables persist from one call to the next."""
        return Session(self, self.limits.with_(timeout=timeout, memory_mb=memory_mb))

    def close(self) -> None:
        """Returns None after the pool's threads have finished their work."""
        with self._pool_lock:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None


def _result(
    process: SandboxProcess, tag: str, returncode: int | None, signal_number: int | None, with_tests: bool
) -> ExecResult:
    """Returns the ExecResult of a finished process, or raises SandboxError when the sandbox failed to start."""
    out = parse_report(process.stdout.decode("utf-8", "replace"), tag)
    err = parse_report(process.stderr.decode("utf-8", "replace"), tag)
    if process.killed_for is None and returncode != 0:
        if process.bwrap and process.child_pid is None:
            raise SandboxError(f"bubblewrap could not set up the sandbox: {err.text.strip()[:1000]}")
        if returncode == _NO_PAYLOAD and not out.text and out.error is None:
            raise SandboxError(
                f"the sandboxed interpreter did not receive its program: {err.text.strip()[:1000]}"
            )
    status = classify(
        reason=process.killed_for, returncode=returncode, signal_number=signal_number, error=out.error
    )
    return ExecResult(
        status=status,
        returncode=-signal_number if signal_number is not None else returncode,
        stdout=out.text,
        stderr=err.text,
        seconds=process.seconds,
        truncated=process.dropped > 0,
        error=out.error,
        tests=out.tests if with_tests else None,
    )


class Session:
    """One sandboxed interpreter kept alive between calls, so that variables, imports and files persist.

    Each :meth:`run` executes a cell in the same namespace (like a notebook), under the wall-clock `timeout`
    per call; the memory, process and file limits hold for the whole session, and its CPU seconds are a budget
    for the session (300 s unless ``limits.cpu_seconds`` says otherwise). A cell that times out, crashes the
    interpreter or ends it (``os._exit``) ends the session: its state is lost, the result says so, and the next
    call starts a fresh one. Cells get an empty stdin. Close the session (or use it as a context manager) to
    end the process; it also ends when cohort does. A session holds its own uid slot and does not count against
    the sandbox's `concurrency` (which bounds one-off runs). Sessions need isolation (not ``unsafe``).
    """

    def __init__(self, sandbox: Sandbox, limits: Limits):
        self.sandbox = sandbox
        self.limits = limits
        self._process: SandboxProcess | None = None
        self._slot: int | None = None
        self._lock = threading.Lock()
        self.restarts = 0
        """How many times the session ended (a timeout, a crash, an exit) and lost its state."""

    def _start(self) -> SandboxProcess:
        """Returns the session's process, started with an empty namespace."""
        isolation = self.sandbox.isolation
        if isolation.kind == "unsafe":
            raise SandboxError("sessions need isolation: an unsafe sandbox runs one program per call only")
        if self._slot is None:
            self._slot = _SLOTS.take()
        cpu = self.limits.cpu_seconds or _SESSION_CPU_SECONDS
        limits = self.limits.with_(cpu_seconds=cpu)
        argv, extra = isolation.command(limits, slot_uid(self._slot))
        process = SandboxProcess.start(argv, isolation.environment, None, extra, info=True)
        self._tag = new_tag()
        opening = payload("", tag=self._tag, tests=None, mode="session", path=self.sandbox.python_path)
        process.pump(
            opening,
            close_stdin=False,
            deadline=process.started + 30,
            cap=limits.output_bytes,
            until=lambda: True,
        )
        return process

    def run(self, code: str, *, timeout: float | None = None) -> ExecResult:
        """Returns how the cell `code` ended; its stdout and stderr are the cell's alone. Never raises for what
        the cell does (a dead session is restarted by the next call)."""
        if not isinstance(code, str):
            raise TypeError(f"session run: code must be a str, got {type(code).__name__}")
        with self._lock:
            if self._process is None:
                self._process = self._start()
            process = self._process
            process.stdout.clear()
            process.stderr.clear()
            process.dropped = 0
            done = "\n" + self._tag + " done\n"
            done_bytes = done.encode()

            def finished() -> bool:
                return process.stdout.endswith(done_bytes) and process.stderr.endswith(done_bytes)

            limit = self.limits.timeout if timeout is None else timeout
            started = process.seconds
            process.pump(
                frame({"code": code}),
                close_stdin=False,
                deadline=time.perf_counter() + limit,
                cap=self.limits.output_bytes,
                until=finished,
            )
            if finished() and process.killed_for is None:
                out = parse_report(process.stdout.decode("utf-8", "replace"), self._tag)
                err = parse_report(process.stderr.decode("utf-8", "replace"), self._tag)
                status = "memory" if out.error == "MemoryError" else "error" if out.error else "ok"
                return ExecResult(
                    status=status,
                    returncode=None if out.error is None else 1,
                    stdout=out.text,
                    stderr=err.text,
                    seconds=process.seconds - started,
                    error=out.error,
                )
            # The cell ended the interpreter, ran past its time or its output cap: the session is over.
            if process.killed_for is None:
                process.kill("closed")
            returncode, signal_number = process.finish()
            self._process = None
            self.restarts += 1
            result = _result(process, self._tag, returncode, signal_number, False)
            return dataclasses.replace(result, seconds=process.seconds - started)

    def close(self) -> None:
        """Returns None once the session's interpreter has ended (its state is gone)."""
        with self._lock:
            if self._process is not None:
                self._process.kill("closed")
                self._process.finish()
                self._process = None
            if self._slot is not None:
                _SLOTS.give(self._slot)
                self._slot = None

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
