"""One sandboxed process from start to end: feed its stdin, read its output under a cap, stop it on time.

Output is read as it comes (never more than the cap plus one read is held); a program that writes past the
cap, or runs past its wall-clock limit, is killed with everything it started: under bubblewrap by killing
the sandbox's pid 1, which makes the kernel kill every process of the pid namespace and lets bubblewrap
exit only once they are gone, so when a run returns nothing it started is left. Without bubblewrap
(``unsafe``) the process group is killed, which a program can leave with ``setsid``.
"""

from __future__ import annotations

import os
import re
import select
import selectors
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["EXIT_STATUSES", "ExecResult", "SandboxError", "SandboxProcess", "classify"]

EXIT_STATUSES = ("ok", "error", "timeout", "memory", "output_limit", "killed")
"""How a run can end: ``ok`` (exit status 0), ``error`` (another exit status, e.g. an uncaught exception),
``timeout`` (wall clock or CPU seconds), ``memory`` (ended on MemoryError), ``output_limit`` (wrote more than
the cap), ``killed`` (ended by a signal: a crash such as a segmentation fault, or a kill)."""

_CHUNK = 1 << 16
_AFTER_EXIT = 2.0  # seconds to wait for the output pipes to close once the process has ended or been killed
_CHILD_PID = re.compile(rb'"child-pid"\s*:\s*(\d+)')


class SandboxError(RuntimeError):
    """The sandbox itself failed (not the program): bubblewrap could not set up, the interpreter did not start."""


@dataclass(frozen=True)
class ExecResult:
    """How one sandboxed program ended and what it printed."""

    status: str
    """One of EXIT_STATUSES."""
    returncode: int | None
    """The exit status; minus the signal number when a signal ended it (``-9``, ``-11``); None if unknown."""
    stdout: str
    """What it wrote to stdout, up to the output cap (decoded as UTF-8, invalid bytes replaced)."""
    stderr: str
    """What it wrote to stderr, up to the output cap."""
    seconds: float
    """Wall-clock seconds from start to end, start-up included."""
    truncated: bool = False
    """Whether output was cut at the cap (status ``output_limit``)."""
    error: str | None = None
    """The type name of the exception the program ended on (``SyntaxError``, ``MemoryError``, ...), if any."""
    tests: tuple[str, ...] | None = None
    """With assert tests: per test, as far as they ran, ``pass``, ``fail`` or ``error <Name>``."""

    @property
    def ok(self) -> bool:
        """Returns whether the program ended normally with exit status 0."""
        return self.status == "ok"


def classify(
    *, reason: str | None, returncode: int | None, signal_number: int | None, error: str | None
) -> str:
    """Returns the status of a run from why it was stopped (``timeout`` / ``output``), its exit and exception."""
    if reason == "output":
        return "output_limit"
    if reason == "timeout" or signal_number == signal.SIGXCPU:
        return "timeout"
    if signal_number is not None:
        return "killed"
    if returncode == 0:
        return "ok"
    if error == "MemoryError":
        return "memory"
    return "error"


