"""cohort.algo.controls: the token controls composed into one result, checked against the parts they compose."""

from __future__ import annotations

import pytest
import torch

from cohort.algo.controls import SAMPLER_CORRECTIONS, ControlSettings, token_controls
from cohort.algo.offpolicy import IS_LEVELS, IS_MODES, sampler_correction
from cohort.algo.selection import kl_cov_mask, token_covariance, top_entropy_mask


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(3, 5, generator=g, dtype=torch.float64) * 3
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[0, 3:] = False
    adv = torch.tensor([1.0, -0.5, 0.25], dtype=torch.float64)
    entropy = torch.rand(3, 5, generator=g, dtype=torch.float64)
    sampled = logp + 0.3 * torch.randn(3, 5, generator=g, dtype=torch.float64)
    return logp, mask, adv, entropy, sampled


def test_no_control_is_inactive_and_changes_nothing():
    logp, mask, adv, *_ = _batch()
    s = ControlSettings()
    assert not s.active
    out = token_controls(logp, mask, adv, s)
    assert out.weights is None and out.kl_cov is None and out.kept is None and out.metrics == {}


def test_controls_multiply_into_one_weight():
    """High-entropy mask times the truncated sampler weights: the product of what each part returns alone."""
    logp, mask, adv, entropy, sampled = _batch()
    s = ControlSettings(top_entropy_quantile=0.5, sampler_correction="token_tis", sampler_is_max=1.5)
    out = token_controls(logp, mask, adv, s, entropy=entropy, sampled_logp=sampled)
    kept = top_entropy_mask(entropy, mask, 0.5)
    w, _ = sampler_correction(
        logp, sampled, mask, level="token", mode="truncate", max_ratio=1.5, min_ratio=None
    )
    assert torch.equal(out.kept, kept)
    torch.testing.assert_close(out.weights, kept.to(logp.dtype) * w)
    assert out.metrics["entropy_mask/kept_frac"] == pytest.approx(float(kept.sum()) / float(mask.sum()))
    assert {"sampler/is_ratio_mean", "sampler/is_ratio_max"} <= set(out.metrics)


def test_kl_cov_marks_tokens_without_weighting_them():
    logp, mask, adv, *_ = _batch()
    out = token_controls(logp, mask, adv, ControlSettings(cov_method="kl_cov", cov_ratio=0.2))
    assert out.weights is None
    assert torch.equal(out.kl_cov, kl_cov_mask(token_covariance(logp, adv, mask), mask, ratio=0.2))
    assert out.metrics["cov/selected_frac"] == pytest.approx(float(out.kl_cov.sum()) / float(mask.sum()))


def test_clip_cov_zeroes_the_weight_of_the_tokens_it_detaches():
    logp, mask, adv, *_ = _batch()
    s = ControlSettings(cov_method="clip_cov", cov_ratio=0.3, clip_cov_bounds=(-10.0, 10.0))
    out = token_controls(logp, mask, adv, s, generator=torch.Generator().manual_seed(0))
    detached = out.weights == 0
    assert detached.any() and bool(mask[detached].all())
    assert out.metrics["cov/selected_frac"] == pytest.approx(float(detached.sum()) / float(mask.sum()))


def test_missing_inputs_and_unknown_names_are_refused():
    logp, mask, adv, *_ = _batch()
    with pytest.raises(ValueError, match="needs token entropies"):
        token_controls(logp, mask, adv, ControlSettings(top_entropy_quantile=0.5))
    with pytest.raises(ValueError, match="needs the sampler's log-probs"):
        token_controls(logp, mask, adv, ControlSettings(sampler_correction="sequence_mis"))
    with pytest.raises(ValueError, match="cov_method='kl'"):
        ControlSettings(cov_method="kl")
    with pytest.raises(ValueError, match="sampler_correction='tis'"):
        ControlSettings(sampler_correction="tis")


def test_sampler_correction_names_map_onto_the_corrections_levels_and_modes():
    pairs = [v for v in SAMPLER_CORRECTIONS.values() if v is not None]
    assert sorted(pairs) == sorted((lvl, mode) for lvl in IS_LEVELS for mode in IS_MODES)
