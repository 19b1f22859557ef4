"""Exceptions shared by modules that must not import each other (cohort.config and cohort.config.presets)."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path


def first_line(exc: BaseException) -> str:
    """Returns the first line of an exception's message (its type's name when the message is empty)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the key, the value and the fix."""


class ConfigWarning(UserWarning):
    """A configuration value is accepted but changes nothing in this configuration; the message says why."""


class TrainingError(RuntimeError):
    """Training cannot go on (a non-finite loss, gradient or weight; a run directory in use; a checkpoint that
    does not fit the config). The message names the step or the file, the likely cause and the fix."""


class ReportedElsewhere(TrainingError):
    """Raised on the processes of a group other than the one that reports a failure they share, so the run prints
    it once (`cohort` exits with code 1 and prints nothing for this one)."""


class NonFiniteError(TrainingError):
    """A loss, gradient, logit or weight is NaN or infinite; the weights were not updated by it. The message
    names the quantity, the step where known and the usual causes (learning rate, half precision, clipping)."""


class CheckpointMismatchError(TrainingError):
    """A checkpoint's tensors do not fit the model it is loaded into (tensors missing, unexpected or of other
    shapes: it was written for another model). The message names the first tensor that differs."""

    @classmethod
    def between(
        cls,
        found: Mapping[str, Sequence[int]],
        expected: Mapping[str, Sequence[int]],
        *,
        missing_ok: bool = False,
        unexpected_ok: bool = False,
    ) -> CheckpointMismatchError | None:
        """Returns the error for a checkpoint whose tensor shapes `found` do not fit the model's `expected`, by
        name; None when they fit.

        missing_ok: the model's tensors the checkpoint lacks are left as they are (a loader that takes a
        subset, as peft's); unexpected_ok: the checkpoint's tensors the model lacks are not read."""
        differ = [
            f"{key} is {list(found[key])} in the checkpoint and {list(shape)} in the model"
            if key in found
            else f"{key} is not in the checkpoint"
            for key, shape in expected.items()
            if (key in found and tuple(found[key]) != tuple(shape)) or (key not in found and not missing_ok)
        ]
        if not unexpected_ok:
            differ += [f"the checkpoint's {key} is not in the model" for key in found if key not in expected]
        if not differ:
            return None
        return cls(differ[0] + (f" (and {len(differ) - 1} more)" if len(differ) > 1 else ""))


class NonFiniteSamplingError(RuntimeError):
    """A rollout engine met NaN or infinite sampling probabilities (non-finite logits, as half-precision overflow
    gives); the message is torch's refusal. A RuntimeError, as torch's own error (which has no type) was."""


class UnsafeCheckpointError(TrainingError):
    """A checkpoint file holds something other than tensors and plain containers (pickled objects, which could
    run code when loaded): it is refused, never loaded. The message names the file and what it holds."""


class RunExistsError(ConfigError):
    """out_dir already holds a run and nothing said to continue it (resume=auto, or TRL's
    trainer.train(resume_from_checkpoint=True))."""


class DiskFullError(OSError):
    """A write failed for lack of space (errno ENOSPC); the message names the folder, the space left and the fix."""

    def __init__(self, message: str) -> None:
        super().__init__(errno.ENOSPC, message)
        self.message = message

    def __str__(self) -> str:
        return self.message


_NO_SPACE_TEXT = (
    "no space left",
    "os error 28",
    "code: 28",
    "storagefull",
    "errno 28",
    "disk quota exceeded",
)
"""How libraries that raise their own types (safetensors, tokenizers) say a write found the disk full."""

_SHORT_WRITE_TEXT = ("unexpected pos", "pytorchstreamwriter failed writing", "file write failed")
"""torch.save's zip writer's words for a short write, which says no more (a full disk, nearly always)."""

LOW_SPACE = 64 * 2**20
"""Free bytes under which a short write is taken for a full disk."""


def free_bytes(folder: str | os.PathLike) -> int | None:
    """Returns the bytes free to this user on the disk holding `folder` (or its nearest existing parent); None
    when it cannot be read."""
    path = Path(folder).absolute()
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    try:
        return shutil.disk_usage(existing or Path.cwd()).free
    except OSError:
        return None


def is_disk_full(exc: BaseException, folder: str | os.PathLike | None = None) -> bool:
    """Returns whether `exc`, or an error it wraps, is a write refused for lack of space: ENOSPC or EDQUOT, a
    library's text for it, or torch's short write while `folder`'s disk has under LOW_SPACE free."""
    seen: list[BaseException] = []
    todo: list[BaseException] = [exc]
    while todo:
        e = todo.pop()
        if e in seen:
            continue
        seen.append(e)
        # DCP's CheckpointException holds each process's failure in `failures`
        todo += [c for c in (e.__cause__, e.__context__) if c is not None]
        todo += [
            getattr(f, "exception", f)
            for f in getattr(e, "failures", {}).values()
            if isinstance(getattr(f, "exception", f), BaseException)
        ]
    for e in seen:
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(e).lower()
        if any(t in text for t in _NO_SPACE_TEXT):
            return True
        if folder is not None and any(t in text for t in _SHORT_WRITE_TEXT):
            free = free_bytes(folder)
            if free is not None and free < LOW_SPACE:
                return True
    return False


def free_text(folder: str | os.PathLike) -> str:
    """Returns the space free on `folder`'s disk as MiB text ("? MiB" when it cannot be read)."""
    free = free_bytes(folder)
    return "? MiB" if free is None else f"{free / 2**20:.1f} MiB"


def disk_full_error(folder: str | os.PathLike, what: str, fix: str) -> DiskFullError:
    """Returns the one error a full disk raises: the folder, what was being written, the space left, the fix."""
    return DiskFullError(
        f"no space left on the disk holding {folder} ({free_text(folder)} free) while writing {what}: {fix}"
    )


@contextlib.contextmanager
def disk_full_named(
    folder: str | os.PathLike,
    what: str,
    fix: str = "free some space there or choose another folder; what was written before is intact",
) -> Iterator[None]:
    """Yields; a write inside that fails for lack of space becomes DiskFullError naming `folder`, `what` and
    `fix` (any other error, and a DiskFullError already named, passes through)."""
    try:
        yield
    except DiskFullError:
        raise
    except Exception as e:  # noqa: BLE001 - libraries raise their own types for a full disk
        if not is_disk_full(e, folder):
            raise
        raise disk_full_error(folder, what, fix) from None
