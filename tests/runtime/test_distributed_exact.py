"""K gloo processes make exactly the update one process makes on the same global batch (float64, 1e-9).

Each process holds a contiguous share of the groups (7 groups: 4 + 3 on two processes, 3 + 2 + 2 on three);
losses use the global normalisers, FSDP sums the gradients (sharded, and replicated on a (K, 1) mesh),
minibatches are drawn from the global batch, and processes with fewer micro-batches run idle passes.
Covered: every loss type, zero-advantage rows skipped and not, mu > 1 with minibatches, a KL term, LoRA,
several micro-batches. The optimizer is SGD (see _exact_worker.py: Adam would amplify rounding noise).
`bnpo` divides by each process's own token count (its definition, TRL's), so it is compared where every
process holds the same token count (6 groups of equal lengths).
"""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
from _exact_worker import run_case, worker

from cohort.algo import LOSS_TYPES

CASES: dict[str, dict] = {lt: {"loss_type": lt} for lt in LOSS_TYPES if lt != "bnpo"}
CASES["dro"]["kl_tau"] = 1e-2  # dro is refused without its penalty
CASES.update(
    {
        # The policy moves inside the batch: DPPO's masks and the squared log-ratio penalty act.
        "dppo_tv_mu2_kl_tau": {"loss_type": "dppo_tv", "mu": 2, "minibatches": 2, "kl_tau": 1e-2},
        # Per-token baselines from the update's own pi_old pass, per group (groups never straddle processes).
        "otb_mu2": {"loss_type": "dapo", "advantage": "optimal_token_baseline", "mu": 2},
        # 6 groups of equal lengths: every process (2 or 3) holds the same token count.
        "bnpo_equal_shares": {"loss_type": "bnpo", "equal_lengths": True, "groups": 6},
        "dapo_no_skip": {"loss_type": "dapo", "skip": "off"},
        "grpo_mu2_minibatches": {"loss_type": "grpo", "mu": 2, "minibatches": 2},
        "dapo_mu2_minibatches": {"loss_type": "dapo", "mu": 2, "minibatches": 3},
        "cispo_mu2_minibatches": {"loss_type": "cispo", "mu": 2, "minibatches": 2},
        "dapo_kl": {"loss_type": "dapo", "beta": 0.05},
        "grpo_lora": {"loss_type": "grpo", "lora": True, "minibatches": 2},
        "dr_grpo_micro_batches": {"loss_type": "dr_grpo", "micro_batch_tokens": 12},
    }
)


@pytest.fixture(autouse=True)
def _processes_on_the_cpu(monkeypatch):
    """The spawned gloo processes see no GPU, as one_process computes on the CPU (one GPU cannot host K ranks)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


@pytest.fixture(scope="module")
def one_process():
    return {name: run_case(case, 0, 1) for name, case in CASES.items()}


@pytest.mark.parametrize("world,strategy", [(2, "fsdp"), (3, "fsdp"), (2, "replicate"), (3, "replicate")])
def test_k_processes_make_the_one_process_update(tmp_path, world, strategy, one_process):
    one = one_process
    mp.spawn(
        worker, args=(world, str(tmp_path / "store"), str(tmp_path), CASES, strategy), nprocs=world, join=True
    )
    for name in CASES:
        got = [torch.load(tmp_path / f"{name}-{r}.pt") for r in range(world)]
        for key, want in one[name].items():
            for r in range(world):
                err = (got[r][key] - want).abs().max().item()
                assert err <= 1e-9 * want.abs().max().item() + 1e-15, (name, r, key, err)
    # The comparison is not between unchanged weights: the update moved them.
    from _tiny import tiny_model

    base = dict(tiny_model(seed=0).double().named_parameters())
    assert any((one["dapo"][k] - base[k]).abs().max() > 1e-6 for k in one["dapo"] if k in base)
    assert one["dapo_kl"]["stat/kl"] > 0 and one["grpo_mu2_minibatches"]["stat/clip_region"] >= 0


def test_fsdp_mixed_precision_computes_in_bf16_and_stays_close(tmp_path, one_process):
    # FSDP's MixedPrecisionPolicy (distributed.mixed_precision=bf16): the layers compute in bfloat16, the
    # parameters and the optimizer stay in the model's dtype, and the update is the one-process update to
    # bfloat16 precision (not to 1e-9).
    cases = {"dapo_bf16": {"loss_type": "dapo", "mixed_precision": "bf16"}}
    mp.spawn(worker, args=(2, str(tmp_path / "store"), str(tmp_path), cases, "fsdp"), nprocs=2, join=True)
    got = torch.load(tmp_path / "dapo_bf16-0.pt")
    assert got["stat/bf16_compute"] == 1.0
    from _tiny import tiny_model

    base = dict(tiny_model(seed=0).double().named_parameters())
    want = one_process["dapo"]
    for k in base:
        assert got[k].dtype == torch.float64
        step_want, step_got = want[k] - base[k], got[k] - base[k]
        assert (step_got - step_want).abs().max() <= 0.05 * step_want.abs().max() + 1e-6, k


@pytest.mark.parametrize("strategy", ["fsdp", "replicate"])
def test_fast_paths_run_sharded_and_match_one_process(tmp_path, strategy):
    # Segment attention and the chunked LM head (the decoder and the head are FSDP units of their own) under
    # both strategies, with a KL term against a sharded reference and several micro-batches. Compared to the
    # one-process run with the same fast paths at 1e-6, not 1e-9: transformers' RMSNorm runs in float32, and
    # the grouped layouts sum gradients before it, so which groups share a pass shows at ~1e-7.
    # With activation checkpointing too: the recomputed layers follow the same segment plan.
    fast = {"loss_type": "dapo", "fast": "auto", "beta": 0.05, "micro_batch_tokens": 40}
    cases = {"dapo_fast": fast, "dapo_fast_checkpointing": {**fast, "checkpointing": True}}
    one = {name: run_case(case, 0, 1) for name, case in cases.items()}
    mp.spawn(worker, args=(2, str(tmp_path / "store"), str(tmp_path), cases, strategy), nprocs=2, join=True)
    for name, r in [(name, r) for name in cases for r in range(2)]:
        assert one[name]["path/segments"] == 1.0 and one[name]["path/chunked_head"] == 1.0
        got = torch.load(tmp_path / f"{name}-{r}.pt")
        assert got["path/segments"] == 1.0 and got["path/chunked_head"] == 1.0  # taken, not fallen back
        for key, want in one[name].items():
            if key.startswith(("path/", "stat/bf16")):
                continue
            err = (got[key] - want).abs().max().item()
            assert err <= 1e-6 * want.abs().max().item() + 1e-12, (name, key, r, err)
