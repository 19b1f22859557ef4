"""Sampling semantics: the engines draw from softmax(filter(logits / T)), as transformers defines it."""

from __future__ import annotations

import math

import pytest
import torch
from _tiny import VOCAB, make_test_engine

from cohort.fastpath import FastConfig
from cohort.rollout import SamplingParams, draw, filter_logits

PROMPT = [5, 17, 3, 22, 9]
N_SAMPLES = 4000


def reference_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Loop reference of transformers' warpers: temperature, then top-k, then top-p; returns probs [V]."""
    scaled = (logits.double() / temperature).tolist()
    order = sorted(range(len(scaled)), key=lambda i: -scaled[i])
    keep = set(order[:top_k] if top_k > 0 else order)
    z = sum(math.exp(scaled[i]) for i in keep)
    if top_p < 1.0:
        kept, mass = set(), 0.0
        for i in order:
            if i not in keep:
                continue
            if mass >= top_p:  # the tokens before this one already hold top_p of the mass
                break
            kept.add(i)
            mass += math.exp(scaled[i]) / z
        keep = kept
    probs = torch.zeros(len(scaled), dtype=torch.float64)
    for i in keep:
        probs[i] = math.exp(scaled[i])
    return probs / probs.sum()


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, float]:
    """Returns (chi-square statistic, critical value at alpha = 1e-4) with bins of expected count < 5 merged.

    Counts on zero-probability tokens make the statistic infinite (a support violation).
    """
    n = counts.sum().item()
    if (counts[probs == 0] > 0).any():
        return math.inf, 0.0
    expected = probs * n
    big = expected >= 5
    obs = torch.cat([counts[big].double(), counts[~big & (probs > 0)].double().sum()[None]])
    exp = torch.cat([expected[big], expected[~big & (probs > 0)].sum()[None]])
    obs, exp = obs[exp > 0], exp[exp > 0]
    stat = ((obs - exp) ** 2 / exp).sum().item()
    df = len(exp) - 1
    z = 3.719  # standard normal quantile for alpha = 1e-4; Wilson-Hilferty approximation below
    crit = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat, crit


