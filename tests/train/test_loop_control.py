"""Loop control from the seeds: dynamic sampling with refill, the pass-rate curriculum, reference sync."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from _tiny import tiny_model
from test_trainer import _cfg

from cohort.reference import REFERENCE_ADAPTER, Reference
from cohort.rewards import RewardLogs
from cohort.rollout import RolloutBatch, select_groups
from cohort.train.curriculum import SOLVED, UNSOLVED, Curriculum
from cohort.trainer import GRPOTrainer, PromptSampler

# ------------------------------------------------------------------ pieces


def _batch(prompts: int, G: int, base: int) -> RolloutBatch:
    return RolloutBatch(
        prompt_ids=[[base + p] for p in range(prompts)],
        completion_ids=[[base + r, r] for r in range(prompts * G)],
        truncated=torch.tensor([r % 2 == 0 for r in range(prompts * G)]),
        group_size=G,
        sampling_logprobs=[torch.tensor([float(base + r)]) for r in range(prompts * G)],
    )


def test_select_groups_keeps_whole_groups_in_order():
    a, b = _batch(3, 2, 100), _batch(2, 2, 200)
    out = select_groups([(a, [2, 0]), (b, [1])])
    assert out.prompt_ids == [[102], [100], [201]]
    assert out.completion_ids == [[104, 4], [105, 5], [100, 0], [101, 1], [202, 2], [203, 3]]
    assert out.truncated.tolist() == [True, False, True, False, True, False]
    assert [float(x) for x in out.sampling_logprobs] == [104, 105, 100, 101, 202, 203]
    with pytest.raises(ValueError, match="group size 2 and 3"):
        select_groups([(a, [0]), (_batch(1, 3, 0), [0])])


def test_reward_logs_merge_selected_extras_and_every_metric():
    one, two = RewardLogs(), RewardLogs()
    one.metrics["rewards/f/x"] = [1.0, 2.0]
    one.extras["note"] = ["a", "b", "c", "d"]
    two.metrics["rewards/f/x"] = [3.0]
    merged = RewardLogs.merged([(one, [1, 3]), (two, [0])])
    assert merged.metrics == {"rewards/f/x": [1.0, 2.0, 3.0]}
    assert merged.extras == {"note": ["b", "d", None]}


def test_the_sampler_passes_over_refused_prompts_and_never_stalls():
    s = PromptSampler(10, seed=0)
    taken = s.take(4, allow=lambda i: i % 2 == 0)
    assert len(taken) == 4 and all(i % 2 == 0 for i in taken)
    assert (
        len(PromptSampler(10, seed=0).take(3, allow=lambda i: False)) == 3
    )  # everything refused: takes anyway


def test_curriculum_sets_aside_always_and_never_solved_prompts_then_retries_them():
    c = Curriculum(4, pass_threshold=1.0, min_samplings=2, retry_after=5)
    scores = torch.tensor([[1.0, 1.0], [0.0, 0.0], [1.0, 0.0], [float("nan"), 1.0]])
    c.record([0, 1, 2, 3], scores, step=1)
    assert all(c.active(i, 2) for i in range(4))  # one sampling is not enough at min_samplings=2
    c.record([0, 1, 2, 3], scores, step=2)
    # 0 always passed, 1 never, 2 half, 3 passed its one scored completion each time (None not counted)
    assert c.reason.tolist() == [SOLVED, UNSOLVED, 0, SOLVED]
    assert c.metrics(3) == {
        "curriculum/active": 1.0,
        "curriculum/aside_solved": 2.0,
        "curriculum/aside_unsolved": 1.0,
        "curriculum/mean_pass_rate": pytest.approx((1 + 0 + 0.5 + 1) / 4),
    }
    assert not c.active(0, 6) and c.active(0, 7)  # aside from step 2 until 2 + 5
    assert c.samplings[0] == 0 and c.reason[0] == 0  # back, counts cleared: judged afresh
    saved = c.state_dict()
    other = Curriculum(4)
    other.load_state_dict(saved)
    assert torch.equal(other.reason, c.reason) and torch.equal(other.aside_until, c.aside_until)
    with pytest.raises(ValueError, match="tracks 4 prompts, this run has 5"):
        Curriculum(5).load_state_dict(saved)


# ------------------------------------------------------------------ reference sync


def _logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids], device=next(model.parameters()).device)).logits


def test_reference_sync_copies_or_mixes_every_weight_once():
    policy = tiny_model(seed=0)
    ref = Reference(policy, every=2, alpha=0.25)
    before = {k: v.clone() for k, v in ref.copy.state_dict().items()}
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(1.0)
    assert not ref.maybe_sync(1, None) and ref.syncs == 0
    assert ref.maybe_sync(2, None) and ref.syncs == 1
    now = policy.state_dict()
    for k, v in ref.copy.state_dict().items():
        if v.is_floating_point() and k in dict(policy.named_parameters()):
            torch.testing.assert_close(v, 0.25 * now[k] + 0.75 * before[k])  # a tied weight mixed once
    state = ref.state_dict()
    fresh = Reference(tiny_model(seed=0), every=2, alpha=0.25)
    fresh.load_state_dict(state)
    assert fresh.syncs == 1
    for k, v in fresh.copy.state_dict().items():
        torch.testing.assert_close(v, ref.copy.state_dict()[k])


def test_reference_sync_triggered_by_kl():
    ref = Reference(tiny_model(seed=0), kl_threshold=0.5)
    assert ref.follows_policy
    assert not ref.maybe_sync(1, 0.4) and not ref.maybe_sync(2, None)
    assert ref.maybe_sync(3, 0.6) and ref.syncs == 1
    assert not Reference(tiny_model(seed=0)).follows_policy


def test_lora_reference_is_the_base_until_synced_then_the_synced_adapter():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        tiny_model(seed=0), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)  # a trained adapter: the policy differs from the base
    ids = [3, 5, 7, 9]
    ref = Reference(model, every=1)
    with ref() as m:
        base = _logits(m, ids)
    assert not torch.allclose(base, _logits(model, ids), atol=1e-4)
    ref.maybe_sync(1, None)
    assert REFERENCE_ADAPTER in model.peft_config
    with ref() as m:
        torch.testing.assert_close(_logits(m, ids), _logits(model, ids))  # α = 1: an exact copy
    # The policy's adapter stays the trainable, active one; the reference's is frozen.
    assert all(p.requires_grad == (".default." in n) for n, p in model.named_parameters() if "lora_" in n)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name and ".default." in name:
                p.add_(0.3)  # the policy moves on
    with ref() as m:
        synced = _logits(m, ids)
    assert not torch.allclose(synced, _logits(model, ids), atol=1e-4)
    state = ref.state_dict()
    other = get_peft_model(
        tiny_model(seed=0), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    )
    again = Reference(other)
    again.load_state_dict(state)
    with again() as m:
        torch.testing.assert_close(_logits(m, ids), synced)


# ------------------------------------------------------------------ in the trainer


def half_informative(prompts, completions, **kwargs):
    """Rewards that differ within a group only for prompts whose first operand is odd (all 0 otherwise)."""
    return [float(i % 2) if int(str(p).split("+")[0]) % 2 else 0.0 for i, p in enumerate(prompts)]


def never_informative(prompts, completions, **kwargs):
    return [1.0] * len(prompts)


def test_dynamic_sampling_trains_every_step_on_a_full_batch_of_informative_groups(tiny_model_dir, tmp_path):
    over = {"algo.dynamic_sampling": True, "algo.max_sampling_rounds": 6, "num_samples_logged": 64}
    t = GRPOTrainer(_cfg(tiny_model_dir, tmp_path / "ds", steps=3, **over), reward_funcs=[half_informative])
    t.train()
    rows = [json.loads(x) for x in (tmp_path / "ds" / "metrics.jsonl").read_text().splitlines()]
    P = t.cfg.prompts_per_step
    for r in rows:
        assert r["sampling/groups_kept"] == P and r["frac_reward_zero_std"] == 0.0
        assert r["sampling/groups_generated"] >= P and r["sampling/rounds"] >= 1
        assert r["sampling/completion_tokens"] >= r["completions/mean_length"] * P * 4
    assert any(r["sampling/rounds"] > 1 for r in rows)  # about half the groups teach nothing: refills happen
    samples = [json.loads(x) for x in (tmp_path / "ds" / "samples.jsonl").read_text().splitlines()]
    assert all(
        int(s["prompt"].split("+")[0]) % 2 == 1 for s in samples
    )  # only informative prompts trained on


def test_dynamic_sampling_is_bounded_and_says_so(tiny_model_dir, tmp_path):
    over = {"algo.dynamic_sampling": True, "algo.max_sampling_rounds": 3}
    t = GRPOTrainer(
        _cfg(tiny_model_dir, tmp_path / "none", steps=2, **over), reward_funcs=[never_informative]
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = t.step()
    assert result.metrics["sampling/rounds"] == 3 and result.metrics["sampling/groups_kept"] == 0
    assert result.metrics["sampling/groups_generated"] == 3 * t.cfg.prompts_per_step
    assert any("no group with unequal rewards in 3 rounds" in str(w.message) for w in caught)


def test_curriculum_in_the_trainer_sets_prompts_aside_and_is_off_by_default(tiny_model_dir, tmp_path):
    t = GRPOTrainer(
        _cfg(tiny_model_dir, tmp_path / "cur", steps=2, **{"curriculum.enabled": True}),
        reward_funcs=[never_informative],
    )
    m = t.step().metrics
    assert m["curriculum/aside_solved"] == t.cfg.prompts_per_step  # every completion passed: all set aside
    assert m["curriculum/active"] == len(t.train_rows) - t.cfg.prompts_per_step
    seen = set(t.sampler._order[: t.sampler.pos])
    m2 = t.step().metrics
    assert m2["curriculum/aside_solved"] == 2 * t.cfg.prompts_per_step  # the next step drew other prompts
    assert len(seen) == t.cfg.prompts_per_step
    plain = GRPOTrainer(_cfg(tiny_model_dir, tmp_path / "plain", steps=1), reward_funcs=[never_informative])
    assert plain.curriculum is None and not any(k.startswith("curriculum/") for k in plain.step().metrics)


def test_lora_reference_sync_runs_in_the_trainer_and_resumes(tiny_model_dir, tmp_path):
    over = {
        "model.lora.enabled": True,
        "model.lora.r": 4,
        "algo.beta": 0.1,
        "algo.ref_update_every": 1,
        "algo.ref_mixup_alpha": 0.5,
        "optim.lr": 5e-2,
        "save_every": 1,
    }
    t = GRPOTrainer(_cfg(tiny_model_dir, tmp_path / "lora", steps=2, **over))
    t.train()
    assert t.reference.syncs == 2
    assert (tmp_path / "lora" / "checkpoints" / "step-2" / "reference.pt").is_file()
    resumed = GRPOTrainer(_cfg(tiny_model_dir, tmp_path / "lora", steps=3, resume="auto", **over))
    assert resumed.reference.syncs == 2
    ids = [3, 4, 5]
    with t.reference() as a, resumed.reference() as b:
        torch.testing.assert_close(_logits(b, ids), _logits(a, ids))
