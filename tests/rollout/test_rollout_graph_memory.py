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

    def __init__(
        self,
        monkeypatch,
        free_bytes: int,
        pool_bytes: int,
        fail_in_capture: bool = False,
        end_fails: str | None = None,
        syncing_step: bool = False,
        capture_raises: BaseException | None = None,
        warmup_raises: BaseException | None = None,
    ):
        """end_fails: capture_end raises, "before_routing" (as torch did before pytorch#180395: the allocator
        still routes into the pool) or "after_routing" (as torch does since); syncing_step: the step reads a
        device value on the host; capture_raises / warmup_raises: the (uncompiled) step raises that error inside
        the capture / in the warm-up."""
        self.events: list[str] = []
        self.free, self.pool_bytes, self.reserved = free_bytes, pool_bytes, 10 * MiB
        self.capturing = False
        self.routing: set[tuple] = set()  # pools the allocator counts a capture into
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
                fake.routing.add(k["pool"])

            def capture_end(self):
                _bound(torch.cuda.CUDAGraph.capture_end)(self)
                fake.capturing = False
                if end_fails == "before_routing" or fail_in_capture:
                    # an invalidated capture: torch before #180395 raised here with the routing still on
                    fake.events.append("capture_end failed")
                    raise RuntimeError("operation failed due to a previous error during capture")
                fake.routing.clear()
                if end_fails == "after_routing":
                    fake.events.append("capture_end failed")
                    raise RuntimeError("operation failed due to a previous error during capture")
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

        def end_allocate_to_pool(index, pool_id):
            if pool_id not in fake.routing:
                raise RuntimeError("endAllocatePool: not currently recording to mempool_id")
            fake.routing.discard(pool_id)
            fake.events.append("routing ended by hand")

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
                if warmup_raises is not None:
                    raise warmup_raises
                return real_advance(decoder)
            fake.events.append("step captured")  # a capture records the step's kernels; none runs
            if fail_in_capture:
                raise RuntimeError("operation not permitted when stream is capturing")
            if capture_raises is not None:
                raise capture_raises

        if syncing_step:

            def syncing(decoder):
                fake.events.append("step")
                decoder.ended.any().item()  # what a forward with a host read does
                return advance(decoder)

            monkeypatch.setattr(graph_mod, "_advance", syncing)
        else:
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
            "current_device": lambda: 0,
        }.items():
            monkeypatch.setattr(torch.cuda, name, value)
        monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", end_allocate_to_pool, raising=False)
        monkeypatch.setattr(graph_mod, "_SYNC_CHECKED", graph_mod.weakref.WeakSet())
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


def test_a_failed_capture_raises_the_steps_error_and_leaves_no_capture_counted(monkeypatch):
    """The step fails inside the capture, then torch's capture_end raises too (the capture was invalidated) with
    the allocator still routing into the pool: the step's error is the one raised, and the routing is ended."""
    model, prompts = tiny_model(seed=3), random_prompts(2, seed=1)
    fake = FakeCuda(monkeypatch, free_bytes=60 << 30, pool_bytes=MiB, fail_in_capture=True)
    with pytest.raises(graph_mod.CaptureError, match="stream is capturing") as caught:
        _captured_rollout(model, prompts, fake)
    assert isinstance(caught.value.__cause__, RuntimeError)
    events = fake.events
    assert events.index("capture_end failed") < events.index("routing ended by hand")  # always ended
    assert not fake.routing
    assert "graph reset" not in events
    assert not any(e.endswith("freed") for e in events)  # the pool is kept (once per model)
    assert len(graph_mod._FAILED_POOLS) == 1


@pytest.mark.parametrize("end_fails", ["before_routing", "after_routing"])
def test_a_capture_end_that_fails_leaves_no_capture_counted(monkeypatch, end_fails):
    model, prompts = tiny_model(seed=3), random_prompts(2, seed=1)
    fake = FakeCuda(monkeypatch, free_bytes=60 << 30, pool_bytes=MiB, end_fails=end_fails)
    with pytest.raises(graph_mod.CaptureError, match="previous error during capture"):
        _captured_rollout(model, prompts, fake)
    assert not fake.routing
    # a torch that ended the routing itself (pytorch#180395) is not asked again: its refusal is swallowed
    assert ("routing ended by hand" in fake.events) is (end_fails == "before_routing")


