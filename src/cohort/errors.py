"""Exceptions shared by modules that must not import each other (cohort.config and cohort.presets)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence


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
