"""DPPO's top-K divergence in the update (algo.dppo_topk = K, issue 40).

The chunked LM head gathers the policy's log-probs at the sampler's top-K ids (no [N, T, V] logits kept); the
update takes the K + 1-point TV / KL from them against its anchor (the sampler's top-K log-probs under
trust_region_anchor=sampler, pi_old's at the same ids under old) and passes it to policy_loss as `divergence`.
Checked against a plain reference (full logits, cohort.algo.topk_divergence) on a float64 model, then a short
trainer run, and the configurations refused before the model loads.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from test_train_update import G, _combinations, gpt2_64
from test_trainer import _cfg

from cohort import GRPOTrainer
from cohort.algo import loss_normalisers, policy_loss, topk_divergence
from cohort.config import AlgoConfig, ConfigError
from cohort.errors import TrainingError
from cohort.fastpath import FastConfig
from cohort.logprobs import completion_logprobs
from cohort.rollout.sampling import forced_topk
from cohort.train.update import PolicyBatch, PolicyUpdater

K = 4
TEMPERATURE = 0.9


@pytest.fixture(scope="module")
def model64():
    return gpt2_64(seed=11)


def _full_logits(model, batch: PolicyBatch, r: int) -> torch.Tensor:
    """Returns row r's next-token logits / temperature [T_r, V] from a plain forward (differentiable)."""
    prompt, comp = batch.prompt_ids[r // G], batch.completion_ids[r]
    logits = model(torch.tensor([prompt + comp])).logits[0] / TEMPERATURE
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(comp)]


@pytest.fixture(scope="module")
def batch(model64):
    """Three groups of ragged rows (one all-zero-advantage group, one row out of the loss) with a sampler that is
    the policy's logits plus noise: its top-K (sampled token forced in) and log-probs, far enough from the
    policy that DPPO's top-K mask drops tokens."""
    g = torch.Generator().manual_seed(32)
    prompts = [torch.randint(2, 40, (int(n),), generator=g).tolist() for n in (3, 7, 5)]
    comps = [
        torch.randint(2, 40, (int(n),), generator=g).tolist()
        for n in torch.randint(1, 12, (3 * G,), generator=g)
    ]
    adv = torch.randn(3 * G, generator=g, dtype=torch.float64).float()
    adv[:G] = 0.0
    in_loss = torch.ones(3 * G, dtype=torch.bool)
    in_loss[G + 1] = False
    plain = PolicyBatch(prompts, comps, G, adv, in_loss)
    ids, tops, sampled = [], [], []
    with torch.no_grad():
        for r, comp in enumerate(comps):
            logits = _full_logits(model64, plain, r)
            sampler = torch.log_softmax(
                logits + 1.5 * torch.randn(logits.shape, generator=g, dtype=logits.dtype), -1
            )
            i, top = forced_topk(sampler.float(), torch.tensor(comp), K)
            ids.append(i)
            tops.append(top)
            sampled.append(sampler.gather(-1, torch.tensor(comp)[:, None]).squeeze(-1).float())
    return dataclasses.replace(plain, sampling_logprobs=sampled, topk_ids=ids, topk_logprobs=tops)


def _updater(model, fast=None, micro_batch_tokens=10**6, lr=0.0, **algo) -> PolicyUpdater:
    return PolicyUpdater(
        model,
        torch.optim.SGD(list(model.parameters()), lr=lr),
        None,
        AlgoConfig(**algo),
        temperature=TEMPERATURE,
        max_completion_length=16,
        micro_batch_tokens=micro_batch_tokens,
        max_grad_norm=0.0,
        fast=fast,
    )


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _zero(model) -> None:
    for p in model.parameters():
        p.grad = None


def test_the_chunked_head_gathers_the_top_k_log_probs_a_full_log_softmax_gives(model64, batch):
    rows = list(range(3 * G))
    with torch.no_grad():
        want = [
            torch.log_softmax(_full_logits(model64, batch, r), -1).gather(-1, batch.topk_ids[r]) for r in rows
        ]
    for fast in _combinations():
        for options in ({}, {"with_entropy": True}, {"with_sum_pi_squared": True}):
            with torch.no_grad():
                lp = completion_logprobs(
                    model64, batch.prompt_ids, batch.completion_ids, G, rows=rows[::-1], temperature=TEMPERATURE,
                    fast=fast, chunk_size=5, topk_ids=batch.topk_ids, **options,
                )  # fmt: skip
            for i, r in enumerate(rows[::-1]):
                n = len(batch.completion_ids[r])
                torch.testing.assert_close(lp.topk_logp[i, :n], want[r], rtol=1e-12, atol=1e-13)
                assert lp.topk_logp[i, n:].eq(0).all()
    # Under autograd (the update's pass, the differentiable entropy's too): the same values, and no gradient.
    for with_entropy in (True, "grad"):
        lp = completion_logprobs(
            model64, batch.prompt_ids, batch.completion_ids, G, temperature=TEMPERATURE, chunk_size=5,
            topk_ids=batch.topk_ids, with_entropy=with_entropy,
        )  # fmt: skip
        assert not lp.topk_logp.requires_grad and lp.logp.requires_grad
        torch.testing.assert_close(
            lp.topk_logp[3, : len(batch.completion_ids[3])], want[3], rtol=1e-12, atol=1e-13
        )


