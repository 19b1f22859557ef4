"""The bf16-autocast path (what the trainer runs on CUDA), exercised on CPU with torch.autocast("cpu").

No GPU is needed to catch what autocast breaks in our own code: dtype mismatches between bf16
activations and float32 buffers, masks built in the wrong dtype, a softmax left in bf16.
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from _tiny import EOS, PAD, random_prompts, tiny_model

from cohort.fastpath import FastConfig, probes
from cohort.logprobs import completion_logprobs
from cohort.rollout import make_engine
from cohort.rollout.base import SamplingParams

G = 4


def bf16():
    """Returns the CPU stand-in for the trainer's CUDA autocast context."""
    return torch.autocast("cpu", dtype=torch.bfloat16)


@pytest.fixture
def model():
    return tiny_model(seed=0, logit_scale=4.0, eos_bias=1.0)


def _completions(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(2, 40, (int(k),), generator=g).tolist() for k in torch.randint(1, 12, (n,), generator=g)
    ]


@pytest.mark.parametrize("segments", [True, False], ids=["segments", "dense-mask"])
def test_logprobs_and_gradients_under_autocast_follow_float32(model, segments):
    fast = FastConfig(segments="on" if segments else "off")
    prompts, comps = random_prompts(3, seed=1), _completions(3 * G, seed=2)
    model.train()

    def run(ctx):
        model.zero_grad()
        with ctx, warnings.catch_warnings():
            warnings.simplefilter("error")  # a path check failing here would fall back with a warning
            out = completion_logprobs(model, prompts, comps, G, with_entropy=True, fast=fast)
        (out.logp * out.mask).sum().backward()
        return out, torch.cat([p.grad.flatten() for p in model.parameters()])

    got, got_grad = run(bf16())  # first, so the once-per-model segment check runs under autocast
    ref, ref_grad = run(contextlib.nullcontext())
    assert got.path == ("segments" if segments else "dense_mask")  # the path under test was taken
    assert probes.results(model).get("segments", False) == segments
    assert got.logp.dtype == torch.float32 and got.entropy.dtype == torch.float32
    assert torch.isfinite(got.logp).all() and torch.isfinite(got_grad).all()
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())
    err = (got.logp - ref.logp)[ref.mask].abs()
    assert 0 < err.max() < 0.15, err.max()  # bf16 rounding, and autocast was really on
    assert torch.nn.functional.cosine_similarity(got_grad, ref_grad, dim=0) > 0.98


@pytest.mark.parametrize("shared", [True, False], ids=["shared-prefix", "repeated-cache"])
def test_sampler_under_autocast_returns_float32_logprobs_the_trainer_recomputes(model, shared):
    fast = FastConfig(shared_prefix="on" if shared else "off")
    engine = make_engine("builtin", eos_token_ids=[EOS], pad_token_id=PAD, fast=fast)
    prompts = random_prompts(3, seed=3)
    params = SamplingParams(max_completion_length=8, temperature=1.0)
    with bf16(), warnings.catch_warnings():
        # The once-per-model check of shared-prefix decoding runs under the caller's autocast: it must
        # allow bf16 rounding, or CUDA runs would silently lose prefix sharing.
        warnings.simplefilter("error")
        out = engine.generate(model, prompts, G, params, torch.Generator().manual_seed(0))
        again = completion_logprobs(model, prompts, out.completion_ids, G)
    assert out.paths["shared_prefix"] == shared
    assert probes.results(model).get("shared_prefix", False) == shared
    assert len(out.completion_ids) == 3 * G and any(out.completion_ids)
    for i, lp in enumerate(out.sampling_logprobs):
        n = len(out.completion_ids[i])
        assert lp.dtype == torch.float32 and torch.isfinite(lp).all()
        # Same model, same autocast: sampling and training agree up to bf16 rounding of two code paths.
        assert torch.allclose(lp, again.logp[i, :n], atol=0.15), (i, lp, again.logp[i, :n])


def test_trainer_steps_under_autocast(tiny_model_dir, tmp_path, monkeypatch):
    from test_trainer import _cfg, _params

    from cohort.trainer import GRPOTrainer

    monkeypatch.setattr(GRPOTrainer, "autocast", lambda self: bf16())
    trainer = GRPOTrainer(_cfg(tiny_model_dir, tmp_path / "run", steps=2))
    seen = []
    before = _params(trainer.model)
    for i in range(2):
        if i == 1:  # after the first step's once-per-model path checks, which run outside autocast on purpose
            trainer.model.register_forward_hook(lambda m, a, o: seen.append(torch.is_autocast_enabled("cpu")))
        m = trainer.step().metrics
        assert torch.isfinite(torch.tensor([m["loss"], m["grad_norm"], m["entropy"]])).all(), m
    assert seen and all(seen)
    after = _params(trainer.model)
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert all(v.dtype == torch.float32 for v in after.values())