def test_a_step_that_syncs_with_the_host_is_refused_before_any_capture(monkeypatch):
    model, prompts = tiny_model(seed=3), random_prompts(2, seed=1)
    fake = FakeCuda(monkeypatch, free_bytes=60 << 30, pool_bytes=MiB, syncing_step=True)
    with pytest.raises(
        graph_mod.CaptureError, match=r"syncs with the host \(aten\.(item|_local_scalar_dense)\)"
    ):
        _captured_rollout(model, prompts, fake)
    assert not any(e.startswith(("capture_begin", "pool")) for e in fake.events)  # no capture, no pool
    assert fake.events.count("step") == 2  # the first warm-up step ran unwatched, the last one was watched
    assert fake.events[-1] == "wait_stream"  # the device's stream waits for the side stream even so
    assert model not in graph_mod._SYNC_CHECKED  # refused: asked again, it is watched again


def test_each_models_step_is_watched_for_host_syncs_once(monkeypatch):
    model, prompts = tiny_model(seed=3), random_prompts(2, seed=1)
    fake = FakeCuda(monkeypatch, free_bytes=60 << 30, pool_bytes=MiB)
    watched = []
    real = graph_mod.HostSyncCheck.__enter__
    monkeypatch.setattr(graph_mod.HostSyncCheck, "__enter__", lambda self: watched.append(1) or real(self))
    _captured_rollout(model, prompts, fake)
    _captured_rollout(model, prompts, fake)
    assert len(watched) == 1 and model in graph_mod._SYNC_CHECKED


def test_the_host_sync_check_sees_reads_and_copies_to_the_host_only():
    x = torch.arange(6.0)
    with graph_mod.HostSyncCheck():
        y = (x * 2).softmax(0).to(torch.float64).clone()  # device work, whatever the device: allowed
        z = torch.where(x > 2, x, 0.0).cumsum(0)
    assert y.shape == z.shape == (6,)
    reads = (lambda: x.sum().item(), lambda: bool(x.any()), lambda: x.nonzero(), lambda: x[x > 2])
    for read in (*reads, lambda: x.index_put_((x > 2,), torch.tensor(0.0))):
        with pytest.raises(graph_mod.HostSyncError, match="syncs with the host"), graph_mod.HostSyncCheck():
            read()
    assert graph_mod._to_host((torch.empty(0, device="meta"),), torch.empty(0))  # device -> CPU copy
    assert not graph_mod._to_host((torch.empty(0),), torch.empty(0, device="meta"))  # CPU -> device
    assert not graph_mod._to_host((torch.empty(0),), torch.empty(0))


@pytest.mark.parametrize(
    "op",
    [
        torch.bincount,  # its CUDA kernel reads the largest value: the output's length
        lambda x: x.float().histc(bins=4),  # without a range: the kernel reads the data's min and max
        torch.repeat_interleave,  # tensor repeats without output_size: their sum is the output's length
        lambda x: x.repeat_interleave(x, dim=0),
    ],
    ids=["bincount", "histc", "repeat_interleave", "repeat_interleave_self"],
)
def test_the_host_sync_check_sees_ops_whose_kernels_read_a_size_from_the_device(op):
    x = torch.tensor([1, 2, 1])
    with pytest.raises(graph_mod.HostSyncError, match="syncs with the host"), graph_mod.HostSyncCheck():
        op(x)


def test_the_host_sync_check_passes_those_ops_given_their_sizes():
    x = torch.tensor([1, 2, 1])
    with graph_mod.HostSyncCheck():
        x.float().histc(bins=4, min=0, max=3)
        x.repeat_interleave(x, dim=0, output_size=4)
        x.repeat_interleave(2)  # int repeats: an expand


def test_on_a_gpu_the_host_sync_check_passes_reads_of_cpu_tensors():
    """A CPU tensor's `.item()` makes the host wait for nothing; the same read of a device tensor (meta stands in
    for the GPU) is refused. On a CPU (the tests' step) every read counts: see the test above."""
    x = torch.tensor([1.0, 3.0, 0.0])
    on_device = torch.empty(3, device="meta")
    reads = (
        lambda t: t.sum().item(),
        lambda t: bool(t.any()),
        lambda t: t.nonzero(),
        lambda t: t[t > 2],
        lambda t: torch.bincount(t.long()),
    )
    with graph_mod.HostSyncCheck(torch.device("cuda")):
        for read in reads:
            read(x)
    for read in reads:
        with (
            pytest.raises(graph_mod.HostSyncError, match="syncs with the host"),
            graph_mod.HostSyncCheck(torch.device("cuda")),
        ):
            read(on_device)


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


