"""Resource limits of one sandboxed execution, with the defaults the code reward and the tool run under.

The limits are set with ``setrlimit`` inside the sandbox, by the launcher (``launcher.py``), after the
interpreter has started and before the program's first line: CPU seconds, address space, processes (threads
count), open files, file size and core dumps. The wall clock, the output and the size of the writable
``/tmp`` are enforced from outside (``process.py`` and bubblewrap's ``--size``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

__all__ = ["Limits"]


@dataclass(frozen=True)
class Limits:
    """What one execution may use; each field's default is what `cohort.sandbox.run` applies."""

    timeout: float = 5.0
    """Wall-clock seconds from start to the end of the program, start-up (~20-40 ms) included; then the whole
    sandbox is killed and the status is ``timeout``."""
    memory_mb: int = 512
    """Address space in MiB (``RLIMIT_AS``): an allocation beyond it fails (``MemoryError``, status ``memory``).
    Threads' stacks and mapped libraries count; the interpreter alone maps about 20 MiB."""
    cpu_seconds: int | None = None
    """CPU seconds (``RLIMIT_CPU``; SIGXCPU, status ``timeout``); None: ``ceil(timeout) + 1``, a backstop for
    programs whose threads burn CPU faster than the wall clock runs."""
    processes: int = 32
    """Processes and threads the program may have at once (``RLIMIT_NPROC``, counted under its own uid)."""
    open_files: int = 64
    """Open file descriptors (``RLIMIT_NOFILE``)."""
    file_mb: int = 16
    """Largest file the program may write, in MiB (``RLIMIT_FSIZE``; a bigger write fails with EFBIG)."""
    tmp_mb: int = 64
    """Size of the sandbox's only writable place, its private ``/tmp`` (a tmpfs, in memory), in MiB."""
    output_bytes: int = 1 << 20
    """Bytes of stdout and stderr together read back; more and the program is killed (status
    ``output_limit``), keeping what was read up to the cap."""

    def __post_init__(self) -> None:
        checks = {
            "timeout": isinstance(self.timeout, (int, float))
            and not isinstance(self.timeout, bool)
            and self.timeout > 0
            and math.isfinite(self.timeout),
            "memory_mb": isinstance(self.memory_mb, int) and self.memory_mb >= 32,
            "cpu_seconds": self.cpu_seconds is None
            or (isinstance(self.cpu_seconds, int) and self.cpu_seconds >= 1),
            "processes": isinstance(self.processes, int) and self.processes >= 1,
            "open_files": isinstance(self.open_files, int) and self.open_files >= 16,
            "file_mb": isinstance(self.file_mb, int) and self.file_mb >= 1,
            "tmp_mb": isinstance(self.tmp_mb, int) and self.tmp_mb >= 1,
            "output_bytes": isinstance(self.output_bytes, int) and self.output_bytes >= 1024,
        }
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            name = bad[0]
            raise ValueError(
                f"sandbox limit {name}={getattr(self, name)!r} is out of range; timeout > 0 (seconds), "
                "memory_mb >= 32 (the interpreter needs ~20 MiB), cpu_seconds >= 1 or None, processes >= 1, "
                "open_files >= 16, file_mb >= 1, tmp_mb >= 1, output_bytes >= 1024"
            )

    @property
    def cpu(self) -> int:
        """Returns the CPU-seconds limit in force (``cpu_seconds``, or one second past the timeout)."""
        return self.cpu_seconds if self.cpu_seconds is not None else math.ceil(self.timeout) + 1

    def with_(self, **changes: object) -> Limits:
        """Returns a copy with the given fields changed (None values leave a field as it is)."""
        return replace(self, **{k: v for k, v in changes.items() if v is not None})  # type: ignore[arg-type]

    def rlimit_args(self) -> list[str]:
        """Returns the launcher's command-line limits: CPU seconds, address space, files, file size, processes."""
        return [
            str(self.cpu),
            str(self.memory_mb << 20),
            str(self.open_files),
            str(self.file_mb << 20),
            str(self.processes),
        ]
