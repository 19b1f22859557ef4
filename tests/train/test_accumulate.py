"""What an update reads from the device (cohort.train.accumulate): each micro-batch's loss and measurements are
queued and read once per optimizer step, in one transfer on an accelerator, as float() would read each."""

from __future__ import annotations

import pytest
import torch

from cohort.train import accumulate
from cohort.train.accumulate import UpdateMeter, read_floats, read_together


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64])
def test_one_transfer_reads_what_float_reads(dtype):
    g = torch.Generator().manual_seed(0)
    if dtype == torch.int64:
        values = [
            torch.tensor(n) for n in (0, 1, 2**24 + 1, 2**40 + 3)
        ]  # token counts, past float32's exact range
    else:
        values = [(torch.randn((), generator=g) * 10**e).to(dtype) for e in range(-8, 9)]
    read = read_together(values)
    assert read == [float(v) for v in values]
    assert all(type(x) is float for x in read)


def test_values_on_an_accelerator_are_read_together_in_order(monkeypatch):
    calls = []

    def together(tensors):
        calls.append(len(tensors))
        return read_together(tensors)

    class Remote(torch.Tensor):  # a CPU tensor that says it lives on an accelerator
        @property
        def device(self):
            return torch.device("cuda", 0)

    monkeypatch.setattr(accumulate, "read_together", together)
    remote = [torch.tensor(v).as_subclass(Remote) for v in (1.5, 2.25)]
    assert read_floats([0.5, remote[0], torch.tensor(3.0), remote[1], 7]) == [0.5, 1.5, 3.0, 2.25, 7.0]
    assert calls == [2]  # the two accelerator values in one read; the CPU tensor and the numbers as they are


def _queue(meter, losses, masks, entropies, metrics):
    for loss, mask, ent, m in zip(losses, masks, entropies, metrics):
        meter.queue_micro_batch(loss, mask, m, ent)


def test_a_queued_step_measures_what_reading_each_micro_batch_did():
    g = torch.Generator().manual_seed(3)
    masks = [
        torch.rand(3, 5, generator=g) > 0.3,
        torch.zeros(2, 4, dtype=torch.bool),
    ]  # the second: no tokens
    entropies = [torch.rand(3, 5, generator=g), torch.rand(2, 4, generator=g)]
    losses = [torch.tensor(0.25), torch.tensor(-1.5)]
    metrics = [
        {"kl": torch.tensor(0.125), "clip_ratio/low_mean": torch.tensor(0.1), "clip_ratio/high_mean": 0.2},
        {"kl": torch.tensor(0.5), "clip_ratio/low_mean": torch.tensor(0.3), "clip_ratio/high_mean": 0.0},
    ]
    meter = UpdateMeter()
    meter.sampler_gap(torch.tensor([[0.0, -2.0]]), torch.tensor([[0.5, -1.0]]), torch.tensor([[1.0, 1.0]]))
    _queue(meter, losses, masks, entropies, metrics)
    assert meter.gap == 0.0 and not meter.means.sums  # nothing read yet
    total = meter.read_micro_batches()
    assert total == 0.25 + -1.5
    assert meter.gap == 1.0
    ntok = [float(m.sum()) for m in masks]
    kl = (0.125 * ntok[0] + 0.5 * ntok[1]) / sum(ntok)
    assert meter.means.get("kl") == pytest.approx(kl, rel=1e-12)
    ent0 = float((entropies[0] * masks[0]).sum()) / ntok[0]
    assert meter.means.get("entropy") == pytest.approx(
        ent0, rel=1e-12
    )  # the empty micro-batch weighs nothing
    assert meter.low_min == pytest.approx(0.1) and meter.high_max == pytest.approx(
        0.2
    )  # micro-batches with tokens
    assert not meter.pending and not meter.pending_gaps
    assert meter.read_micro_batches() == 0.0  # an optimizer step with nothing queued
