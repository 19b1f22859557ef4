"""cohort.runtime.transfer: host-to-device copies that do not make the host wait. On a CPU every tensor is what
torch.tensor / .to made before; on CUDA (simulated here: this machine has none) the update's index lists travel
pinned, in one queued copy, and come back as views of the right shapes and values."""

from __future__ import annotations

import pytest
import torch

from cohort.runtime.transfer import long_tensors, pack, to_device, unpack

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
LISTS = [[[1, 2, 3], [4, 5, 6]], [7, 8], [], [[9]]]


def test_on_a_cpu_each_list_is_what_torch_tensor_makes():
    for got, want in zip(long_tensors(LISTS, CPU), LISTS):
        ref = torch.tensor(want, dtype=torch.long)
        assert got.dtype == torch.long and got.shape == ref.shape and torch.equal(got, ref)
    x = torch.randn(3, 4)
    assert to_device(x, CPU) is x  # nothing copied, as .to(device) does
    assert torch.equal(to_device(x, CPU, torch.float64), x.to(torch.float64))


def test_pack_and_unpack_are_inverse_and_unpack_makes_views():
    host = [torch.tensor(v, dtype=torch.long) for v in LISTS]
    flat = pack(host)
    assert flat.shape == (sum(t.numel() for t in host),)
    back = unpack(flat, host)
    assert [t.shape for t in back] == [t.shape for t in host]
    assert all(torch.equal(a, b) for a, b in zip(back, host))
    back[0][1, 2] = 60
    assert flat[5] == 60  # a view of the one buffer, not a copy


@pytest.fixture
def simulated_cuda(monkeypatch):
    """Tensor.pin_memory and a copy to CUDA recorded and done on the CPU."""
    calls: list[tuple] = []
    real_to = torch.Tensor.to

    def pin_memory(self):
        calls.append(("pin", self.dtype, self.numel()))
        return self.clone()

    def to(self, *args, **kwargs):
        if args and isinstance(args[0], torch.device) and args[0].type == "cuda":
            calls.append(("copy", kwargs.get("non_blocking", False)))
            return self.clone()
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    monkeypatch.setattr(torch.Tensor, "to", to)
    return calls


def test_on_cuda_the_lists_travel_pinned_in_one_queued_copy(simulated_cuda):
    got = long_tensors(LISTS, CUDA)
    assert simulated_cuda == [("pin", torch.long, 9), ("copy", True)]
    assert [t.tolist() for t in got] == LISTS


def test_on_cuda_a_tensor_is_cast_then_pinned_and_queued(simulated_cuda):
    x = torch.randn(2, 3)
    got = to_device(x, CUDA, torch.float64)
    assert simulated_cuda == [("pin", torch.float64, 6), ("copy", True)]
    assert torch.equal(got, x.double())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="times a real copy to a CUDA GPU: needs one")
def test_on_a_gpu_the_copies_never_make_the_host_wait():
    """torch's sync debug mode raises at any call that makes the host wait for the device: a plain copy of a
    pageable CPU tensor does, these do not."""
    device = torch.device("cuda")
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = long_tensors(LISTS, device)
        x = to_device(torch.arange(6.0).view(2, 3), device, torch.float64)
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    assert [t.tolist() for t in got] == LISTS and all(t.device.type == "cuda" for t in got)
    assert x.dtype == torch.float64 and x.cpu().tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
