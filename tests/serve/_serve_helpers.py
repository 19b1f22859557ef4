"""Shared helpers of the rollout-worker tests: a tiny run's config, worker processes started and always ended."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import IO

# a tiny 3-step run's config (dotted keys override it), as the trainer tests build it
from test_trainer import _cfg as run_config  # noqa: F401

from cohort.serve.worker import READY


@contextlib.contextmanager
def serving(
    model_dir,
    *extra: str,
    timeout: float = 60.0,
    stderr: IO[str] | None = None,
    entry: tuple[str, ...] = ("-m", "cohort"),
) -> Iterator[tuple[str, subprocess.Popen]]:
    """Yields (host:port, process) of a `cohort serve` on 127.0.0.1 and a free port (its standard error to
    `stderr` when given; `entry`: what runs the command line, after the interpreter); SIGKILLs it on exit."""
    proc = subprocess.Popen(
        [sys.executable, *entry, "serve", "--model", str(model_dir), "--port", "0", *extra],
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    try:
        deadline = time.monotonic() + timeout
        assert proc.stdout is not None
        while True:
            line = proc.stdout.readline()
            if line.startswith(READY):
                break
            assert line and time.monotonic() < deadline, f"the worker did not start (exit {proc.poll()})"
        yield line[len(READY) :].split()[0].removeprefix("tcp://"), proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        proc.stdout.close()  # type: ignore[union-attr]


def alive(pid: int) -> bool:
    """Returns whether a process with this pid exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