@pytest.mark.parametrize("loss_type", ["dppo_tv", "dppo_kl"])
def test_the_update_equals_a_full_logits_reference_under_the_sampler_anchor(model64, batch, loss_type):
    algo = {"loss_type": loss_type, "dppo_topk": K, "trust_region_anchor": "sampler"}
    # The reference: full logits, topk_divergence against the sampler's top-K, the ratio against its log-probs.
    _zero(model64)
    rows = [r for r in range(3 * G) if bool(batch.in_loss[r])]
    width = max(len(batch.completion_ids[r]) for r in rows)
    logits = torch.zeros(len(rows), width, 40, dtype=torch.float64)
    ids = torch.zeros(len(rows), width, K, dtype=torch.long)
    anchor = torch.zeros(len(rows), width, K)
    tokens = torch.zeros(len(rows), width, dtype=torch.long)
    old = torch.zeros(len(rows), width)
    for i, r in enumerate(rows):
        n = len(batch.completion_ids[r])
        logits[i, :n] = _full_logits(model64, batch, r)
        ids[i, :n], anchor[i, :n] = batch.topk_ids[r], batch.topk_logprobs[r]
        tokens[i, :n], old[i, :n] = torch.tensor(batch.completion_ids[r]), batch.sampling_logprobs[r]
    mask = torch.arange(width)[None, :] < torch.tensor([len(batch.completion_ids[r]) for r in rows])[:, None]
    logp = torch.log_softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1)
    kl, tv = topk_divergence(logits.detach(), ids, anchor)
    divergence = kl if loss_type == "dppo_kl" else tv
    num_items, num_seq = loss_normalisers(loss_type, [int(m.sum()) for m in mask], int, 1)
    loss, metrics = policy_loss(
        logp, old.double(), batch.advantages[rows].double(), mask, loss_type=loss_type, divergence=divergence,
        num_items=num_items, num_sequences=num_seq,
    )  # fmt: skip
    loss.backward()
    want = _grads(model64)
    dropped = float(metrics["clip_ratio/region_mean"])
    assert 0 < dropped < 1  # the mask drops some tokens and keeps others
    want_div = float((divergence * mask).sum() / mask.sum())
    # Skipping zero-advantage rows leaves them out of the forward pass, and so out of the update's metrics.
    computed = mask & (batch.advantages[rows] != 0)[:, None]
    want_div_computed = float((divergence * computed).sum() / computed.sum())
    plain, fast_skip = FastConfig.all("off"), FastConfig(chunked_head="on", skip_zero_advantage="on")
    for fast, tokens_per_micro, expected in ((plain, 10**6, want_div), (fast_skip, 30, want_div_computed)):
        _zero(model64)
        stats = _updater(model64, fast, tokens_per_micro, **algo).update(batch)
        got = _grads(model64)
        for name, w in want.items():
            torch.testing.assert_close(got[name], w, rtol=1e-9, atol=1e-13, msg=name)
        assert stats.loss == pytest.approx(float(loss.detach()), rel=1e-9, abs=1e-13)
        assert stats.controls["dppo/topk_divergence_mean"] == pytest.approx(expected, rel=1e-9)
        if fast is plain:
            assert stats.clip_ratio["region_mean"] == pytest.approx(dropped, rel=1e-9)
    # Without the top-K the binary mask decides, and drops a different set of tokens.
    _zero(model64)
    binary = _updater(model64, loss_type=loss_type, trust_region_anchor="sampler").update(batch)
    assert "dppo/topk_divergence_mean" not in binary.controls


