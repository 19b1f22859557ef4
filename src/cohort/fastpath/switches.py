"""The switchboard: one `auto | on | off` switch per fast path and the thresholds that steer `auto`.

`FastConfig` is the `fast:` section of a run's config. It reaches the code that takes each path through
constructors and arguments (`PolicyUpdater(fast=...)`, `BuiltinEngine(fast=...)`,
`completion_logprobs(fast=...)`), never through module globals, so two models in one process can run
with different switches.

- `off`: never take the path.
- `auto` (default): take it when the thresholds say it pays and the model supports it (checked once per
  model, `cohort.fastpath.probes`); when the model does not, fall back to the plain path and say why once
  per model.
- `on`: take it whenever the model supports it, whatever the thresholds say; a model that does not
  support it is an error (`FastPathError`) naming the reason, so a user who asks for a path gets it.
"""

from __future__ import annotations

import dataclasses
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cohort.errors import ConfigError

SWITCH_VALUES = ("auto", "on", "off")


class FastPathError(RuntimeError):
    """A fast path switched `on` cannot be taken for this model; the message names the reason."""


class FastPathConfigError(ConfigError, FastPathError):
    """A fast path switched `on` that the config alone shows cannot be taken (raised before the model loads):
    both a ConfigError and a FastPathError, so either handler catches it."""