def test_the_engine_decodes_eagerly_after_a_failed_capture_and_raises_anything_else(monkeypatch):
    """Only a failure to capture turns the captured step off (under auto, with one warning) and decodes the rollout
    eagerly; an error of the rollout itself (a replay, or the caller's on_finished) is raised: decoding it again
    would tell on_finished of the same rows twice."""
    from cohort.rollout import builtin as builtin_mod
    from cohort.rollout.builtin import BuiltinEngine

    model, prompts = tiny_model(seed=3), random_prompts(2, seed=1)
    engine = BuiltinEngine(eos_token_ids=[EOS], pad_token_id=PAD)
    want = engine.sample(model, prompts, 3, PARAMS, torch.Generator().manual_seed(7), CPU)  # eager
    # as on a GPU whose probe passed
    monkeypatch.setattr(BuiltinEngine, "takes_captured_step", lambda self, *a: True)
    monkeypatch.setattr(BuiltinEngine, "compiles_captured_step", lambda self, *a: False)
    monkeypatch.setattr(builtin_mod, "_GRAPH_FAILED", builtin_mod.weakref.WeakSet())

    def fails(error):
        def static_decode(*a, **k):
            raise error

        return static_decode

    monkeypatch.setattr(builtin_mod, "static_decode", fails(graph_mod.CaptureError("stream is capturing")))
    g = torch.Generator().manual_seed(7)
    with pytest.warns(UserWarning, match=r"'graph_decode' off: capture failed \(stream is capturing\)"):
        got = engine.sample(model, prompts, 3, PARAMS, g, CPU)
    assert torch.equal(got.tokens, want.tokens) and torch.equal(got.logprobs, want.logprobs)
    assert model in builtin_mod._GRAPH_FAILED
    monkeypatch.setattr(builtin_mod, "_GRAPH_FAILED", builtin_mod.weakref.WeakSet())
    monkeypatch.setattr(builtin_mod, "static_decode", fails(RuntimeError("a reward prefetch failed")))
    with pytest.raises(RuntimeError, match="a reward prefetch failed"):
        engine.sample(model, prompts, 3, PARAMS, torch.Generator().manual_seed(7), CPU)
    assert model not in builtin_mod._GRAPH_FAILED


def _takes_the_captured_step(monkeypatch):
    """Returns BuiltinEngine's module, its engines taking the uncompiled captured step as on a GPU whose probe
    passed, no capture failed before."""
    from cohort.rollout import builtin as builtin_mod

    monkeypatch.setattr(builtin_mod.BuiltinEngine, "takes_captured_step", lambda self, *a: True)
    monkeypatch.setattr(builtin_mod.BuiltinEngine, "compiles_captured_step", lambda self, *a: False)
    monkeypatch.setattr(builtin_mod, "_GRAPH_FAILED", builtin_mod.weakref.WeakSet())
    return builtin_mod


def test_running_out_of_memory_in_the_capture_decodes_eagerly_under_auto_and_is_named_under_on(monkeypatch):
    """While a capture is under way the allocator cannot hand other cached blocks back to the driver, so a capture
    may run out of memory where the eager step would not: under auto the rollout decodes eagerly (the cache
    emptied first, once the capture has ended), under on the error says so."""
    from cohort.fastpath import FastConfig, FastPathError
    from cohort.rollout.builtin import BuiltinEngine

    model, prompts = tiny_model(seed=3), random_prompts(2, seed=1)
    params = SamplingParams(max_completion_length=12, greedy=True)  # the warm-up draws nothing
    want = BuiltinEngine(eos_token_ids=[EOS], pad_token_id=PAD).sample(model, prompts, 3, params, None, CPU)
    engine = _takes_the_captured_step(monkeypatch).BuiltinEngine(eos_token_ids=[EOS], pad_token_id=PAD)
    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    fake = FakeCuda(monkeypatch, free_bytes=60 << 30, pool_bytes=MiB, capture_raises=oom)
    with pytest.warns(
        UserWarning, match=r"capture failed \(ran out of memory during the capture.*graph_decode=off"
    ):
        got = engine.sample(model, prompts, 3, params, None, CPU)
    assert torch.equal(got.tokens, want.tokens) and torch.equal(got.logprobs, want.logprobs)
    assert got.paths["graph_decode"] is False
    assert (
        fake.events.index("step captured")
        < fake.events.index("capture_end")
        < fake.events.index("empty_cache")
    )
    assert not fake.routing

    on = _takes_the_captured_step(monkeypatch).BuiltinEngine(
        eos_token_ids=[EOS], pad_token_id=PAD, fast=FastConfig(graph_decode="on")
    )
    with pytest.raises(
        FastPathError, match=r"graph_decode=on.*ran out of memory during the capture.*2.00 GiB"
    ):
        on.sample(model, prompts, 3, params, None, CPU)


