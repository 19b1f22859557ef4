"""The captured step's memory (cohort.rollout.graph.StaticDecoder.capture / close): each rollout's graph gets a pool
of its own, handed back when the rollout ends, and the allocator's cache is emptied before a capture only where
the device may lack room for that pool (torch.cuda.graph empties it before every capture).

On a CPU the CUDA calls are stand-ins that bind every call against torch's own signature (a renamed or misspelt
argument fails here, not on the first GPU) and record what happened, in order; the step itself runs for real, so
a "captured" rollout must decode what the uncaptured one decodes. The GPU-only test at the end watches the real
allocator."""

from __future__ import annotations

import inspect

import pytest
import torch
from _tiny import EOS, PAD, random_prompts, tiny_model

from cohort.rollout import SamplingParams
from cohort.rollout import graph as graph_mod
from cohort.rollout.graph import capture_needs_room, open_decoder, pool_estimate, static_decode

CPU = torch.device("cpu")
MiB = 1 << 20


def test_the_cache_is_emptied_only_when_free_memory_may_not_hold_the_pool():
    estimate = pool_estimate(64, 151_936, heads=14, span=456)
    assert estimate == 32 * 64 * 151_936  # ~311 MB: the sampler's [rows, vocab] float32 temporaries
    long_context = pool_estimate(64, 151_936, heads=14, span=32_768)
    assert long_context == 16 * 64 * 14 * 32_768  # ~470 MB: a layer's attention scores outgrow the sampler's
    need = 2 * estimate + 256 * MiB
    assert not capture_needs_room(100 << 30, estimate)  # a mostly empty GPU
    assert not capture_needs_room(need, estimate)
    assert capture_needs_room(need - 1, estimate)
    assert capture_needs_room(0, 0)  # nothing free at all: empty it, whatever the pool


def _bound(real):
    """Returns a check that a call's arguments fit `real`'s signature (a stand-in's call, checked)."""
    sig = inspect.signature(real)

    def check(*args, **kwargs):
        sig.bind(*args, **kwargs)

    return check


class FakeCuda:
    """Stands in for the torch.cuda calls of capture() and close(), recording them in order."""

    def __init__(self, monkeypatch, free_bytes: int, pool_bytes: int, fail_in_capture: bool = False):
        self.events: list[str] = []
        self.free, self.pool_bytes, self.reserved = free_bytes, pool_bytes, 10 * MiB
        self.capturing = False
        self.replay_step = None  # set by the test: what a replay does (the step, run for real)
        fake = self

        class Stream:
            made = 0

            def __init__(self, *a, **k):
                _bound(torch.cuda.Stream.__new__)(torch.cuda.Stream, *a, **k)
                Stream.made += 1

            def wait_stream(self, other):
                fake.events.append("wait_stream")

            def synchronize(self):
                fake.events.append("synchronize")

        class MemPool:
            count = 0

            def __init__(self, *a, **k):
                _bound(torch.cuda.MemPool.__init__)(None, *a, **k)
                MemPool.count += 1
                self.id = (0, 1000 + MemPool.count)
                fake.events.append(f"pool {self.id[1]}")

            def __del__(self):
                fake.events.append(f"pool {self.id[1]} freed")

        class Graph:
            def capture_begin(self, *a, **k):
                _bound(torch.cuda.CUDAGraph.capture_begin)(self, *a, **k)
                fake.events.append(f"capture_begin pool={k['pool'][1]} mode={k['capture_error_mode']}")
                fake.capturing = True

            def capture_end(self):
                _bound(torch.cuda.CUDAGraph.capture_end)(self)
                fake.capturing = False
                fake.reserved += fake.pool_bytes
                fake.events.append("capture_end")

            def replay(self):
                fake.replay_step()

            def reset(self):
                _bound(torch.cuda.CUDAGraph.reset)(self)
                fake.events.append("graph reset")

        def context(name):
            class Ctx:
                def __init__(self, *a, **k):
                    pass

                def __enter__(self):
                    fake.events.append(f"enter {name}")

                def __exit__(self, *exc):
                    return False

            return Ctx

        def mem_get_info(device=None):
            _bound(torch.cuda.mem_get_info)(device)
            return fake.free, 141 << 30

        def memory_reserved(device=None):
            _bound(torch.cuda.memory_reserved)(device)
            return fake.reserved

        def empty_cache():
            _bound(torch.cuda.empty_cache)()
            fake.events.append("empty_cache")

        class Current(Stream):
            def __init__(self):
                pass

        def current_stream(device=None):
            _bound(torch.cuda.current_stream)(device)
            return Current()

        self.Stream = Stream
        real_advance = graph_mod._advance

        def advance(decoder):
            if not fake.capturing:
                return real_advance(decoder)
            fake.events.append("step captured")  # a capture records the step's kernels; none runs
            if fail_in_capture:
                raise RuntimeError("operation not permitted when stream is capturing")

        monkeypatch.setattr(graph_mod, "_advance", advance)
        for name, value in {
            "Stream": Stream,
            "MemPool": MemPool,
            "CUDAGraph": Graph,
            "stream": context("stream"),
            "device": context("device"),
            "mem_get_info": mem_get_info,
            "memory_reserved": memory_reserved,
            "empty_cache": empty_cache,
            "current_stream": current_stream,
        }.items():
            monkeypatch.setattr(torch.cuda, name, value)
        monkeypatch.setattr(graph_mod, "_POOL_BYTES", {})
        monkeypatch.setattr(graph_mod, "_STREAMS", {})
        monkeypatch.setattr(graph_mod, "_FAILED_POOLS", [])


