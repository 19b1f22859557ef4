"""The run directory: one run at a time (a lock), and logs that match the checkpoint a run resumes from.

- `RunLock`: an exclusive `fcntl` lock on `RUN_DIR/.lock`, which holds the owner's pid, host and start
  time. The kernel drops the lock when its process dies, however it dies, so a lock file left behind by
  a crash is recognised as stale and taken over; a live owner makes a second run refuse, naming it.
- `trim_logs`: on resume, every row logged after the checkpoint's step is removed from metrics.jsonl,
  samples.jsonl and evals.jsonl (the killed attempt's rows would otherwise appear twice), and a torn last
  line (a kill in the middle of a write) is dropped so it cannot swallow the next row.
- `config_changes`: what differs between the config a checkpoint was trained with and the current one,
  beyond the keys that may change between attempts (`RESUMABLE_CHANGES`).
- `StopSignals`: SIGINT / SIGTERM handling that never leaves a half-finished step behind.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

LOG_FILES = ("metrics", "samples", "evals", "health")
"""The JSONL logs of a run (RUN_DIR/<name>.jsonl), one object per line, each with a "step"."""


class RunLockedError(RuntimeError):
    """Another live process is training in this run directory."""


class RunLock:
    """An exclusive lock on a run directory, held from `acquire()` until `release()` or process exit."""

    def __init__(self, run_dir: str | Path) -> None:
        self.path = Path(run_dir) / ".lock"
        self._fd: int | None = None

    def acquire(self) -> RunLock:
        """Returns self once the lock is held; raises RunLockedError naming the live owner otherwise."""
        try:
            import fcntl
        except ImportError:  # not a POSIX system: no lock, as before
            return self
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            owner = self._read_owner()
            os.close(fd)
            raise RunLockedError(
                f"run directory {str(self.path.parent)!r} is in use by another cohort run ({owner}); wait for it "
                "to finish, stop it, or choose another out_dir"
            ) from None
        os.ftruncate(fd, 0)
        os.write(
            fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}).encode()
        )
        self._fd = fd
        return self

    def _read_owner(self) -> str:
        try:
            info = json.loads(self.path.read_text() or "{}")
        except (OSError, ValueError):
            return "owner unknown"
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.get("since", 0)))
        return f"pid {info.get('pid', '?')} on {info.get('host', '?')}, started {since}"

    def release(self) -> None:
        """Returns None after releasing the lock (a no-op when it is not held)."""
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def trim_logs(run_dir: str | Path, step: int) -> dict[str, int]:
    """Returns {log name: rows removed} after cutting each log back to the rows of steps <= `step`.

    A last line without its newline (torn by a kill) is removed too. Rows are never reordered; each file is
    rewritten through a temporary file and renamed, so a kill during the trim loses nothing.
    """
    removed: dict[str, int] = {}
    for name in LOG_FILES:
        path = Path(run_dir) / f"{name}.jsonl"
        if not path.is_file():
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        lines = text.split("\n")
        torn = lines.pop() if lines else ""  # "" when the file ends with a newline
        kept, dropped = [], int(bool(torn))
        for line in lines:
            try:
                row = json.loads(line)
                keep = int(row.get("step", 0)) <= step
            except (ValueError, TypeError, AttributeError):
                keep = False  # a corrupted line is not a row of the run
            if keep:
                kept.append(line)
            else:
                dropped += 1
        if dropped:
            tmp = path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
            tmp.replace(path)
        removed[name] = dropped
    return removed


def logged_rows(run_dir: str | Path) -> int:
    """Returns how many rows RUN_DIR's logs hold together (a run killed before its first step has its first
    evaluation's)."""
    return sum(_rows_in(Path(run_dir) / f"{name}.jsonl") for name in LOG_FILES)


def logged_steps(run_dir: str | Path) -> int:
    """Returns how many rows RUN_DIR/metrics.jsonl holds (0 when there is none)."""
    return _rows_in(Path(run_dir) / "metrics.jsonl")


def _rows_in(path: Path) -> int:
    """Returns how many non-blank lines the JSONL file `path` holds (0 when there is none)."""
    if not path.is_file():
        return 0
    with open(path, encoding="utf-8", errors="replace") as f:
        return sum(1 for line in f if line.strip())


