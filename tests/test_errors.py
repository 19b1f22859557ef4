"""cohort.errors: the typed errors callers catch instead of matching message text."""

from __future__ import annotations

from cohort.errors import CheckpointMismatchError, TrainingError


def test_shapes_that_fit_give_no_error():
    shapes = {"a.weight": (4, 2), "a.bias": (4,)}
    assert CheckpointMismatchError.between(shapes, dict(shapes)) is None


def test_the_first_difference_is_named_with_the_count_of_the_others():
    found = {"a.weight": (4, 2), "b.weight": (3,), "extra": (1,)}
    expected = {"a.weight": (4, 3), "b.weight": (3,), "c.weight": (2,)}
    error = CheckpointMismatchError.between(found, expected)
    assert isinstance(error, TrainingError)
    assert str(error) == "a.weight is [4, 2] in the checkpoint and [4, 3] in the model (and 2 more)"
    missing = CheckpointMismatchError.between({"a": (1,)}, {"a": (1,), "b": (2,)})
    assert str(missing) == "b is not in the checkpoint"
    unexpected = CheckpointMismatchError.between({"a": (1,), "b": (2,)}, {"a": (1,)})
    assert str(unexpected) == "the checkpoint's b is not in the model"


def test_a_loader_that_takes_a_subset_ignores_names_only_one_side_has():
    found, expected = {"a": (1,), "extra": (5,)}, {"a": (1,), "missing": (2,)}
    assert CheckpointMismatchError.between(found, expected, missing_ok=True, unexpected_ok=True) is None
    assert str(CheckpointMismatchError.between(found, expected, unexpected_ok=True)) == (
        "missing is not in the checkpoint"
    )
    resized = CheckpointMismatchError.between({"a": (2,)}, {"a": (1,)}, missing_ok=True, unexpected_ok=True)
    assert str(resized) == "a is [2] in the checkpoint and [1] in the model"
