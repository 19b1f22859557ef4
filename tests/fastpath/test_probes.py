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


def test_a_check_under_bf16_autocast_is_judged_at_bf16_rounding_and_gradients_at_their_own_scale():
    """The compiled update's backward is checked under the caller's autocast: at the float32 weights' 1e-3 a
    bf16 check refused compiling for rounding alone (inductor keeps fused chains in float32, eager rounds)."""
    model = torch.nn.Linear(2, 2)
    assert probes.tolerance(model) == 1e-3
    assert probes.tolerance(model, torch.bfloat16) == 5e-2
    assert (
        probes.tolerance(torch.nn.Linear(2, 2).bfloat16(), torch.float32) == 5e-2
    )  # never finer than the weights
    grads = (torch.full((3,), 400.0), torch.full((2,), 1e-3))
    rounded = (grads[0] + 0.3, grads[1] + 5e-4)  # bf16 rounding at 400 is 2 units: 0.3 is well inside it
    assert not probes.allclose(rounded, grads, 1e-3) and probes.scaled_close(rounded, grads, 1e-3)
    assert not probes.scaled_close((grads[0] * 1.1, grads[1]), grads, 5e-2)  # a 10% change is no rounding
    assert probes.probe(
        model, "bf16 check", lambda: torch.ones(2), lambda: torch.ones(2) + 0.01, compute=torch.bfloat16
    )
    assert not probes.probe(model, "fp32 check", lambda: torch.ones(2), lambda: torch.ones(2) + 0.01)
