"""Everything in cohort that exists only for speed, behind one switchboard (`FastConfig`, the `fast:` section).

Each mechanism computes what a plain path would (to rounding), so switching it off changes the speed of a
run, never its result; `FastConfig.all("off")` is the reference. Measured on this project's 2-core CPU
(docs/performance.md has the workloads):

| mechanism | module | what it saves (measured, docs/performance.md) | how it is checked | switch |
|---|---|---|---|---|
| grouped layout: each prompt laid out once | `layouts.py` | update 4.98x faster than padded rows on workload (b), 14 M | float64 split-invariance tests | `grouped` |
| segment attention | `attention.py` | update 1.20x faster than the dense block mask on (b), 14 M | probe per model (and per sliding window) | `segments` |
| chunked LM head | `lm_head.py` | memory: no [batch, length, vocab] logits (time-neutral at a 258-token vocab) | probe per model ("head_split") | `chunked_head` |
| zero-advantage skipping | `skipping.py` | rows that add exactly 0 at beta = 0: update 1.97x faster with half the groups at zero advantage | exact by construction; tests | `skip_zero_advantage` |
| shared-prefix decoding | `attention.py` | reading a prompt's cache G times: rollout 1.12x faster on (b), 14 M | probe per model ("shared_prefix") | `shared_prefix` |
| packed decode weights | `packed_linear.py` | MKL's slow few-row matmuls: rollout 1.14x faster at Qwen2.5-0.5B width (0.94x at 14 M, so not packed there) | probe per torch build ("packed_linear") | `packed_weights` |
| preallocated KV cache | `kv_cache.py` | the cache copy at every decode step: rollout 1.08x faster on (b), 14 M | tests | `preallocated_kv` |
| captured decode step (CUDA only) | `attention.py` (`StepPlan`), `kv_cache.py` (`StepLayer`); the step in `cohort/rollout/graph.py` | ~1,300 kernel launches a decode step from Python (0.5B): 4.5 ms a step on an H200 against 24.9 eager | probe per model ("graph_decode"); CPU tests of the uncaptured step | `graph_decode` |
| weights cast once (eager decoding under autocast) | `cohort/rollout/casts.py` (`cast_once`) | autocast's cast of every Linear weight at every eager decode step (it keeps no cast under inference mode): 169 casts a step at 0.5B, not measured on a GPU | bitwise by construction; CPU-autocast tests against autocast's own casts | `cast_once` |
| unmasked padded rows (CUDA under auto) | `cohort/logprobs.py` (`choose_unmasked`) | the [rows, 1, L, L] mask and the masked attention kernel of right-padded rows: not measured on a GPU | probe per model ("unmasked_padding"); float64 tests | `unmasked_padding` |
| compiled decode step (off until measured) | `compiled.py`; the step in `cohort/rollout/graph.py` (`DECODE_STEP`) | the captured step's ~50 kernels a layer, most of them elementwise (inductor's code for the step on this CPU: 8 fused kernels and 11 library calls a layer against 49 kernel-launching ops eagerly; the sampler one kernel): not measured on a GPU | probe per model ("compile_decode"); tests with tracing backends | `compile_decode` |
| sdpa backends, FlashAttention first (update) | `attention.py` (`flash_first`) | cuDNN's attention, first on recent NVIDIA GPUs: ~0.7 ms of host time a call on an H200, 312 calls a step: not measured on a GPU | none needed: every backend is exact attention | `flash_first` |
| compiled update forward (off until measured) | `compiled.py` | the update's host-bound forward and backward (21,279 launches a step on an H200): not measured on a GPU | probes per model ("compile_update", "compile_update_backward"); tests with tracing backends | `compile_update` |
| heap bound | `memory.py` | heap fragmentation (1.9 GB resident for 0.5 GB live at a 152k vocabulary, round 3) | Linux/glibc only | `heap_bound` |

`switches.py` holds the switchboard (`auto | on | off`, thresholds, `choose`); `probes.py` the one
mechanism by which a path is trusted on a model: the fast and the plain computation, as two callables,
compared once per model.
"""

from cohort.fastpath.switches import SWITCHES, FastConfig, FastPathError

__all__ = ["SWITCHES", "FastConfig", "FastPathError"]
