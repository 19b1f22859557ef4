"""The optimizer and schedule shared by GRPO and SFT."""

from __future__ import annotations

import math

import pytest
import torch

from cohort.runtime.optim import SCHEDULES, make_adamw, make_scheduler


def test_adamw_is_fused_only_when_asked_and_possible():
    w = torch.nn.Parameter(torch.zeros(3))
    assert make_adamw([w], lr=0.1).defaults["fused"] is True
    assert make_adamw([w], lr=0.1, fused=False).defaults["fused"] is None  # torch's own default
    opt = make_adamw((p for p in [w]), lr=0.1, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.5)
    assert opt.defaults["betas"] == (0.8, 0.9) and opt.defaults["weight_decay"] == 0.5


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_schedules_warm_up_then_decay(schedule):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = make_scheduler(opt, schedule, warmup=2, total=6)
    lrs = []
    for _ in range(6):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[:3] == [0.5, 1.0, 1.0]
    want = {
        "constant": [1.0, 1.0, 1.0],
        "linear": [0.75, 0.5, 0.25],
        "cosine": [0.5 + 0.5 * math.cos(math.pi * k / 4) for k in (1, 2, 3)],
    }
    assert lrs[3:] == pytest.approx(want[schedule])


def test_unknown_schedule():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    with pytest.raises(ValueError, match="constant, linear, cosine"):
        make_scheduler(opt, "step", 0, 10)


def test_the_applied_rate_is_the_one_the_last_optimizer_step_used():
    """metrics.jsonl's lr and TRL's learning_rate: the optimizer's own rate is the next step's once the schedule has
    stepped (with a 2-step warm-up the first step logged 1e-3 where it applied 5e-4)."""
    from cohort.runtime.optim import applied_lr, make_adamw, make_scheduler

    p = torch.nn.Parameter(torch.zeros(1))
    opt = make_adamw([p], lr=1e-3)
    sched = make_scheduler(opt, "linear", 2, 6)
    used = []
    for _ in range(4):
        used.append(opt.param_groups[0]["lr"])  # what this step applies
        opt.step()
        sched.step()
        assert applied_lr(opt, sched) == pytest.approx(used[-1])
    assert used == pytest.approx([5e-4, 1e-3, 1e-3, 7.5e-4])
    assert applied_lr(make_adamw([p], lr=2e-3), None) == 2e-3
