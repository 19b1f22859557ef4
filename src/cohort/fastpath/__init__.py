"""Everything in cohort that exists only for speed, behind one switchboard (`FastConfig`, the `fast:` section).

Each mechanism computes what a plain path would (to rounding), so switching it off changes the speed of a
run, never its result; `FastConfig.all("off")` is the reference. Measured on this project's 2-core CPU
(docs/performance.md has the workloads):

| mechanism | module | what it saves (measured) | how it is checked | switch |
|---|---|---|---|---|
| grouped layout: each prompt laid out once | `layouts.py` | the prompt's forward + backward G-1 times | float64 split-invariance tests | `grouped` |
| segment attention | `attention.py` | dense-mask work on long groups: update 20-25 % faster on workload (b) | probe per model (and per sliding window) | `segments` |
| chunked LM head | `lm_head.py` | [batch, length, vocab] logits: 152k vocab peak RSS 5.1 -> 0.9 GB | probe per model ("head_split") | `chunked_head` |
| zero-advantage skipping | `skipping.py` | rows that add exactly 0 (beta = 0): a third to two thirds of the update late in the demo | exact by construction; tests | `skip_zero_advantage` |
| shared-prefix decoding | `attention.py` | reading a prompt's cache G times: 1.04x at 14 M, 1.8x with 600-token prompts | probe per model ("shared_prefix") | `shared_prefix` |
| packed decode weights | `packed_linear.py` | MKL's slow few-row matmuls: generation 1.18x (14 M), 1.42x (0.5 B width) | probe per torch build ("packed_linear") | `packed_weights` |
| preallocated KV cache | `kv_cache.py` | the cache copy at every decode step (a fifth of decode time at 250 positions) | tests | `preallocated_kv` |
| heap bound | `memory.py` | heap fragmentation: 1.9 GB resident for 0.5 GB live on a 152k vocab | Linux/glibc only | `heap_bound` |

`switches.py` holds the switchboard (`auto | on | off`, thresholds, `choose`); `probes.py` the one
mechanism by which a path is trusted on a model: the fast and the plain computation, as two callables,
compared once per model.
"""

from cohort.fastpath.switches import SWITCHES, FastConfig, FastPathError

__all__ = ["SWITCHES", "FastConfig", "FastPathError"]