def test_the_pi_old_anchor_gathers_pi_old_at_the_samplers_ids(model64, batch):
    # Under trust_region_anchor=old the anchor is pi_old's log-probs at the sampler's top-K ids. When the sampler
    # is pi_old itself (its log-probs and top-K log-probs pi_old's), the sampler anchor gives the same numbers:
    # both updates move the weights alike, over two passes in which the policy moves and the mask bites.
    rows = list(range(3 * G))
    top_out: dict[int, torch.Tensor] = {}
    own = _updater(model64).frozen_logprobs(model64, batch, rows, topk_out=top_out)
    with torch.no_grad():
        for r in rows:
            want = torch.log_softmax(_full_logits(model64, batch, r), -1).gather(-1, batch.topk_ids[r])
            torch.testing.assert_close(top_out[r], want, rtol=1e-12, atol=1e-13)
    as_sampler = dataclasses.replace(
        batch, sampling_logprobs=[own[r] for r in rows], topk_logprobs=[top_out[r] for r in rows]
    )
    start = {n: p.detach().clone() for n, p in model64.named_parameters()}
    after, divergences = [], []
    for anchor in ("old", "sampler"):
        with torch.no_grad():
            for n, p in model64.named_parameters():
                p.copy_(start[n])
        algo = {"loss_type": "dppo_tv", "dppo_topk": K, "trust_region_anchor": anchor, "num_iterations": 3}
        stats = _updater(model64, lr=0.5, **algo).update(as_sampler)
        after.append({n: p.detach().clone() for n, p in model64.named_parameters()})
        divergences.append(stats.controls["dppo/topk_divergence_mean"])
    with torch.no_grad():
        for n, p in model64.named_parameters():
            p.copy_(start[n])
    for name in start:
        torch.testing.assert_close(after[0][name], after[1][name], rtol=1e-9, atol=1e-12, msg=name)
        assert not torch.equal(after[0][name], start[name]) or "bias" in name or "ln" in name
    assert divergences[0] == pytest.approx(divergences[1], rel=1e-9) and divergences[0] > 0


def test_one_step_against_pi_old_has_divergence_zero(model64, batch):
    # pi_old is the policy itself before its first step (no pi_old pass): the top-K divergence is exactly 0.
    _zero(model64)
    stats = _updater(model64, loss_type="dppo_kl", dppo_topk=K).update(batch)
    assert stats.controls["dppo/topk_divergence_mean"] == 0.0
    assert stats.clip_ratio["region_mean"] == 0.0


def test_an_update_without_the_samplers_top_k_is_refused_naming_the_fix(model64, batch):
    plain = dataclasses.replace(batch, topk_ids=None, topk_logprobs=None)
    with pytest.raises(TrainingError, match="algo.dppo_topk=4 .* use rollout.engine=builtin"):
        _updater(model64, loss_type="dppo_tv", dppo_topk=K).update(plain)
    with pytest.raises(
        TrainingError, match="have K = \\[4\\]; sample with SamplingParams\\(logprobs_topk=3\\)"
    ):
        _updater(model64, loss_type="dppo_tv", dppo_topk=3).update(batch)


def test_a_trainer_run_with_dppo_topk_samples_top_k_and_logs_the_divergence(tiny_model_dir, tmp_path):
    over = {"algo.loss_type": "dppo_tv", "algo.dppo_topk": 4, "algo.num_iterations": 2, "steps": 2}
    trainer = GRPOTrainer(_cfg(tiny_model_dir, tmp_path / "run", **over))
    assert trainer.drawer.params.logprobs_topk == 4 and trainer.held_out.params.logprobs_topk == 0
    trainer.train()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["dppo/topk_divergence_mean"] > 0 for r in rows)  # the second pass moved away from pi_old


@pytest.mark.parametrize(
    ("over", "fragment"),
    [
        ({"rollout.engine": "hf"}, "set rollout.engine=builtin"),
        ({"rollout.workers": 1}, "unset rollout.workers"),
        ({"episodes.tools": ["no_such_module:tool"]}, "multi-turn episodes do not return them"),
    ],
)
def test_sources_without_top_k_are_refused_before_the_model_loads(tmp_path, over, fragment):
    cfg = _cfg(
        tmp_path / "no-model-here",
        tmp_path / "o",
        **{"algo.loss_type": "dppo_tv", "algo.dppo_topk": 4},
        **over,
    )
    with pytest.raises(ConfigError, match=f"algo.dppo_topk=4 needs .*{fragment}"):
        GRPOTrainer(cfg)


def test_the_optimal_token_baseline_pass_also_gives_the_pi_old_anchor(model64, batch):
    # With algo.advantage=optimal_token_baseline, pi_old comes from its own pass, which then gathers the top-K too.
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.5, 2.0, 0.0, 1.0, 0.0])
    otb = dataclasses.replace(batch, rewards=rewards)
    updater = _updater(model64, loss_type="dppo_tv", dppo_topk=K, advantage="optimal_token_baseline")
    top_out: dict[int, torch.Tensor] = {}
    old, _ = updater._otb_pass(otb, topk_out=top_out)
    want = updater.frozen_logprobs(model64, otb, list(range(3 * G)), topk_out=(want_top := {}))
    for r in range(3 * G):
        assert torch.equal(old[r], want[r]) and torch.equal(top_out[r], want_top[r])
    start = {n: p.detach().clone() for n, p in model64.named_parameters()}
    try:
        moving = _updater(
            model64,
            lr=0.5,
            loss_type="dppo_tv",
            dppo_topk=K,
            advantage="optimal_token_baseline",
            num_iterations=2,
        )
        assert moving.update(otb).controls["dppo/topk_divergence_mean"] > 0
    finally:
        with torch.no_grad():
            for n, p in model64.named_parameters():
                p.copy_(start[n])
