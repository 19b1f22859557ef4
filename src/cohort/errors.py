"""Exceptions shared by modules that must not import each other (cohort.config and cohort.presets)."""

from __future__ import annotations


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


class UnsafeCheckpointError(TrainingError):
    """A checkpoint file holds something other than tensors and plain containers (pickled objects, which could
    run code when loaded): it is refused, never loaded. The message names the file and what it holds."""


class RunExistsError(ConfigError):
    """out_dir already holds a run and nothing said to continue it (resume=auto, or TRL's
    trainer.train(resume_from_checkpoint=True))."""
