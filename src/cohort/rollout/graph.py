"""The builtin engine's decode step written with fixed shapes, captured once per rollout as a CUDA graph and
replayed (`fast.graph_decode`).

At a Qwen2.5-0.5B size a decode step is about 1,300 small kernels, each launched from Python: on a GPU the host,
not the device, sets the pace (32 ms a step on an H200, against a bandwidth floor near 0.5 ms). A captured step
launches them all at once. Capture needs a step that Python does not steer: every shape fixed, every changing
number a device tensor, no host sync. So the static step:

- feeds the last token of every row (`tok`, `pos`: device buffers) through the model, whose cache layers
  (`cohort.fastpath.kv_cache.StepLayer`) write at the device index `step` into buffers of all T own positions,
  and whose attention (`cohort.fastpath.attention.StepPlan`) reads the prompt's keys once per group (or once per
  row where the prompt is not shared) plus the row's own keys, the unwritten ones masked;
- samples inside the step: temperature, top-k / top-p, and the draw as the exponential race
  argmax(p / q) with q ~ Exp(1) drawn into a buffer *outside* the graph (`noise.exponential_(generator=g)`, one
  launch a step). That race is what `torch.multinomial` itself computes for one sample (tokens and generator
  state equal), so the captured engine draws what today's eager one draws on a GPU;
- records token and log-prob at column `step + 1` (pad and 0 once a row has ended), EOS on the device (lengths,
  ended flags), then advances `pos` and `step`.

Rows are never dropped (no compaction: below a few hundred rows the weights, not the rows, set the device's cost),
and the host learns that every row has ended from a copy made every `graph_decode_check_every` steps without
blocking and read at the next check, so the loop runs at most twice that many steps past the last EOS (those steps
write pad).

Under autocast, each Linear's weight and bias are cast once per rollout to the autocast dtype and handed to the
forward with `torch.func.functional_call` (`cast_linears`): the graph holds no weight casts, and the result is
bitwise what autocast computes (autocast rounds the same way, and leaves a tensor already in its dtype alone).
For the same reason the step casts each other tensor a product reads once, where autocast would cast it inside
every product: the prompt's keys and the own keys' buffers are held in autocast's dtype (`StepPlan.narrow`), the
query and the attention probabilities are cast once, and the Linears that read one tensor share its cast
(`shared_input_casts`): 5 casts a layer where autocast made 11, every value the same.

The graph is captured anew every rollout, so updated weights, LoRA adapters and a sampling copy stay current.
Its memory is a pool of its own (`torch.cuda.MemPool`), handed back to the driver when the rollout ends; unlike
`torch.cuda.graph`, a capture leaves the caching allocator's other blocks cached (`capture_needs_room` says when
it must not).

With `fast.compile_decode` the step (forward, sampler and bookkeeping) is traced once by `torch.compile` with
dynamic sizes and the generated kernels are what the graph captures: a captured step has no host work left, but
at 0.5B it is still ~1,300 kernels of a few microseconds each, most of them elementwise work that fusing removes.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from cohort.errors import first_line
from cohort.fastpath.attention import StepPlan, attach_step_plan, plan_attention, plan_carrier
from cohort.fastpath.compiled import Compiled
from cohort.fastpath.kv_cache import preallocated_cache, step_cache
from cohort.models import cache_kwargs, float_dtype, forward_accepts, text_config
from cohort.rollout.base import SamplingParams, left_pad, prefill
from cohort.rollout.casts import autocast_dtype, cast_linears, shared_input_casts
from cohort.rollout.sampling import drawable, filter_logits


def race_sample(
    logits: torch.Tensor, params: SamplingParams, noise: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (tokens [n] long, log-probs [n] float32) for logits [n, V], drawn as argmax(p / noise) with noise
    [n, V] ~ Exp(1) (unused when greedy); the log-prob is before top-k / top-p filtering, as in sample_next."""
    logits = logits.float()  # [n, V]
    if params.greedy:
        tokens = logits.argmax(dim=-1)  # [n]
        return tokens, torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
    assert noise is not None
    scaled = logits / params.temperature if params.temperature != 1.0 else logits  # [n, V]
    logp_all = torch.log_softmax(scaled, dim=-1)  # [n, V]
    if 0 < params.top_k < logits.shape[-1] or params.top_p < 1.0:
        probs = filter_logits(scaled, params.top_k, params.top_p).softmax(dim=-1)  # [n, V]
    else:
        probs = logp_all.exp()  # [n, V]
    tokens = (drawable(probs) / noise).argmax(dim=-1)  # [n]; multinomial's one-sample draw, without its sync
    return tokens, logp_all.gather(-1, tokens[:, None]).squeeze(-1)