@dataclass
class FastConfig:
    """Switches (auto | on | off) and thresholds of the paths that exist only for speed (docs/architecture.md)."""

    grouped: str = "auto"
    """Update: lay each group's prompt out once before its completions (else one padded row per completion).
    Needs sdpa or eager attention, and sequences within any sliding window unless segment attention runs.
    `auto` takes it on a CPU, and on CUDA only where it saves `grouped_min_saving_cuda` of the tokens: on an H200
    (Qwen2.5-0.5B's shape, 64 rows of ~416 tokens, bf16 weights) padded rows made a GRPO step 2.2x faster where
    grouping saved a third of them (fewer, larger kernels of steadier shapes; 1.3x the peak memory)."""
    grouped_min_saving_cuda: float = 0.5
    """auto on CUDA: the grouped layouts only when they save at least this share of the update's tokens (the
    prompt's G - 1 repeats). The one GPU measurement saved 0.34 and was slower grouped; 0.5 (long prompts, large
    G) is a guess that has not been measured. 1 never groups on CUDA, 0 always does."""
    unmasked_padding: str = "auto"
    """Update, padded rows: the forward runs without an attention mask. The rows are right-padded, and under the
    causal mask no real token attends to a pad after it, so the log-probs are the same; attention runs its causal
    kernel and no [rows, 1, length, length] mask is built. Checked once per model (a probe with rows of unequal
    length). `auto` takes it on CUDA only (CPU runs are unchanged); not yet measured on a GPU: on an H200 the
    masked rows' attention (cuDNN) took ~0.7 ms of host time a call, 24 calls a forward (docs/performance.md)."""
    compile_update: str = "off"
    """Update, padded rows without a mask (`unmasked_padding`): the decoder's forward, and so its backward, run
    through torch.compile (one trace with dynamic sizes for every micro-batch; cohort.fastpath.compiled), so its
    elementwise work is fused into fewer kernels launched from generated code. Needs the chunked head and an
    unsharded model without gradient checkpointing; checked once per model against the eager forward. Off by
    default until measured on a GPU; `auto` takes it on CUDA only. The first steps pay the compilation (several
    traces: with and without gradients, policy and reference)."""
    flash_first: str = "auto"
    """Update: PyTorch's attention (sdpa) tries FlashAttention, then memory-efficient attention, before cuDNN's,
    which PyTorch puts first on Hopper and Blackwell GPUs with a recent cuDNN. On an H200 each cuDNN attention call
    of the update took ~0.7 ms of host time (its plan for the call's shapes, which change every micro-batch), 312
    forward calls a step, while the update waited on the host (docs/performance.md). Each backend computes exact
    attention (rounding apart); the backward runs the forward's. `auto` takes it on CUDA only (a CPU's sdpa has no
    cuDNN); not yet measured on a GPU."""
    segments: str = "auto"
    """Update: segment attention over one packed row of exactly the real tokens (needs the grouped layout, sdpa
    attention and a once-per-model check; with model.gradient_checkpointing the recomputed layers follow the
    same segment plan). `auto` takes it only where the grouped layout is taken (see `grouped`)."""
    segments_min_tokens: int = 256
    """auto: segment attention only when some group (prompt + completions) has this many tokens. Measured:
    on the demo (groups of ~60 tokens) the dense block mask is 2-4 % faster per step; on workload (b)
    (groups of ~600 tokens) segments are 20-25 % faster."""
    attention_slowdown: float = 1.4
    """Row planning of the dense-mask grouped layout: a masked attention FLOP costs this many projection
    FLOPs (measured with sdpa forward + backward against a linear layer, 2 CPU threads: 1.3-1.5)."""
    chunked_head: str = "auto"
    """Log-probs: run the LM head only on hidden states that predict completion tokens, in chunks, never
    holding [batch, length, vocabulary] logits (needs the model to split into decoder + head, checked once)."""
    head_chunk_mib: int = 32
    """float32 logits per LM-head chunk on a CPU, in MiB: 152k-token vocabularies would otherwise allocate
    0.6 GB per 1024-row chunk, several times over in softmax temporaries."""
    head_chunk_mib_accelerator: int = 256
    """The same on a GPU, whose matmuls need ~300 FLOPs per byte read to be compute-bound (every chunk
    reads the whole head matrix)."""
    skip_zero_advantage: str = "auto"
    """Update: rows whose advantage is exactly 0 are not computed when beta = 0 (they add exactly 0 to the
    loss and the gradient; the loss normalisers still count them). `on` with beta > 0 is an error."""
    shared_prefix: str = "auto"
    """Builtin sampler: the G samples of a prompt decode against one copy of its cached keys and values
    (needs sdpa or eager attention, rollouts within any sliding window, and a once-per-model check)."""
    shared_prefix_min_elements: int = 1 << 18
    """auto: share only when the repeated prompt copies would add this many cache elements per layer.
    Measured: neutral on workload (b) at 0.5 M (5e5 elements), 1.04x faster at 14 M (1.6e6), 1.8x with
    600-token prompts at G = 16; slower on the demo's short prompts."""
    packed_weights: str = "auto"
    """Builtin sampler on a CPU: decode through oneDNN-packed copies of the large float32 Linear weights
    (holds one extra copy of them during a rollout)."""
    pack_min_elements: int = 1 << 19
    """auto: weights smaller than this stay on MKL. Measured 2026-11-23 (`bench_packed_decode.py`, rollouts of
    4 prompts x G): packing the 14 M bench model's matrices (147k-393k elements) made its rollouts 0.94x as
    fast (G = 8, 128 new tokens), a Qwen2.5-0.5B-width model's (803k-4.4M) 1.14x faster (G = 4, 64 new
    tokens); round 4 had measured 1.18x on the 14 M model and set 1 << 17, which no longer holds."""
    pack_after_steps: int = 8
    """auto: a rollout packs only once it has run this many decode steps ..."""
    pack_min_remaining: int = 32
    """auto: ... and has room for more than this many further tokens. Packing costs ~3 s for a 0.5 B model
    here and saves 15-45 % per later step: with 16 new tokens packing from the start was 1.13x slower,
    with 64 new tokens packing after 8 steps 1.17x faster."""
    preallocated_kv: str = "auto"
    """Builtin sampler: write each decode step's keys/values in place into buffers sized for the whole
    rollout instead of transformers' grow-by-concatenation (a fifth of decode time at 250 positions)."""
    graph_decode: str = "auto"
    """Builtin sampler on a CUDA GPU: decode with one fixed-shape step captured as a CUDA graph per rollout and
    replayed (cohort.rollout.graph): the ~1,300 kernel launches of a 0.5B model's step leave Python once.
    Multi-turn episodes decoded in this process capture it once per turn (not yet run on a GPU). Needs
    sdpa attention, an unsharded model, rollouts within any sliding window and a once-per-model check against the
    eager decoding; `auto` takes it on CUDA only (so CPU runs are unchanged), `on` elsewhere is an error."""
    compile_decode: str = "off"
    """graph_decode: the captured step (forward, sampler, bookkeeping) is first traced by torch.compile with dynamic
    sizes, so the graph replays fused kernels (cohort.rollout.graph.DECODE_STEP): at 0.5B a captured step is still
    ~1,300 kernels of a few microseconds, most of them elementwise. Checked once per model against the eager
    decoding; a step that fails to compile runs eagerly, with a warning. Off by default until measured on a GPU;
    `auto` takes it wherever the captured step runs (CUDA); `on` takes the captured step whatever
    `graph_decode_min_tokens` says, and is an error where it cannot run. The first rollouts pay the compilation (a
    trace for the probe, one for the run's sampling)."""
    graph_decode_min_tokens: int = 16
    """auto: capture only rollouts of at least this many new tokens (capture costs a few eager steps)."""
    graph_decode_check_every: int = 8
    """graph_decode: every this many steps the host copies whether every row has ended (without blocking) and
    reads the previous copy, so a rollout runs at most twice this many steps past its last EOS, writing pad."""
    cast_once: str = "auto"
    """Eager decoding under autocast (the builtin sampler's eager steps, multi-turn episodes): each Linear's weight
    and bias are cast to autocast's dtype once per rollout and the forwards read those copies (cohort.rollout.casts),
    where autocast, which keeps no cast under the sampler's inference mode, cast every weight at every step (169
    casts a step at Qwen2.5-0.5B's shape). Bitwise the same tokens and log-probs; holds one copy of the Linear
    weights in autocast's dtype during a rollout. `auto` takes it wherever autocast is on (CUDA with
    model.bf16_autocast), so CPU runs are unchanged; unsharded models only. Not yet measured on a GPU."""
    drop_ended_fraction: float = 0.25
    """Builtin sampler: drop rows that ended (EOS) from the decoding batch once this fraction of it has ended."""
    heap_bound: str = "auto"
    """Linux/glibc: fix malloc's mmap threshold so freed tensor memory goes back to the system (a 152k
    vocabulary step held 1.9 GB resident for 0.5 GB live without it). `on` elsewhere is an error."""
    heap_mmap_threshold_mib: int = 16
    """heap_bound: tensors of this many MiB or more are always mmapped (1 MiB doubled a 14 M model's step time)."""

    def validate(self, prefix: str = "fast.") -> FastConfig:
        """Returns self after writing boolean switches as on / off and checking every switch and threshold
        (ValueError naming the key and the fix)."""
        return self.normalise_switches().check(prefix)

    def normalise_switches(self) -> FastConfig:
        """Returns self with each switch given as a boolean (or its text) written as on / off, in place."""
        for name in SWITCHES:
            value = getattr(self, name)
            # YAML reads a bare on / off as a boolean (and the config layer may have made it a string).
            if value in (True, "True", "true"):
                setattr(self, name, "on")
            elif value in (False, "False", "false"):
                setattr(self, name, "off")
        return self

    def check(self, prefix: str = "fast.") -> FastConfig:
        """Returns self after checking every switch and threshold as given (ValueError naming the key and the fix)."""
        for name in SWITCHES:
            value = getattr(self, name)
            if value not in SWITCH_VALUES:
                raise ValueError(f"{prefix}{name}={value!r} is not valid; choose one of: auto, on, off")
        for name in (
            "segments_min_tokens",
            "shared_prefix_min_elements",
            "pack_min_elements",
            "pack_after_steps",
            "pack_min_remaining",
            "graph_decode_min_tokens",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{prefix}{name}={value!r} must be an integer >= 0")
        for name in (
            "head_chunk_mib",
            "head_chunk_mib_accelerator",
            "heap_mmap_threshold_mib",
            "graph_decode_check_every",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                unit = " (steps)" if name == "graph_decode_check_every" else " (MiB)"
                raise ValueError(f"{prefix}{name}={value!r} must be an integer >= 1{unit}")
        saving = self.grouped_min_saving_cuda
        if isinstance(saving, bool) or not isinstance(saving, (int, float)) or not 0 <= saving <= 1:
            raise ValueError(
                f"{prefix}grouped_min_saving_cuda={saving!r} must be a share in [0, 1] (1: never group on CUDA)"
            )
        if not self.attention_slowdown >= 0:
            raise ValueError(
                f"{prefix}attention_slowdown={self.attention_slowdown!r} must be >= 0 (0: never split a group)"
            )
        if not 0.0 < self.drop_ended_fraction <= 1.0:
            raise ValueError(
                f"{prefix}drop_ended_fraction={self.drop_ended_fraction!r} must be in (0, 1]; it is the share of "
                "ended rows that triggers dropping them (0.25 is a good default)"
            )
        if self.compile_update == "on":
            for name, bad, why in (
                ("chunked_head", "off", "it compiles the decoder the chunked LM head splits off"),
                ("unmasked_padding", "off", "it compiles padded rows without an attention mask"),
            ):
                if getattr(self, name) == bad:
                    raise ValueError(
                        f"{prefix}compile_update=on cannot run with {prefix}{name}={bad}: {why}; set {prefix}{name} "
                        f"to auto, or {prefix}compile_update to auto or off"
                    )
        if self.compile_decode == "on" and self.graph_decode == "off":
            raise ValueError(
                f"{prefix}compile_decode=on compiles the captured decode step, but {prefix}graph_decode=off; set "
                f"{prefix}graph_decode to auto or on, or {prefix}compile_decode to auto or off"
            )
        if self.segments == "on" and self.grouped == "off":
            raise ValueError(
                f"{prefix}segments=on needs the grouped layout, but {prefix}grouped=off; set {prefix}grouped to "
                "auto or on, or segments to auto or off"
            )
        return self

    def replace(self, **changes: Any) -> FastConfig:
        """Returns a validated copy with `changes` applied (e.g. `fast.replace(segments="off")`)."""
        return dataclasses.replace(self, **changes).validate()

    @classmethod
    def all(cls, value: str) -> FastConfig:
        """Returns a FastConfig with every switch set to `value` ("off": the plain reference paths)."""
        switches: dict[str, Any] = {name: value for name in SWITCHES}
        return cls(**switches).validate()


SWITCHES: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(FastConfig) if f.type in ("str", str))
"""The names of the switches (every str field of FastConfig)."""

_SAID: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {(path, reason)} already said
_SAID_GLOBAL: set[tuple[str, str]] = set()  # for objects that cannot be weakly referenced


def choose(
    setting: str,
    path: str,
    model: Any,
    *,
    worth: bool = True,
    unavailable: Callable[[], str | None] = lambda: None,
) -> bool:
    """Returns whether fast path `path` runs for `model` under switch `setting`.

    worth: whether the thresholds say it pays (ignored by `on`). unavailable: returns why the model cannot
    take the path (None: it can); called only when the answer matters, since it may run a probe. `on` with
    a reason raises FastPathError; `auto` falls back and says why once per model.
    """
    if setting == "off" or (setting == "auto" and not worth):
        return False
    reason = unavailable()
    if reason is None:
        return True
    name = type(model).__name__ if model is not None else "this process"
    if setting == "on":
        raise FastPathError(
            f"fast.{path}=on, but {name} cannot take it: {reason}. Set fast.{path}=auto or off"
        )
    say_once(model, path, f"fast path {path!r} off for {name}: {reason}; using the plain path")
    return False


def say_once(model: Any, path: str, message: str) -> None:
    """Returns None after warning `message` unless it was already said for this model and path."""
    key = (path, message)
    try:
        said = _SAID.setdefault(model, set())
    except TypeError:
        said = _SAID_GLOBAL
    if key not in said:
        said.add(key)
        warnings.warn(f"cohort: {message}", stacklevel=4)
