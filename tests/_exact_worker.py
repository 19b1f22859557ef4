"""Runs one policy update case on this process's share of a fixed global batch (for test_distributed_exact)."""

from __future__ import annotations

import contextlib
import copy
import os
from pathlib import Path

import torch
from _tiny import VOCAB, random_prompts, tiny_model

from cohort.algo import group_advantages
from cohort.config import AlgoConfig, LoraConfig
from cohort.fastpath import FastConfig
from cohort.logprobs import warm_probes
from cohort.models import checkpoint_activations, wrap_lora
from cohort.runtime.distributed import exit_without_teardown
from cohort.runtime.sharding import full_value, reshard, shard
from cohort.train.update import PolicyBatch, PolicyUpdater

GROUPS, G = 7, 3


def global_batch(equal_lengths: bool = False, groups: int = GROUPS, with_rewards: bool = False):
    """Returns (prompts, completions, advantages [N]) of the fixed global batch (and the rewards [N] last when
    with_rewards): 7 groups of 3, two of them
    with all-equal rewards (zero advantage), completions of 1..6 tokens (all 4 with equal_lengths)."""
    prompts = random_prompts(GROUPS, seed=1)
    g = torch.Generator().manual_seed(2)
    lengths = (
        [4] * (GROUPS * G) if equal_lengths else torch.randint(1, 7, (GROUPS * G,), generator=g).tolist()
    )
    completions = [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in lengths]
    rewards = torch.rand(groups * G, generator=g, dtype=torch.float64)
    rewards[0:3] = 1.0  # group 0 all equal
    rewards[9:12] = 0.0  # group 3 all equal
    if with_rewards:
        return prompts, completions, group_advantages(rewards, G), rewards
    return prompts, completions, group_advantages(rewards, G)


def run_case(case: dict, rank: int, world: int, strategy: str = "none") -> dict[str, torch.Tensor]:
    """Returns the trainable parameters (whole) after two updates of this process's groups (float64), the model
    (and reference) wrapped by FSDP under `strategy` when world > 1."""
    torch.manual_seed(0)
    model = tiny_model(seed=0).double()
    if case.get("lora"):
        model = wrap_lora(model, LoraConfig(enabled=True, r=4, alpha=8, target_modules=["q_proj", "v_proj"]))
        model.double()
    if case.get("checkpointing"):  # before the reference copy: the copy inherits the flag (no-grad passes)
        assert checkpoint_activations(model)
    reference = None
    if case.get("beta"):
        frozen = copy.deepcopy(model).requires_grad_(False)
        if world > 1:
            shard(frozen, strategy, mixed_precision=case.get("mixed_precision", "none"))
        reference = lambda: contextlib.nullcontext(frozen)  # noqa: E731
    seen: list[torch.dtype] = []
    if world > 1:
        shard(model, strategy, mixed_precision=case.get("mixed_precision", "none"))
        # the dtype the first projection computes in: FSDP's mixed-precision policy casts it
        proj = next(m for m in model.modules() if isinstance(m, torch.nn.Linear))
        proj.register_forward_pre_hook(lambda mod, args: seen.append(mod.weight.dtype))
    algo = AlgoConfig(
        loss_type=case["loss_type"],
        beta=case.get("beta", 0.0),
        num_iterations=case.get("mu", 1),
        num_minibatches=case.get("minibatches", 1),
        eps_high=0.28 if case["loss_type"] in ("grpo", "bnpo", "dapo", "dr_grpo") else None,
        kl_tau=case.get("kl_tau", 0.0),
        advantage=case.get("advantage", "grpo"),
    )
    # SGD: AdamW divides each step by sqrt(v), which turns the rounding noise (~1e-17) of an element whose true
    # gradient is 0 into a step of ~lr * 1e-9 in either direction; the gradients themselves agree to rounding.
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    updater = PolicyUpdater(
        model,
        optimizer,
        None,
        algo,
        temperature=1.0,
        max_completion_length=6,
        micro_batch_tokens=case.get("micro_batch_tokens", 10**6),
        max_grad_norm=1.0,
        reference=reference,
        # The plain log-prob layout. transformers' Qwen2RMSNorm computes in float32 even in a float64 model;
        # the grouped layouts sum a prompt's G completion gradients before that float32 backward, the padded
        # layout after it, so the two agree only to float32 precision (1e-7 relative on the gradient, measured),
        # and which groups share a micro-batch would show here. Not what this test is about.
        fast=FastConfig.all("off").replace(skip_zero_advantage=case.get("skip", "auto"))
        if case.get("fast") != "auto"
        else FastConfig(segments_min_tokens=0),  # every fast path, segment attention even on short groups
    )
    groups = case.get("groups", GROUPS)
    prompts, completions, adv, rewards = global_batch(
        case.get("equal_lengths", False), groups, with_rewards=True
    )
    mine = torch.arange(groups).tensor_split(world)[rank].tolist()
    rows = [g * G + i for g in mine for i in range(G)]
    batch = PolicyBatch(
        [prompts[g] for g in mine],
        [completions[r] for r in rows],
        G,
        adv[rows].float(),
        torch.ones(len(rows), dtype=torch.bool),
        group_offset=mine[0] if mine else 0,
        total_groups=groups,
        rewards=rewards[rows] if case.get("advantage") == "optimal_token_baseline" else None,
    )
    if world > 1:  # as the trainer does: the once-per-model checks on every process together, on the shards
        warm_probes(model, updater.fast)
        reshard(model)
    shuffle = torch.Generator().manual_seed(5)
    for _ in range(2):
        stats = updater.update(batch, shuffle)
    out = {n: full_value(p.detach()).clone() for n, p in model.named_parameters() if p.requires_grad}
    # The update's logged statistics are over every process's tokens too (token-weighted means).
    for name in ("loss", "entropy", "kl", "ratio_mean"):
        value = getattr(stats, name)
        if value is not None:
            out[f"stat/{name}"] = torch.tensor(float(value), dtype=torch.float64)
    out["stat/clip_region"] = torch.tensor(stats.clip_ratio["region_mean"], dtype=torch.float64)
    out["stat/bf16_compute"] = torch.tensor(float(torch.bfloat16 in seen), dtype=torch.float64)
    for path in ("segments", "chunked_head"):  # the share of log-prob passes that took each fast path
        out[f"path/{path}"] = torch.tensor(float(stats.paths.get(path, 0.0)), dtype=torch.float64)
    return out


def worker(rank: int, world: int, store: str, out: str, cases: dict[str, dict], strategy: str) -> None:
    """Runs every case on one process of a gloo group and saves each result to out/<case>-<rank>.pt."""
    import torch.distributed as tdist

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    tdist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        for name, case in cases.items():
            torch.save(run_case(case, rank, world, strategy), Path(out) / f"{name}-{rank}.pt")
    finally:
        tdist.destroy_process_group()
    exit_without_teardown(0)  # gloo's threads, still held by sharded tensors, can abort the teardown
