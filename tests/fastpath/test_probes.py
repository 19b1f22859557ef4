"""Once-per-model checks: a check that raises falls back like one that disagrees, and says what it raised."""

import warnings

import torch

from cohort.fastpath import probes


def test_a_check_that_raises_fails_and_its_reason_names_the_exception():
    model = torch.nn.Linear(2, 2)

    def fast():
        # What a library change looks like from inside a check: a deprecation turned into an error.
        warnings.warn("`past_key_values` is deprecated", FutureWarning, stacklevel=1)
        return torch.zeros(2)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert probes.probe(model, "raises", fast, lambda: torch.zeros(2)) is False
    assert probes.results(model) == {"raises": False}
    reason = probes.failure(model, "raises", "the fast path does not reproduce it")
    assert "FutureWarning" in reason and "past_key_values" in reason, reason


def test_a_check_that_disagrees_says_only_that():
    model = torch.nn.Linear(2, 2)
    assert probes.probe(model, "differs", lambda: torch.ones(2), lambda: torch.zeros(2)) is False
    assert probes.failure(model, "differs", "no match") == "no match (checked once per model)"
    assert probes.probe(model, "agrees", lambda: torch.ones(2), lambda: torch.ones(2)) is True