def exact_token_distributions(model, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns the exact sampling distributions [V] of the first token and of the second token (marginal)."""
    with torch.no_grad():
        logits1 = model(torch.tensor([PROMPT])).logits[0, -1]  # [V]
        p1 = reference_probs(logits1, params.temperature, params.top_k, params.top_p)  # [V]
        nexts = torch.tensor([PROMPT + [t] for t in range(VOCAB)])  # [V, P+1]
        logits2 = model(nexts).logits[:, -1]  # [V, V]
    p2 = sum(
        p1[t] * reference_probs(logits2[t], params.temperature, params.top_k, params.top_p)
        for t in range(VOCAB)
        if p1[t] > 0
    )
    return p1, p2


SETTINGS = [
    SamplingParams(max_completion_length=2, temperature=0.7),
    SamplingParams(max_completion_length=2, temperature=1.3, top_k=5),
    SamplingParams(max_completion_length=2, temperature=1.0, top_p=0.8),
    SamplingParams(max_completion_length=2, temperature=0.8, top_k=8, top_p=0.9),
]


@pytest.mark.parametrize("engine_name", ["builtin", "hf"])
@pytest.mark.parametrize("params", SETTINGS, ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}")
def test_first_and_second_token_distributions_match_exact(peaky_model, engine_name, params):
    engine = make_test_engine(engine_name)
    batch = engine.generate(peaky_model, [PROMPT], N_SAMPLES, params, torch.Generator().manual_seed(0))
    tokens = torch.tensor(batch.completion_ids)  # [N, 2] (EOS is never sampled)
    p1, p2 = exact_token_distributions(peaky_model, params)
    for position, exact in ((0, p1), (1, p2)):
        counts = torch.bincount(tokens[:, position], minlength=VOCAB)  # [V]
        stat, crit = chi_square(counts, exact)
        assert stat < crit, (engine_name, position, stat, crit)
    # The check has power: a 25% hotter temperature is rejected on the first token.
    hotter = reference_probs(
        peaky_model(torch.tensor([PROMPT])).logits[0, -1].detach(),
        params.temperature * 1.25,
        params.top_k,
        params.top_p,
    )
    stat, crit = chi_square(torch.bincount(tokens[:, 0], minlength=VOCAB), hotter)
    assert stat > crit, (stat, crit)


@pytest.mark.parametrize("engine_name", ["builtin", "hf"])
@pytest.mark.parametrize(("top_k", "top_p"), [(3, 1.0), (0, 0.5), (4, 0.6)])
def test_top_k_top_p_restrict_the_support_exactly(peaky_model, engine_name, top_k, top_p):
    params = SamplingParams(max_completion_length=1, temperature=1.5, top_k=top_k, top_p=top_p)
    engine = make_test_engine(engine_name)
    batch = engine.generate(peaky_model, [PROMPT], 2000, params, torch.Generator().manual_seed(3))
    seen = {c[0] for c in batch.completion_ids}
    with torch.no_grad():
        logits = peaky_model(torch.tensor([PROMPT])).logits[0, -1]
    support = set(reference_probs(logits, 1.5, top_k, top_p).nonzero().flatten().tolist())
    assert 1 < len(support) < VOCAB
    assert seen == support  # nothing outside, and every allowed token shows up in 2000 draws


def test_filter_logits_matches_loop_reference():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 30, generator=g) * 2  # [6, 30]
    for top_k, top_p in [(0, 1.0), (1, 1.0), (7, 1.0), (0, 0.3), (0, 0.95), (5, 0.7), (30, 0.5)]:
        out = filter_logits(logits, top_k, top_p)  # [6, 30]
        probs = out.softmax(-1).double()
        for row in range(6):
            ref = reference_probs(logits[row], 1.0, top_k, top_p)
            assert torch.equal(probs[row] > 0, ref > 0), (top_k, top_p, row)
            torch.testing.assert_close(probs[row], ref, rtol=1e-5, atol=1e-7)


def test_top_p_always_keeps_the_most_likely_token():
    logits = torch.tensor([[5.0, 0.0, 0.0, -1.0]])  # the top token alone holds > 0.9 of the mass
    out = filter_logits(logits, top_k=0, top_p=0.01)
    assert torch.isfinite(out).tolist() == [[True, False, False, False]]


def test_draw_respects_zero_probabilities_and_unnormalised_rows():
    probs = torch.tensor([[0.0, 2.0, 0.0, 6.0, 0.0], [0.0, 0.0, 0.0, 0.0, 1.0]])  # row sums 8 and 1
    rows = probs.repeat(5000, 1)  # [10000, 5]
    tokens = draw(rows, torch.Generator().manual_seed(0)).view(5000, 2)
    assert set(tokens[:, 1].tolist()) == {4}
    counts = torch.bincount(tokens[:, 0], minlength=5)
    assert counts[[0, 2, 4]].sum() == 0
    stat, crit = chi_square(counts, probs[0].double() / 8)
    assert stat < crit, (stat, crit)


@pytest.mark.parametrize("block", [1, 3, 4, 1024])
def test_two_level_draw_matches_the_distribution_across_block_edges(block):
    # Mass on both sides of block edges and in the zero-padded last block (V = 10 is not a multiple of 4).
    probs = torch.tensor([[0.0, 0.0, 0.0, 3.0, 1.0, 0.0, 0.0, 2.0, 0.0, 4.0], [5.0] + [0.0] * 9])
    tokens = draw(probs.repeat(6000, 1), torch.Generator().manual_seed(1), block=block).view(6000, 2)
    assert set(tokens[:, 1].tolist()) == {0}
    counts = torch.bincount(tokens[:, 0], minlength=10)
    assert counts[probs[0] == 0].sum() == 0
    stat, crit = chi_square(counts, probs[0].double() / probs[0].sum())
    assert stat < crit, (stat, crit)


def _nan_model():
    """Returns a tiny model whose logits of token 2 are NaN (so every sampling distribution is)."""
    from _tiny import tiny_model

    model = tiny_model(seed=4)
    with torch.no_grad():
        model.lm_head.weight[2] = float("nan")
    return model


def test_torchs_refusal_of_non_finite_probabilities_is_a_typed_error(monkeypatch):
    from cohort.errors import NonFiniteSamplingError
    from cohort.rollout import sampling

    # the accelerator branch of draw: torch.multinomial, which refuses NaN probabilities
    monkeypatch.setattr(sampling, "draw", lambda probs, generator: torch.multinomial(probs, 1).squeeze(-1))
    logits = torch.zeros(2, VOCAB)
    assert sampling.sample_next(logits, SamplingParams(max_completion_length=1))[0].shape == (2,)
    logits[1, 3] = float("nan")
    with pytest.raises(NonFiniteSamplingError, match="probability tensor contains either `inf`, `nan`"):
        sampling.sample_next(logits, SamplingParams(max_completion_length=1))

    def broken(probs, generator):
        raise RuntimeError("another failure")

    monkeypatch.setattr(sampling, "draw", broken)
    with pytest.raises(RuntimeError, match="another failure") as caught:
        sampling.sample_next(torch.zeros(2, VOCAB), SamplingParams(max_completion_length=1))
    assert type(caught.value) is RuntimeError  # finite probabilities: not recognised as the non-finite case


def test_rows_that_are_no_distribution_become_uniform_for_multinomial_and_the_others_stay():
    from cohort.rollout.sampling import drawable

    good = torch.tensor([0.2, 0.3, 0.5, 0.0])
    probs = torch.stack(
        [
            good,
            torch.tensor([0.2, float("nan"), 0.5, 0.3]),
            torch.tensor([float("inf"), 0.0, 0.0, 0.0]),
            torch.tensor([0.5, -0.1, 0.3, 0.3]),
            torch.zeros(4),
            torch.tensor([0.5, float("-inf"), 0.3, 0.3]),
            torch.tensor([float("inf"), float("-inf"), 0.3, 0.3]),  # a sum of NaN
            torch.tensor([0.5, -0.0, 0.3, 0.2]),  # -0.0 is no negative entry
        ]
    )
    with pytest.raises(RuntimeError):  # what CUDA's multinomial turns into a device-side assert
        torch.multinomial(probs, 1)
    safe = drawable(probs)
    assert torch.equal(safe[0], good) and torch.equal(safe[7], probs[7])  # distributions are left as they are
    assert torch.equal(safe[1:7], torch.ones(6, 4))  # the six bad rows: uniform
    assert torch.multinomial(safe, 1).shape == (8, 1)  # accepted


@pytest.mark.parametrize("accelerator_branch", [True, False], ids=["multinomial", "inverse-cdf"])
def test_the_builtin_engine_reports_non_finite_logits_whatever_draws_them(monkeypatch, accelerator_branch):
    from cohort.errors import NonFiniteSamplingError
    from cohort.rollout import sampling

    if accelerator_branch:
        # draw's accelerator branch, on this CPU: multinomial on drawable rows, which never refuses
        def accelerator_draw(probs, generator):
            return torch.multinomial(sampling.drawable(probs), 1).squeeze(-1)

        monkeypatch.setattr(sampling, "draw", accelerator_draw)
    engine = make_test_engine("builtin", fast=FastConfig.all("off"))  # no fast path's probe on a NaN model
    with pytest.raises(NonFiniteSamplingError, match="probability tensor contains either `inf`, `nan`"):
        engine.generate(_nan_model(), [PROMPT], 2, SamplingParams(max_completion_length=3))


def test_the_hf_recorder_hands_generate_drawable_scores_and_remembers_the_bad_rows():
    from cohort.rollout.hf import _LogprobRecorder

    rec = _LogprobRecorder(1.0)
    scores = torch.tensor([[0.0, 1.0, float("-inf")], [float("nan"), 0.0, 0.0], [float("inf"), 0.0, 0.0]])
    out = rec(torch.zeros(3, 1, dtype=torch.long), scores)
    assert torch.equal(out[0], scores[0])  # a masked token (-inf) is not a bad row
    assert torch.equal(out[1:], torch.zeros(2, 3))  # the NaN and +inf rows: flat scores, drawable
    assert rec.undrawable.tolist() == [False, True, True]
    rec(torch.zeros(3, 2, dtype=torch.long), torch.zeros(3, 3))
    assert rec.undrawable.tolist() == [False, True, True]  # remembered over the later steps


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["builtin", "hf"])
def test_non_finite_logits_on_cuda_are_a_typed_error_and_cuda_still_works(name):
    from cohort.errors import NonFiniteSamplingError

    model = _nan_model().to("cuda")
    options = {"fast": FastConfig.all("off")} if name == "builtin" else {}
    engine, generator = make_test_engine(name, **options), torch.Generator("cuda").manual_seed(0)
    with pytest.raises(NonFiniteSamplingError, match="probability tensor contains either `inf`, `nan`"):
        engine.generate(model, [PROMPT], 2, SamplingParams(max_completion_length=3), generator)
    torch.cuda.synchronize()  # a device-side assert would surface here, and in every later CUDA call
    assert torch.ones(3, device="cuda").sum().item() == 3.0


def test_the_hf_engine_reports_non_finite_logits_as_a_typed_error():
    from cohort.errors import NonFiniteSamplingError

    with pytest.raises(NonFiniteSamplingError, match="probability tensor contains either `inf`, `nan`"):
        make_test_engine("hf").generate(_nan_model(), [PROMPT], 2, SamplingParams(max_completion_length=3))