class StopSignals:
    """SIGINT / SIGTERM as KeyboardInterrupt, except inside `committing()`, where they wait for its end.

    A step prepares (draws prompts, samples, scores), then commits (updates the weights, logs, saves). An
    interrupt while preparing leaves nothing half-done: the trainer rewinds to the step's start and saves
    that. An interrupt while committing is held until the commit ends, so the saved state is that of a
    finished step; a second one while committing is obeyed at once, and the run then saves nothing (the
    weights may be half-updated) and keeps its last checkpoint.
    """

    def __init__(self, *, defer: bool = False) -> None:
        """defer: hold the first signal wherever it arrives (several processes stop together at a step boundary,
        where the trainer checks `pending`); a second one is still obeyed at once."""
        self.defer = defer
        self.pending: int | None = None
        self.received: int | None = None
        """The last signal received (SIGINT or SIGTERM): the exit status says which (128 + its number)."""
        self._committing = False
        self.torn = False
        """True when an interrupt cut a commit short: the in-memory state is not a step boundary."""
        self._old: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        import signal

        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: signals stay as they are
                break
        return self

    def __exit__(self, *exc) -> None:
        import signal

        for sig, old in self._old.items():
            signal.signal(sig, old)  # type: ignore[arg-type]
        self._old.clear()

    def _handle(self, signum, frame) -> None:
        self.received = signum
        if (self._committing or self.defer) and self.pending is None:
            self.pending = signum
            return
        if self._committing:
            self.torn = True
        raise KeyboardInterrupt

    def hold(self) -> None:
        """Holds interrupts from now until the end of the next `committing()` block (a commit that begins in one
        function and ends in its caller)."""
        self._committing = True

    def committing(self):
        """Returns a context manager inside which an interrupt waits until the block ends."""
        import contextlib

        @contextlib.contextmanager
        def block():
            self._committing = True
            try:
                yield
            finally:
                self._committing = False

        return block()


RESUMABLE_CHANGES = (
    "steps",
    "resume",
    "allow_config_change",
    "progress",
    "save_every",
    "keep_checkpoints",
    "eval_every",
    "eval_at_ends",
    "eval_limit",
    "eval_k",
    "eval_batch_size",
    "num_samples_logged",
    "tensorboard",
    "wandb",
    "wandb_project",
    "threads",
    "logging_steps",
    "out_dir",
    "fast.",
    "health.",  # thresholds of warnings (an older run's logprob_gap_max 1e-3 resumes under today's null)
    "distributed.strategy",
    "distributed.backend",
    "distributed.load",
    "rollout.push_bucket_mib",
)
"""Config keys that may differ between a run and its resumption (prefixes end with a dot): they change
how a run is watched, saved or sped up, not what it computes."""


def config_changes(
    saved: dict[str, Any],
    current: dict[str, Any],
    prefix: str = "",
    resumable: tuple[str, ...] = RESUMABLE_CHANGES,
) -> list[tuple[str, Any, Any]]:
    """Returns (dotted key, saved value, current value) for every key outside `resumable` that differs.

    `resumable`: keys (prefixes end with a dot) that may change between attempts; a training run's by default."""
    out: list[tuple[str, Any, Any]] = []
    for key in sorted(set(saved) | set(current)):
        name = prefix + key
        if name in resumable or any(p.endswith(".") and name.startswith(p) for p in resumable):
            continue
        a, b = saved.get(key), current.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += config_changes(a, b, name + ".", resumable)
        elif a != b:
            out.append((name, a, b))
    if not prefix:
        # Derived, not chosen: distributed.global_batch_size sets the per-process rollout.batch_size from the
        # process count, so the same global batch resumed on another count is the same run.
        total = (saved.get("distributed") or {}).get("global_batch_size")
        if total is not None and total == (current.get("distributed") or {}).get("global_batch_size"):
            out = [c for c in out if c[0] != "rollout.batch_size"]
    return out


def logged_eval(run_dir: Path, step: int) -> bool:
    """Returns whether RUN_DIR/evals.jsonl holds a row of `step`."""
    return eval_row(run_dir, step) is not None


def eval_row(run_dir: Path, step: int) -> dict | None:
    """Returns RUN_DIR/evals.jsonl's (first) row of `step`, None when it holds none."""
    path = run_dir / "evals.jsonl"
    if not path.is_file():
        return None
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            row = json.loads(line)
            if row.get("step") == step:
                return row
        except (ValueError, AttributeError):
            continue
    return None
