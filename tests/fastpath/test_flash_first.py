"""fast.flash_first: the update asks sdpa for FlashAttention and memory-efficient attention before cuDNN's (which
PyTorch puts first on recent NVIDIA GPUs, at ~0.7 ms of host time a call on an H200), on CUDA by default, and
changes nothing on a CPU, whose sdpa has no cuDNN backend."""

from __future__ import annotations

import contextlib

import pytest
import torch
from _tiny import random_prompts, tiny_model

from cohort.config import AlgoConfig, load_config
from cohort.fastpath import FastConfig
from cohort.fastpath.attention import FLASH_FIRST, flash_first
from cohort.train.update import PolicyBatch, PolicyUpdater

G = 2
CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


def _order() -> list[int]:
    if not hasattr(torch._C, "_get_sdp_priority_order"):  # a torch before sdpa's priority order
        pytest.skip("this torch has no sdpa priority order to read")
    return list(torch._C._get_sdp_priority_order())


def test_on_puts_flash_and_efficient_attention_first_and_the_order_comes_back():
    from torch.nn.attention import SDPBackend

    before = _order()
    with flash_first("on", CPU) as taken:
        assert taken
        wanted = [int(getattr(SDPBackend, name)) for name in FLASH_FIRST]
        assert _order()[: len(wanted)] == wanted
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.cudnn_sdp_enabled()
    assert _order() == before  # torch's own order after the block


@pytest.mark.parametrize(
    "setting, device, taken",
    [("auto", CUDA, True), ("auto", CPU, False), ("off", CUDA, False), ("on", CPU, True)],
)
def test_auto_takes_it_on_cuda_only(setting, device, taken):
    before = _order()
    with flash_first(setting, device) as got:
        assert got is taken
        assert (_order() == before) is not taken
    assert _order() == before


def test_on_cuda_torch_settles_its_own_order_before_it_is_read(monkeypatch):
    """torch sets its CUDA default order at the first backend choice of the process; flash_first makes one before
    reading the order it restores (a process whose first attention is the update would otherwise run that update
    with cuDNN first, and restore an order torch had not settled)."""
    import cohort.fastpath.attention as attention

    monkeypatch.setattr(attention, "_SETTLED", set())
    calls: list[tuple] = []

    def choose(*args):
        calls.append((_order(), args[0].device))
        return 0

    monkeypatch.setattr(torch, "_fused_sdp_choice", choose)
    monkeypatch.setattr(torch, "zeros", lambda *a, device=None, **k: torch.empty(0).new_zeros(1, 1, 1, 8))
    before = _order()
    with flash_first("auto", CUDA):
        inside = _order()
    with flash_first("auto", CUDA):
        pass
    assert len(calls) == 1 and calls[0][0] == before  # once per device, before the block's order is set
    assert inside != before and _order() == before
    with flash_first("auto", CPU), flash_first("on", CPU):
        pass
    assert len(calls) == 1  # a CPU has no lazily chosen order


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="on a GPU settling may change the order: that is its job"
)
def test_settling_the_order_without_cuda_changes_nothing(monkeypatch):
    import cohort.fastpath.attention as attention

    monkeypatch.setattr(attention, "_SETTLED", set())
    before = _order()
    attention.settle_sdp_order(CUDA)  # no CUDA here: the tiny tensor cannot be made, and nothing is raised
    assert _order() == before and CUDA in attention._SETTLED


def _update(model, fast: FastConfig):
    prompts = random_prompts(2, seed=3, min_len=2, max_len=7)
    g = torch.Generator().manual_seed(4)
    comps = [
        torch.randint(2, 40, (int(n),), generator=g).tolist()
        for n in torch.randint(1, 9, (2 * G,), generator=g)
    ]
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    batch = PolicyBatch(prompts, comps, G, adv, torch.ones(2 * G, dtype=torch.bool))
    model.zero_grad()
    params = list(model.parameters())
    updater = PolicyUpdater(
        model,
        torch.optim.SGD(params, lr=0.0),  # lr 0: the gradient is compared, the weights stay
        None,
        AlgoConfig(loss_type="dapo"),
        temperature=1.0,
        max_completion_length=16,
        micro_batch_tokens=10**6,
        max_grad_norm=0.0,
        fast=fast,
    )
    stats = updater.update(batch)
    return stats, {n: p.grad.clone() for n, p in model.named_parameters()}


def test_a_cpu_update_is_bitwise_the_same_with_it_and_reports_it():
    model = tiny_model(seed=5).double()
    plain, plain_grad = _update(model, FastConfig(flash_first="auto"))  # a CPU: not taken
    first, first_grad = _update(model, FastConfig(flash_first="on"))
    assert plain.paths["flash_first"] == 0.0 and first.paths["flash_first"] == 1.0
    assert plain.loss == first.loss
    for name, grad in plain_grad.items():
        assert torch.equal(first_grad[name], grad), name


def test_a_bad_value_is_refused_before_the_model_loads():
    with pytest.raises(
        ValueError, match="fast.flash_first='sometimes' is not valid; choose one of: auto, on, off"
    ):
        FastConfig(flash_first="sometimes").validate()
    base = {"model": {"name_or_path": "not-loaded", "device": "cpu"}, "data": {"task": "addition"}}
    with pytest.raises(ValueError, match="fast.flash_first"):
        load_config(None, {**base, "fast": {"flash_first": "sometimes"}}).validate()
    assert (
        load_config(None, {**base, "fast": {"flash_first": False}}).fast.flash_first == "off"
    )  # YAML's bare off


def test_a_torch_that_cannot_reorder_leaves_cudnn_out_instead(monkeypatch):
    import torch.nn.attention as attention_api

    asked = []

    @contextlib.contextmanager
    def old_sdpa_kernel(backends):  # the signature before set_priority
        asked.append(list(backends))
        yield

    monkeypatch.setattr(attention_api, "sdpa_kernel", old_sdpa_kernel)
    with flash_first("on", CPU) as taken:
        assert taken
    names = [b.name for b in asked[0]]
    assert names == ["FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH"]