class StaticDecoder:
    """One rollout's static decode state (fixed-shape device buffers) and its step, run eagerly or captured.

    Built from the prefill: `prompt_kv` per layer [B', Hkv, P, D] (B' = B with a shared prefix, N = B*G without),
    `prompt_mask` [B', P], `first` the tokens and log-probs of column 0 [N], `pos` [N] the position of column 0's
    token, `noise` the [N, V] buffer the draws go through (None: greedy), `weights` what `cast_linears` gave,
    `low` the autocast dtype the step runs under (None: no autocast), `forget_casts` what `shared_input_casts`
    yielded. `step()` decodes one more column of every row; `run()` decodes the rollout."""

    def __init__(
        self,
        model: torch.nn.Module,
        prompt_kv: list[tuple[torch.Tensor, torch.Tensor]],
        prompt_mask: torch.Tensor,
        first: tuple[torch.Tensor, torch.Tensor],
        pos: torch.Tensor,
        params: SamplingParams,
        eos_token_ids: list[int],
        pad_token_id: int,
        noise: torch.Tensor | None = None,
        weights: dict[str, torch.Tensor] | None = None,
        compiled: bool = False,
        low: torch.dtype | None = None,
        forget_casts: Callable[[], None] | None = None,
    ) -> None:
        self.model, self.params, self.pad = model, params, pad_token_id
        self.weights = weights or {}
        self.compiled = compiled
        T = params.max_completion_length
        tok0, lp0 = first
        N, device = tok0.shape[0], tok0.device
        self.T, self.device = T, device
        self.plan = StepPlan(prompt_kv, prompt_mask, T, width=N // prompt_kv[0][0].shape[0])
        if low is not None:
            self.plan.narrow(low)  # the own keys' buffers take the narrowed prompt keys' dtype below
        self.carrier = plan_carrier(device, self.plan)
        self.cache = step_cache(getattr(model, "config", None), N, T, self.plan.prompt_kv, self.plan.step)
        self.eos = torch.tensor(eos_token_ids, dtype=torch.long, device=device)  # [E]
        self.tokens = torch.full((N, T), pad_token_id, dtype=torch.long, device=device)  # [N, T]
        self.logps = torch.zeros(N, T, dtype=torch.float32, device=device)  # [N, T]
        self.lengths = torch.full((N,), T, dtype=torch.long, device=device)  # [N]
        self.ended = torch.zeros(N, dtype=torch.bool, device=device)  # [N]
        self.tok = tok0.clone()  # [N] the token fed next
        self.pos = pos.clone()  # [N] its position
        self.noise = None if params.greedy else noise  # [N, V]
        self.tokens[:, 0] = tok0
        self.logps[:, 0] = lp0
        self._record(tok0, self.plan.step)  # column 0: EOS from the prefill's own sample
        self.graph: torch.cuda.CUDAGraph | None = None
        self.pool: Any = None  # torch.cuda.MemPool of the captured graph
        self.forget_casts = forget_casts  # see shared_input_casts
        # Known before the first step, so that no step (nor its trace) asks the model's signature again. The
        # ids and positions are views taken inside the step: a view made outside would reach a compiled step as
        # a second input aliasing a buffer it writes.
        self.inputs: dict[str, Any] = {"attention_mask": self.carrier, **cache_kwargs(model, self.cache)}
        if forward_accepts(model, "logits_to_keep"):
            self.inputs["logits_to_keep"] = 1
        if compiled:
            self._mark_dynamic_sizes()

    def _mark_dynamic_sizes(self) -> None:
        """Marks for torch.compile the sizes that change from one rollout to the next (rows, prompts, prompt length,
        new tokens), and only those. With every size dynamic (dynamic=True), sizes equal on the first call share a
        symbol: 2 prompts and 2 KV heads tied the batch to the head count, a new trace for every other batch."""
        plan = self.plan
        sizes: list[tuple[torch.Tensor | None, tuple[int, ...]]] = [
            (self.tok, (0,)), (self.pos, (0,)), (self.lengths, (0,)), (self.ended, (0,)), (self.noise, (0,)),
            (self.tokens, (0, 1)), (self.logps, (0, 1)),
            (plan.columns, (0,)), (plan.bias, (0, 3)),
        ]  # fmt: skip
        for k, v in plan.prompt_kv:
            sizes += [(k, (0, 2)), (v, (0, 2))]
        for layer in self.cache.layers:
            keys, values = _filled(layer)
            sizes += [(keys, (0, 2)), (values, (0, 2))]
        for t, dims in sizes:
            if t is None:
                continue
            for d in dims:
                torch._dynamo.maybe_mark_dynamic(t, d)
            base = t._base
            if base is not None and base.dim() == t.dim():  # a view of the same rank (a buffer's filled part)
                for d in dims:
                    torch._dynamo.maybe_mark_dynamic(base, d)

    def _record(self, tok: torch.Tensor, column: torch.Tensor) -> None:
        hit = (tok[:, None] == self.eos[None, :]).any(-1) & ~self.ended  # [N]
        self.lengths.copy_(torch.where(hit, column + 1, self.lengths))
        self.ended.logical_or_(hit)

    def step(self, *, recompile: bool = True) -> None:
        """Decodes one column for every row in place: no host sync, no shape or Python value that changes.
        Compiled (`compiled`), unless compiling failed for this model; recompile=False: a call that would trace
        anew runs the eager step instead (a CUDA graph capture cannot compile)."""
        if self.compiled:
            DECODE_STEP.call(self.model, self, recompile=recompile)
        else:
            _advance(self)
        if self.forget_casts is not None:
            self.forget_casts()  # a step's temporaries (a capture's, in its graph's pool) are not held after it

    def compiled_ran(self) -> bool:
        """Returns whether the step ran compiled (asked for and not failed for this model)."""
        return self.compiled and DECODE_STEP.failed(self.model) is None

    def draw_noise(self, generator: torch.Generator | None) -> None:
        """Fills the noise buffer with Exp(1) draws from `generator` (outside any graph; nothing when greedy)."""
        if self.noise is not None:
            self.noise.exponential_(1, generator=generator)

    def capture(self, warmup: int = 2, generator: torch.Generator | None = None) -> int:
        """Returns how many real steps ran as warm-up (on a side stream) before the step was captured."""
        device = self.device
        stream = capture_stream(device)
        current = torch.cuda.current_stream(device)
        stream.wait_stream(current)
        graph = torch.cuda.CUDAGraph()
        with contextlib.ExitStack() as scope:
            if torch.is_autocast_enabled("cuda"):
                # autocast's cast cache would hand the graph tensors freed when the capture's autocast ends; the
                # warm-up runs under the same setting, so a compiled step's trace serves the capture unchanged
                dtype = torch.get_autocast_dtype("cuda")
                scope.enter_context(torch.autocast("cuda", dtype=dtype, cache_enabled=False))
            try:
                with torch.cuda.stream(stream):
                    for i in range(warmup):
                        self.draw_noise(generator)
                        # Once per model, the last warm-up step (never one that compiles) is watched for host
                        # syncs: a capture that one breaks leaves the allocator counting a capture under way in
                        # torch releases without the fix of pytorch#180395, which later aborts the process.
                        watch = i == warmup - 1 and not self.compiled and self.model not in _SYNC_CHECKED
                        with HostSyncCheck(device) if watch else contextlib.nullcontext():
                            self.step()
                        if watch:
                            _SYNC_CHECKED.add(self.model)
            finally:
                # even after a failed step: the side stream's work on these buffers is done before they are reused
                current.wait_stream(stream)
            # Not torch.cuda.graph: it empties the allocator's whole cache (and the pinned host cache) before every
            # capture, so each rollout handed back, and the update then asked the driver again for, every block
            # the step's other work had cached (~380 cudaMalloc and cudaFree a GRPO step on an H200). The cache is
            # emptied only where the device may lack room for the graph's memory (a capture cannot reclaim it).
            span, config = self.plan.bias.shape[-1], text_config(self.model)
            heads = int(getattr(config, "num_attention_heads", 0) or 0)
            vocab = int(getattr(config, "vocab_size", 0) or 0)
            estimate = max(
                _POOL_BYTES.get(device, 0), pool_estimate(self.tokens.shape[0], vocab, heads, span)
            )
            if capture_needs_room(torch.cuda.mem_get_info(device)[0], estimate):
                torch.cuda.empty_cache()
            with torch.cuda.device(device):
                self.pool = torch.cuda.MemPool()  # this rollout's graph memory, handed back by close()
            before = torch.cuda.memory_reserved(device)
            try:
                with torch.cuda.stream(stream):
                    self._capture_step(graph, device)
            except torch.OutOfMemoryError as e:
                # While a capture is under way the allocator frees only its own pool's cached blocks, never the
                # others': a capture can run short where the eager step, which may free them, would not. The
                # capture has ended (its routing too), so the cache goes back to the driver for the eager step.
                torch.cuda.empty_cache()
                raise CaptureError(
                    "ran out of memory during the capture; lower the rollout batch or set fast.graph_decode=off "
                    f"({first_line(e)})"
                ) from e
            _POOL_BYTES[device] = torch.cuda.memory_reserved(device) - before
        self.graph = graph
        return warmup

    def _capture_step(self, graph: Any, device: torch.device) -> None:
        """Returns None once one step is captured into `graph` (into this rollout's pool); a capture that fails is
        ended, and the allocator routes into the pool no longer, before its error is raised."""
        # thread_local: CUDA work of another thread (a prefetching loader, say) does not break it
        graph.capture_begin(pool=self.pool.id, capture_error_mode="thread_local")
        try:
            self.step(recompile=False)
        except BaseException:
            _abandon_capture(graph, self.pool, device)  # the step's error is the one raised
            raise
        try:
            graph.capture_end()
        except BaseException:
            _end_pool_routing(self.pool, device)
            raise

    def close(self) -> None:
        """Releases the captured graph, then its memory pool, once the device has run every replay (the pool's
        blocks go back to the driver: nothing is held between rollouts)."""
        graph, pool = self.graph, self.pool
        self.graph = self.pool = None
        if pool is None:
            return
        if graph is None:
            # the capture failed: the allocator may still count it as a user of the pool, which a freed pool's
            # check would then abort on; the pool is kept (what the failed capture allocated; once per model)
            _FAILED_POOLS.append(pool)
            return
        torch.cuda.current_stream(self.device).synchronize()
        graph.reset()
        del graph, pool

    def run(
        self,
        generator: torch.Generator | None,
        *,
        capture: bool,
        check_every: int = 8,
        on_finished: Callable[[int, list[int]], None] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns (tokens [N, T], lengths [N], ended-with-EOS [N] bool, log-probs [N, T]) after decoding every
        column (captured and replayed when `capture`, else the same step called eagerly), stopping at most
        2 * `check_every` steps after the last row ended; on_finished hears each EOS row at most as late."""
        done_steps = 1  # column 0 came from the prefill
        if capture and self.T > 1:
            try:
                done_steps += self.capture(warmup=min(2, self.T - 1), generator=generator)
            except CaptureError:
                raise  # running out of memory in the capture itself (see capture)
            except torch.OutOfMemoryError:
                raise  # in the warm-up, not the capture's fault: the eager step would need the memory too
            except Exception as e:  # noqa: BLE001 - any failure to capture: the caller may decode eagerly
                raise CaptureError(str(e)) from e
        flag = torch.zeros(1, dtype=torch.bool, pin_memory=self.device.type == "cuda")
        pending: tuple[torch.Tensor, ...] | None = None
        heard = torch.zeros_like(self.ended, device="cpu")
        event = None
        while done_steps < self.T:
            if done_steps % check_every == 0:
                if event is not None:
                    event.synchronize()  # the copy of check_every steps ago: long finished
                    if on_finished is not None and pending is not None:
                        heard = self._tell(pending, heard, on_finished)
                    if bool(flag[0]):
                        break
                flag.copy_(self.ended.all().view(1), non_blocking=True)
                if on_finished is not None:
                    pending = (
                        self.ended.to("cpu", non_blocking=True),
                        self.lengths.to("cpu", non_blocking=True),
                    )
                event = torch.cuda.Event() if self.device.type == "cuda" else _Done()
                # on the decoding device's stream, where the copies above were queued (not the current device's)
                event.record(torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None)
            self.draw_noise(generator)
            if self.graph is not None:
                self.graph.replay()
            else:
                self.step()
            done_steps += 1
        if on_finished is not None:
            self._tell((self.ended.cpu(), self.lengths.cpu()), heard, on_finished)
        return self.tokens, self.lengths, self.ended, self.logps

    def _tell(self, snapshot, heard: torch.Tensor, on_finished) -> torch.Tensor:
        ended, lengths = snapshot  # on the CPU
        rows = (ended & ~heard).nonzero().flatten()  # [F] rows newly heard to end
        if rows.numel():
            # one copy of every newly ended row's tokens: a read per row made the host wait on the device per row
            width = int(lengths[rows].max())
            tokens = self.tokens[:, :width].index_select(0, rows.to(self.device)).cpu()  # [F, width]
            for i, row in enumerate(rows.tolist()):
                on_finished(row, tokens[i, : int(lengths[row])].tolist())
        return heard | ended


def _advance(decoder: StaticDecoder) -> None:
    """Decodes one column of every row of `decoder` in place (the step itself, compiled or not)."""
    plan = decoder.plan
    plan.refresh()
    inputs = {"input_ids": decoder.tok[:, None], "position_ids": decoder.pos[:, None], **decoder.inputs}
    if decoder.weights:
        out = torch.func.functional_call(
            decoder.model, decoder.weights, (), inputs, strict=False, tie_weights=False
        )
    else:
        out = decoder.model(**inputs)
    logits = out.logits[:, -1, :]  # [N, V]
    tok, lp = race_sample(logits, decoder.params, decoder.noise)
    column = (plan.step + 1).view(1, 1).expand(tok.shape[0], 1)  # [N, 1]
    done = decoder.ended[:, None]  # [N, 1] rows that ended before this column write pad
    decoder.tokens.scatter_(1, column, torch.where(done, decoder.pad, tok[:, None]))
    decoder.logps.scatter_(1, column, torch.where(done, 0.0, lp[:, None]))
    decoder._record(tok, plan.step + 1)
    decoder.tok.copy_(tok)
    decoder.pos.add_(1)
    plan.step.add_(1)


_STREAMS: dict[tuple[torch.device, int], Any] = {}


def capture_stream(device: torch.device) -> Any:
    """Returns the side stream this thread warms up and captures on for `device`, the same one every rollout.
    The caching allocator keeps a freed block for reuse on the stream that freed it: a new stream each rollout
    would leave a step's worth of cached blocks behind on each of the streams torch cycles through."""
    key = (device, threading.get_ident())
    if key not in _STREAMS:
        _STREAMS[key] = torch.cuda.Stream(device)
    return _STREAMS[key]


class CaptureError(RuntimeError):
    """Capturing the decode step failed (the message is the cause's): the rollout may be decoded eagerly."""


class HostSyncError(RuntimeError):
    """The decode step made the host wait for the device, which a captured graph cannot hold."""


class HostSyncCheck(TorchDispatchMode):
    """Raises HostSyncError at an op that makes the host wait for the device: a value read by the host (`.item()`,
    `bool(t)`, `t.tolist()`), an output whose size depends on values (nonzero, masked_select, unique, bincount,
    repeat_interleave without output_size, histc without a range: their CUDA kernels read a count or a bound), a
    copy from a device to the CPU. Checked before the first capture of each model, so that such a forward is
    refused without a capture failing.

    device: the device the step decodes on. On a CPU (or None) every read counts, so that a CPU test sees the reads
    the step would make on a GPU; on a GPU, reading a CPU tensor makes the host wait for nothing and passes."""

    SYNCS = frozenset(
        {"_local_scalar_dense", "item", "is_nonzero", "equal", "nonzero", "masked_select", "bincount"}
        | {"_unique", "_unique2", "unique_dim", "unique_consecutive"}
    )
    INDEXING = frozenset({"index", "index_put", "index_put_", "_index_put_impl_"})
    """Ops that sync when indexed by a boolean mask (t[mask], t[mask] = v: the mask's nonzero)."""

    def __init__(self, device: torch.device | None = None) -> None:
        super().__init__()
        self.cpu_counts = device is None or device.type == "cpu"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        kwargs = kwargs or {}
        syncs = name in self.SYNCS or _sizes_from_values(name, args, kwargs)
        if (syncs or (name in self.INDEXING and _masks(args))) and (self.cpu_counts or _on_device(args)):
            raise HostSyncError(
                f"the decode step syncs with the host (aten.{name}), which a CUDA graph cannot hold"
            )
        out = func(*args, **kwargs)
        if name in ("_to_copy", "copy_", "_copy_from") and _to_host(args, out):
            raise HostSyncError(
                f"the decode step copies a device tensor to the CPU (aten.{name}), which a CUDA graph cannot hold"
            )
        return out


def _sizes_from_values(name: str, args: tuple, kwargs: dict) -> bool:
    """Returns whether an op that syncs only for some arguments does here: repeat_interleave with tensor repeats
    and no output_size (the output's length is their sum), histc without a range (bounds from the data's own min
    and max); int repeats never reach this op (they expand)."""
    if name == "repeat_interleave":
        return kwargs.get("output_size") is None
    if name == "histc":
        low = args[2] if len(args) > 2 else kwargs.get("min", 0)
        high = args[3] if len(args) > 3 else kwargs.get("max", 0)
        return low == high
    return False


def _on_device(args: tuple) -> bool:
    """Returns whether an op's arguments (tensors, or lists of them: indices) hold a tensor off the CPU."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    tensors += [i for a in args if isinstance(a, (list, tuple)) for i in a if isinstance(i, torch.Tensor)]
    return any(t.device.type != "cpu" for t in tensors)


def _masks(args: tuple) -> bool:
    """Returns whether an indexing op's indices (its second argument) hold a boolean or byte mask."""
    indices = args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else ()
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices)


def _to_host(args: tuple, out: Any) -> bool:
    """Returns whether a copy op moved a non-CPU tensor's values into a CPU tensor."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    dst = out if isinstance(out, torch.Tensor) else None
    return dst is not None and dst.device.type == "cpu" and any(t.device.type != "cpu" for t in tensors)


_SYNC_CHECKED: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
"""Models whose decode step HostSyncCheck has watched (once each)."""


def _abandon_capture(graph: Any, pool: Any, device: torch.device) -> None:
    """Ends a capture whose step failed (its own error, usually an invalidated capture's, is dropped: the step's is
    the one to report) and stops the allocator routing into the pool."""
    try:
        graph.capture_end()
    except Exception:  # noqa: BLE001 - expected after a failed step
        pass
    _end_pool_routing(pool, device)


def _end_pool_routing(pool: Any, device: torch.device) -> None:
    """Returns None once the caching allocator no longer counts a capture into `pool` as under way. torch's
    capture_end raised before ending it when the capture had failed, until pytorch#180395 (April 2026); left
    counted, every later empty_cache frees nothing and freeing any pool aborts the process."""
    end = getattr(torch._C, "_cuda_endAllocateToPool", None)
    if end is None:
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    try:
        end(index, pool.id)
    except Exception:  # noqa: BLE001 - "not currently recording": torch ended it itself
        pass


_POOL_BYTES: dict[torch.device, int] = {}
"""Bytes the last captured step's memory pool took on each device (what the next capture is assumed to need)."""
_FAILED_POOLS: list[Any] = []
"""Memory pools of captures that failed, kept rather than freed (see StaticDecoder.close)."""


def pool_estimate(rows: int, vocab: int, heads: int, span: int) -> int:
    """Returns a first guess, in bytes, of a captured step's memory pool: the larger of the sampler's [rows, vocab]
    float32 temporaries (the float logits, log-softmax, probabilities, a top-p sort's values and indices: ~8 of
    them) and a layer's attention scores [rows, heads, span] (~4 float32 copies: scores, masked, softmax, cast)."""
    return max(32 * rows * vocab, 16 * rows * heads * span)


def capture_needs_room(free_bytes: int, estimate: int) -> bool:
    """Returns whether to empty the allocator's cache before capturing: the device's free memory is under twice
    the graph's estimated pool plus 256 MiB. While a capture is under way the allocator may not hand cached blocks
    back to the driver, so a capture short of memory fails where an eager step would have reclaimed them."""
    return free_bytes < 2 * estimate + (256 << 20)


DECODE_STEP = Compiled(_advance, "compile_decode", "the decode step", dynamic=None)
"""The step through torch.compile, the sizes that change between rollouts marked dynamic (_mark_dynamic_sizes): one
trace serves rollouts of every prompt length, batch and length (a new G, autocast, dtype or greedy setting traces
once more, and so does a size of 1: one prompt)."""


class _Done:
    """Stands for a CUDA event on a CPU, where every copy has already happened."""

    def record(self, stream: Any = None) -> None:
        """Returns None (nothing to record)."""

    def synchronize(self) -> None:
        """Returns None (nothing to wait for)."""


def _filled(layer: Any) -> tuple[torch.Tensor, torch.Tensor]:
    return layer.keys, layer.values


@contextlib.contextmanager
def open_decoder(
    model: torch.nn.Module,
    prompt_ids: list[list[int]],
    group_size: int,
    params: SamplingParams,
    generator: torch.Generator | None,
    device: torch.device,
    *,
    eos_token_ids: list[int],
    pad_token_id: int,
    shared: bool,
    compiled: bool = False,
) -> Iterator[StaticDecoder]:
    """Yields the StaticDecoder of G samples per prompt after the prefill and column 0, with cohort's attention
    selected and, under autocast, the Linear weights cast (both undone on exit). shared: the G samples of a
    prompt read one copy of its prompt's keys (else each row its own copy)."""
    G = group_size
    input_ids, attn = left_pad(prompt_ids, pad_token_id, device)  # [B, P]
    cache = preallocated_cache(getattr(model, "config", None), input_ids.shape[1])
    logits = prefill(model, input_ids, attn, cache).repeat_interleave(G, dim=0)  # [N, V]
    # [B, Hkv, P, D] each (full-attention layers only: graph_decode is unavailable for any other kind)
    prompt_kv = [_filled(layer) for layer in cache.layers]
    prompt_mask = attn
    if not shared and G > 1:
        prompt_kv = [(k.repeat_interleave(G, dim=0), v.repeat_interleave(G, dim=0)) for k, v in prompt_kv]
        prompt_mask = attn.repeat_interleave(G, dim=0)  # [N, P]
    pos = attn.sum(-1).repeat_interleave(G)  # [N]
    with continue_decoder(
        model,
        prompt_kv,
        prompt_mask,
        logits,
        pos,
        params,
        generator,
        device,
        eos_token_ids=eos_token_ids,
        pad_token_id=pad_token_id,
        compiled=compiled,
    ) as decoder:
        yield decoder


@contextlib.contextmanager
def continue_decoder(
    model: torch.nn.Module,
    prompt_kv: list[tuple[torch.Tensor, torch.Tensor]],
    prompt_mask: torch.Tensor,
    logits: torch.Tensor,
    pos: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
    device: torch.device,
    *,
    eos_token_ids: list[int],
    pad_token_id: int,
    compiled: bool = False,
    weights: dict[str, torch.Tensor] | None = None,
) -> Iterator[StaticDecoder]:
    """Yields the StaticDecoder that continues N rows from keys and values already cached: `prompt_kv` per layer
    [B', Hkv, P, D] (B' = N, or the prompts of groups of N / B' rows), `prompt_mask` [B', P] (0: a position no
    row reads, padding or a hole), `logits` [N, V] the next-token logits (column 0 is sampled from them) and `pos`
    [N] the position of column 0. Cohort's attention is selected and, under autocast, the Linear weights cast (or
    `weights`, cast already) for the block."""
    noise = None
    if not params.greedy:  # [N, V] float32, as multinomial draws it for float32 probabilities
        noise = torch.empty(logits.shape, dtype=torch.float32, device=device).exponential_(
            1, generator=generator
        )
    first = race_sample(logits, params, noise)
    low = autocast_dtype(device)
    if float_dtype(model) == torch.float64:
        low = None  # autocast leaves float64 alone: a double model's step computes in double throughout
    with contextlib.ExitStack() as scope:
        scope.enter_context(plan_attention(model))
        if weights is None:
            weights = scope.enter_context(cast_linears(model, device.type))
        # a compiled step needs no hooks: the compiler merges casts of one tensor itself
        forget = (
            scope.enter_context(shared_input_casts(model, low)) if low is not None and not compiled else None
        )
        decoder = StaticDecoder(
            model,
            prompt_kv,
            prompt_mask,
            first,
            pos,
            params,
            eos_token_ids,
            pad_token_id,
            noise=noise,
            weights=weights,
            compiled=compiled,
            low=low,
            forget_casts=forget,
        )
        try:
            with attach_step_plan(model, decoder.plan):
                yield decoder
        finally:
            decoder.close()


def static_decode(
    model: torch.nn.Module,
    prompt_ids: list[list[int]],
    group_size: int,
    params: SamplingParams,
    generator: torch.Generator | None,
    device: torch.device,
    *,
    eos_token_ids: list[int],
    pad_token_id: int,
    shared: bool,
    capture: bool,
    check_every: int = 8,
    on_finished: Callable[[int, list[int]], None] | None = None,
    compiled: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (tokens [N, T], lengths [N], ended-with-EOS [N] bool, log-probs [N, T]) of G samples per prompt,
    decoded by the static step (captured as a CUDA graph when `capture`; eagerly otherwise, which is how a CPU
    tests it). shared: the G samples of a prompt read one copy of its prompt's keys; compiled: the step runs
    through torch.compile (falling back to the eager step, with a warning, where that fails)."""
    with open_decoder(
        model,
        prompt_ids,
        group_size,
        params,
        generator,
        device,
        eos_token_ids=eos_token_ids,
        pad_token_id=pad_token_id,
        shared=shared,
        compiled=compiled,
    ) as decoder:
        return decoder.run(generator, capture=capture, check_every=check_every, on_finished=on_finished)