def test_running_out_of_memory_in_the_warm_up_is_raised_as_it_is(monkeypatch):
    # The eager step would need that memory too: no capture began, nothing to fall back from.
    model, prompts = tiny_model(seed=3), random_prompts(2, seed=1)
    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    fake = FakeCuda(monkeypatch, free_bytes=60 << 30, pool_bytes=MiB, warmup_raises=oom)
    with pytest.raises(torch.OutOfMemoryError) as caught:
        _captured_rollout(model, prompts, fake)
    assert caught.value is oom
    assert not any(e.startswith("capture_begin") for e in fake.events)


def test_a_compiled_step_that_fails_inside_the_capture_fails_the_capture_with_its_own_error(monkeypatch):
    """Only a call that would trace anew (torch's RecompileError, raised before any kernel) runs the eager step
    in a capture: any other error of the compiled step is the capture's failure, its message kept, the compile
    not marked as failed, and the eager step not run inside the invalidated capture (its in-place updates would
    be recorded a second time)."""
    from cohort.fastpath import compiled

    fake = FakeCuda(monkeypatch, free_bytes=60 << 30, pool_bytes=MiB, end_fails="before_routing")

    def backend(gm, example_inputs):
        def run(*args):
            if fake.capturing:
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            return gm.forward(*args)

        return run

    monkeypatch.setattr(compiled, "BACKEND", backend)
    eager_calls = []
    real = graph_mod.DECODE_STEP.fn
    graph_mod.DECODE_STEP.compiled()  # compiles the real step; the fallback then goes through the spy
    monkeypatch.setattr(graph_mod.DECODE_STEP, "fn", lambda *a: eager_calls.append(1) or real(*a))
    model, prompts = tiny_model(seed=3), random_prompts(2, seed=1)
    torch._dynamo.reset()
    try:
        g = torch.Generator().manual_seed(7)
        with (
            torch.inference_mode(),
            open_decoder(model, prompts, 3, PARAMS, g, CPU, compiled=True, **KW) as decoder,
        ):
            with pytest.raises(graph_mod.CaptureError, match="illegal memory access") as caught:
                decoder.run(g, capture=True, check_every=4)
            assert int(decoder.plan.step) == 2  # the two warm-up steps only
    finally:
        torch._dynamo.reset()
    assert isinstance(caught.value.__cause__, RuntimeError)
    assert "step captured" not in fake.events  # the compiled step, not the (patched) eager one, was captured
    assert graph_mod.DECODE_STEP.failed(model) is None
    assert not eager_calls
    assert not fake.routing


@pytest.mark.skipif(not torch.cuda.is_available(), reason="captures on a CUDA GPU: needs one")
def test_on_a_gpu_a_syncing_step_is_refused_and_a_failed_capture_leaves_the_allocator_whole(monkeypatch):
    """A step that reads a device value on the host is refused by the check before any capture; with the check
    passed by (as for a sync it cannot see), the capture fails, and afterwards a capture still hands its pool back
    and empty_cache still returns cached memory (torch before pytorch#180395 left the failed capture counted, and
    freeing the next pool aborted the process)."""
    device = torch.device("cuda")
    model = tiny_model(seed=3).to(device)
    prompts = random_prompts(2, seed=1)
    params = SamplingParams(max_completion_length=8, temperature=1.0)
    real = graph_mod._advance

    def syncing(decoder):
        decoder.ended.any().item()
        return real(decoder)

    def rollout():
        g = torch.Generator(device=device).manual_seed(5)
        with torch.no_grad():
            return static_decode(model, prompts, 2, params, g, device, capture=True, check_every=4, **KW)

    monkeypatch.setattr(graph_mod, "_SYNC_CHECKED", graph_mod.weakref.WeakSet())
    monkeypatch.setattr(graph_mod, "_advance", syncing)
    with pytest.raises(graph_mod.CaptureError, match="syncs with the host"):
        rollout()
    graph_mod._SYNC_CHECKED.add(model)  # the check passed by: the capture itself fails
    with pytest.raises(graph_mod.CaptureError):
        rollout()
    monkeypatch.setattr(graph_mod, "_advance", real)
    tokens = rollout()[0]  # captured, replayed, its pool freed at the end
    torch.cuda.synchronize()
    assert tokens.shape == (4, 8)
    block = torch.empty(64 * MiB, dtype=torch.uint8, device=device)
    del block
    cached = torch.cuda.memory_reserved()
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved() < cached  # the allocator counts no capture under way