PARAMS = SamplingParams(max_completion_length=12, temperature=1.0, top_p=0.9)
KW = {"eos_token_ids": [EOS], "pad_token_id": PAD, "shared": True}


def _captured_rollout(model, prompts, fake: FakeCuda):
    g = torch.Generator().manual_seed(7)
    # under inference mode, as the engines sample
    with torch.inference_mode(), open_decoder(model, prompts, 3, PARAMS, g, CPU, **KW) as decoder:
        fake.replay_step = decoder.step
        out = decoder.run(g, capture=True, check_every=4)
        events_inside = list(fake.events)
    return out, events_inside


def test_a_capture_keeps_the_allocators_cache_and_hands_its_pool_back_after_the_last_replay(monkeypatch):
    model, prompts = tiny_model(seed=3), random_prompts(2, seed=1)
    fake = FakeCuda(monkeypatch, free_bytes=60 << 30, pool_bytes=300 * MiB)
    (tokens, lengths, ended, logps), inside = _captured_rollout(model, prompts, fake)
    pool = inside[inside.index("enter device") + 1]  # "pool N": made for this capture
    n = pool.split()[1]
    assert "empty_cache" not in fake.events  # 60 GiB free: nothing cached is handed back
    assert inside[inside.index(f"capture_begin pool={n} mode=thread_local") + 1] == "step captured"
    assert f"{pool} freed" not in inside  # held while the graph replays
    tail = fake.events[len(inside) :]
    assert tail == ["synchronize", "graph reset", f"{pool} freed"]  # every replay done, then graph, then pool
    assert graph_mod._POOL_BYTES[CPU] == 300 * MiB  # what the next capture on this device is assumed to need

    g = torch.Generator().manual_seed(7)  # the same rollout, the step called eagerly: the same tokens
    with torch.no_grad():
        ref = static_decode(model, prompts, 3, PARAMS, g, CPU, capture=False, check_every=4, **KW)
    assert torch.equal(lengths, ref[1]) and torch.equal(ended, ref[2])
    assert torch.equal(tokens, ref[0]) and torch.equal(logps, ref[3])


def test_the_cache_is_emptied_before_a_capture_the_device_may_have_no_room_for(monkeypatch):
    model, prompts = tiny_model(seed=3), random_prompts(2, seed=1)
    fake = FakeCuda(monkeypatch, free_bytes=8 << 30, pool_bytes=5 << 30)
    _captured_rollout(model, prompts, fake)
    assert (
        "empty_cache" not in fake.events
    )  # the first capture: the estimate is the tiny sampler's temporaries
    fake.events.clear()
    _captured_rollout(model, prompts, fake)  # the last pool took 5 GiB: 8 GiB free is not twice that
    assert fake.events.index("empty_cache") < fake.events.index("capture_end")
    assert fake.events.count("empty_cache") == 1
    assert fake.Stream.made == 1  # both rollouts warmed up and captured on one side stream


def test_a_failed_capture_keeps_its_pool_and_raises(monkeypatch):
    model, prompts = tiny_model(seed=3), random_prompts(2, seed=1)
    fake = FakeCuda(monkeypatch, free_bytes=60 << 30, pool_bytes=MiB, fail_in_capture=True)
    with pytest.raises(RuntimeError, match="stream is capturing"):
        _captured_rollout(model, prompts, fake)
    assert "capture_end" in fake.events  # the capture is always ended
    assert "graph reset" not in fake.events
    assert not any(e.endswith("freed") for e in fake.events)  # the allocator may still count the capture
    assert len(graph_mod._FAILED_POOLS) == 1


def test_a_decoder_that_never_captured_closes_without_cuda():
    with (
        torch.no_grad(),
        open_decoder(tiny_model(seed=3), random_prompts(2, seed=1), 2, PARAMS, None, CPU, **KW) as d,
    ):
        d.run(None, capture=False)
    assert d.graph is None and d.pool is None


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="watches the CUDA caching allocator: needs a CUDA GPU"
)
def test_on_a_gpu_a_captured_rollout_keeps_the_cache_and_returns_its_pool():
    device = torch.device("cuda")
    model = tiny_model(seed=3).to(device)
    prompts = random_prompts(3, seed=1)
    params = SamplingParams(max_completion_length=24, temperature=1.0, top_p=0.95)

    def rollout():
        g = torch.Generator(device=device).manual_seed(5)
        with torch.no_grad():
            static_decode(model, prompts, 4, params, g, device, capture=True, check_every=4, **KW)
        torch.cuda.synchronize()

    rollout()  # the first: whatever the step's eager warm-up caches
    cached = torch.empty(64 * MiB, dtype=torch.uint8, device=device)
    del cached  # 64 MiB the caching allocator now holds, free
    reserved = torch.cuda.memory_reserved()
    stats = torch.cuda.memory_stats()
    rollout()
    after = torch.cuda.memory_stats()
    assert torch.cuda.memory_reserved() == reserved  # the cache kept (no flush), the graph's pool handed back
    freed = after["segment.all.freed"] - stats["segment.all.freed"]
    made = after["segment.all.allocated"] - stats["segment.all.allocated"]
    assert freed == made  # what the rollout returned to the driver is its pool's own segments, no more
