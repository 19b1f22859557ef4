"""Supervised fine-tuning: its optimizer section (an OptimConfig, with the older flat names as aliases), a
run that takes torch's default AdamW and the cosine schedule step for step, and what it refuses before training
(pairs past the model's context, an output folder that would overwrite the input model)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _tiny import tiny_model

from cohort.commands.sft import SFTConfig, check_output_folder, sft_train
from cohort.config import OptimConfig
from cohort.logprobs import completion_logprobs
from cohort.runtime.optim import make_scheduler


def test_the_optimizer_section_and_its_aliases():
    cfg = SFTConfig()
    assert cfg.optim == OptimConfig(lr=1e-3, warmup_steps=10, schedule="cosine", adam_beta2=0.999)
    old = SFTConfig(steps=5, lr=3e-3, warmup_steps=2, weight_decay=0.1, max_grad_norm=0.5)
    assert dataclasses.asdict(old.optim) == {
        **dataclasses.asdict(cfg.optim),
        "lr": 3e-3,
        "warmup_steps": 2,
        "weight_decay": 0.1,
        "max_grad_norm": 0.5,
    }
    assert (old.lr, old.warmup_steps, old.weight_decay, old.max_grad_norm) == (3e-3, 2, 0.1, 0.5)
    old.lr = 1e-2
    assert old.optim.lr == 1e-2
    # A copy made the way the demo makes one keeps the section; an alias never writes into a shared one.
    copy = SFTConfig(**{**old.__dict__, "seed": 3, "lr": 5e-4})
    assert (copy.seed, copy.optim.lr, old.optim.lr) == (3, 5e-4, 1e-2)


def test_a_run_is_torchs_default_adamw_under_the_cosine_schedule():
    pairs = [([2, 3, 4], [5, 6, 1]), ([7, 8], [9, 1]), ([3, 3, 3, 3], [4, 1])]
    cfg = SFTConfig(steps=4, batch_size=2, lr=5e-3, warmup_steps=1, weight_decay=0.1, log_every=1)
    model = tiny_model(seed=0)
    history = sft_train(model, pairs, cfg)

    # The loop as it was written before the section existed: AdamW's own defaults, cosine, the same order.
    ref = tiny_model(seed=0)
    params = [p for p in ref.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=5e-3, weight_decay=0.1)
    sched = make_scheduler(opt, "cosine", 1, 4)
    g = torch.Generator().manual_seed(0)
    order: list[int] = []
    losses = []
    for _ in range(4):
        idx = []
        while len(idx) < 2:
            if not order:
                order = torch.randperm(len(pairs), generator=g).tolist()
            idx.append(order.pop())
        lp = completion_logprobs(ref, [pairs[i][0] for i in idx], [pairs[i][1] for i in idx], 1)
        loss = -(lp.logp * lp.mask).sum() / lp.mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
    assert [row["loss"] for row in history] == losses
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))


def test_pairs_longer_than_the_context_are_refused_before_training():
    model = tiny_model(seed=0)
    model.config.max_position_embeddings = 8  # positions past it were never trained
    pairs = [([2, 3, 4], [5, 1]), ([2] * 6, [5, 6, 1]), ([3] * 9, [1])]
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(
        ValueError, match=r"2 of 3 SFT pairs \(row 1 first, the longest 10 tokens.* context of 8"
    ):
        sft_train(model, pairs, SFTConfig(steps=1, batch_size=2))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))
    sft_train(model, pairs[:1], SFTConfig(steps=1, batch_size=1))  # 5 tokens fit


def test_out_may_not_be_or_hold_the_model_folder(tmp_path, monkeypatch):
    model = tmp_path / "runs" / "base"
    model.mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    for out in (model, "runs/base", "runs/base/", "runs", "."):
        with pytest.raises(
            ValueError, match="over the model folder .* it is read from; choose another folder"
        ):
            check_output_folder(out, "runs/base")
    check_output_folder("runs/base-sft", "runs/base")  # a sibling folder
    check_output_folder("runs/base/sft", "runs/base")  # a folder inside the model's writes none of its files
    check_output_folder("Qwen", "Qwen/Qwen2.5-0.5B")  # a Hub name: nothing local to overwrite