@dataclass
class SandboxProcess:
    """A started sandbox process and the pipes to it (stdin, stdout, stderr, and bubblewrap's info pipe)."""

    proc: subprocess.Popen
    info_fd: int | None
    """Read end of bubblewrap's --info-fd pipe (which names the sandbox's pid 1), None without bubblewrap."""
    bwrap: bool
    started: float = field(default_factory=time.perf_counter)
    stdout: bytearray = field(default_factory=bytearray)
    stderr: bytearray = field(default_factory=bytearray)
    child_pid: int | None = None
    pidfd: int | None = None
    info: bytearray = field(default_factory=bytearray)
    killed_for: str | None = None
    dropped: int = 0
    """Output bytes read past the cap and thrown away."""

    @classmethod
    def start(
        cls, argv: list[str], env: dict[str, str], cwd: str | None, extra: dict, info: bool
    ) -> SandboxProcess:
        """Returns the process started from `argv` (with a pipe for bubblewrap's --info-fd when `info`)."""
        read_fd = write_fd = None
        if info:
            read_fd, write_fd = os.pipe()
            argv = [a if a != "{info}" else str(write_fd) for a in argv]
        try:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=env,
                cwd=cwd,
                close_fds=True,
                pass_fds=(write_fd,) if write_fd is not None else (),
                start_new_session=True,
                **extra,
            )
        except OSError as exc:
            if read_fd is not None:
                os.close(read_fd)
            raise SandboxError(f"could not start {argv[0]!r}: {exc}") from exc
        finally:
            if write_fd is not None:
                os.close(write_fd)
        return cls(proc, read_fd, info)

    def _read(self, fd: int, into: bytearray | None, cap: int) -> bool:
        """Returns False at end of file; appends what `fd` has to `into` while under `cap` bytes in all."""
        try:
            data = os.read(fd, _CHUNK)
        except BlockingIOError:
            return True
        except OSError:
            return False
        if not data:
            return False
        if into is None:  # bubblewrap's info pipe
            self.info += data
            if self.child_pid is None and (m := _CHILD_PID.search(self.info)):
                self._learn_child(int(m.group(1)))
            return True
        room = max(0, cap - len(self.stdout) - len(self.stderr))
        into += data[:room]
        if len(data) > room:
            self.dropped += len(data) - room
            if self.killed_for is None:
                self.kill("output")
        return True

    def pump(
        self,
        data: bytes,
        *,
        close_stdin: bool,
        deadline: float,
        cap: int,
        until: Callable[[], bool] | None = None,
    ) -> None:
        """Returns once the output pipes are closed (or `until()` is true): writes `data` to stdin, reads stdout
        and stderr under `cap` bytes, and kills the sandbox at `deadline` or when the cap is passed."""
        sel = selectors.DefaultSelector()
        proc = self.proc
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        outputs = {proc.stdout.fileno(): self.stdout, proc.stderr.fileno(): self.stderr}
        for fd in outputs:
            os.set_blocking(fd, False)
            sel.register(fd, selectors.EVENT_READ)
        if self.info_fd is not None:
            sel.register(self.info_fd, selectors.EVENT_READ)
        view = memoryview(data)
        stdin_fd = proc.stdin.fileno() if not proc.stdin.closed else None
        if stdin_fd is not None and (view or close_stdin):
            os.set_blocking(stdin_fd, False)
            sel.register(stdin_fd, selectors.EVENT_WRITE)
        ended_at: float | None = None
        try:
            while any(fd in outputs for fd in sel.get_map()):
                now = time.perf_counter()
                if until is not None and not view and until():
                    return
                if self.killed_for is None and now >= deadline:
                    self.kill("timeout")
                if ended_at is None and (self.killed_for is not None or proc.poll() is not None):
                    ended_at = now
                if ended_at is not None and now - ended_at > _AFTER_EXIT:
                    return  # a process outside our reach (unsafe mode) still holds the pipes: stop reading
                wait = max(0.0, deadline - now) if self.killed_for is None else 0.05
                for key, _ in sel.select(min(wait, 0.25)):
                    fd = key.fd
                    if fd == stdin_fd:
                        try:
                            sent = os.write(fd, view[:_CHUNK]) if view else 0
                            view = view[sent:]
                        except BlockingIOError:
                            continue
                        except OSError:  # the program closed stdin or ended: the rest is not wanted
                            view = view[len(view) :]
                        if not view:
                            sel.unregister(fd)
                            if close_stdin:
                                proc.stdin.close()
                            stdin_fd = None
                        continue
                    if not self._read(fd, outputs.get(fd), cap):
                        sel.unregister(fd)
                        if fd == self.info_fd:
                            os.close(fd)
                            self.info_fd = None
        finally:
            sel.close()
            if stdin_fd is not None and close_stdin:
                try:
                    proc.stdin.close()
                except OSError:
                    pass

    def kill(self, reason: str) -> None:
        """Kills the sandbox and everything in it; `reason` (``timeout``, ``output``, ``closed``) is kept."""
        if self.killed_for is None:
            self.killed_for = reason
        if self.proc.poll() is not None:
            return
        if self.bwrap and self.child_pid is None and self.info_fd is not None:
            self._drain_info()
        try:
            if self.bwrap and self.pidfd is not None:
                # The sandbox's pid 1: the kernel kills its whole pid namespace (`finish` waits for it to be empty).
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
            elif self.bwrap and self.child_pid is not None:
                os.kill(self.child_pid, signal.SIGKILL)
            else:
                os.killpg(self.proc.pid, signal.SIGKILL)
        except OSError:  # already gone
            pass

    def _learn_child(self, pid: int) -> None:
        """Returns None; keeps the sandbox's pid 1 and a pidfd of it, to wait for its namespace to be empty."""
        self.child_pid = pid
        try:
            self.pidfd = os.pidfd_open(pid)
        except (AttributeError, OSError):  # already gone (so is its namespace), or no pidfd on this system
            self.pidfd = None

    def _drain_info(self) -> None:
        """Reads whatever bubblewrap has written to its info pipe so far (to learn the sandbox's pid 1)."""
        assert self.info_fd is not None
        os.set_blocking(self.info_fd, False)
        while self.child_pid is None:
            try:
                data = os.read(self.info_fd, _CHUNK)
            except OSError:  # nothing more yet (BlockingIOError) or closed
                return
            if not data:
                return
            self.info += data
            if m := _CHILD_PID.search(self.info):
                self._learn_child(int(m.group(1)))

    def finish(self) -> tuple[int | None, int | None]:
        """Returns (exit status, ending signal) once the process has ended, killing it if it has not."""
        if self.info_fd is not None and self.child_pid is None:
            self._drain_info()
        try:
            code = self.proc.wait(timeout=_AFTER_EXIT)
        except subprocess.TimeoutExpired:
            self.kill(self.killed_for or "closed")
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            code = self.proc.wait()
        if self.pidfd is not None:
            # bubblewrap reports the program's exit status as soon as the program ends, before its pid 1 has
            # finished tearing down the pid namespace; the pid 1 ends only once every process in it is gone.
            poller = select.poll()
            poller.register(self.pidfd, select.POLLIN)
            if not poller.poll(_AFTER_EXIT * 1000):
                try:  # through the pidfd: the very process it was opened on, whatever became of its pid
                    signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
                except OSError:
                    pass
                poller.poll(_AFTER_EXIT * 1000)
            os.close(self.pidfd)
            self.pidfd = None
        for stream in (self.proc.stdout, self.proc.stderr, self.proc.stdin):
            if stream is not None and not stream.closed:
                stream.close()
        if self.info_fd is not None:
            os.close(self.info_fd)
            self.info_fd = None
        if not self.bwrap:
            try:  # what the program left in its process group (unsafe mode)
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if code < 0:
            return code, -code
        if self.bwrap and code > 128:  # bubblewrap reports a program ended by signal n as 128 + n
            return code, code - 128
        return code, None

    @property
    def seconds(self) -> float:
        """Returns the wall-clock seconds since the process started."""
        return time.perf_counter() - self.started
