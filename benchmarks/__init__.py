"""cohort's benchmarks (docs/performance.md says what each measures and how to run it).

- `benchmarks/vs_trl/`: cohort against TRL's GRPOTrainer on the same models, prompts and
  hyperparameters (`run.py` drives, `worker.py` measures one framework per fresh process,
  `bench_flops.py` is the FLOP floor of that table, `bench_report.py` prints it).
- `benchmarks/levers/`: one mechanism at a time, in one process (`bench_switches.py`: every
  `cohort.fastpath` switch at auto against off; `bench_families.py`, `bench_packed_decode.py`,
  `bench_shared_prefix.py`; `profile_cohort.py`: where a cohort step spends its time).
- shared by both: `common.py` (workloads, model shapes, the bench models and prompts, memory
  readings), `bench_models.py` (Qwen2 models whose completions end at EOS at a controlled rate),
  `bench_tasks.py` (prompts and the token-parity reward).

Every script runs from the repository root (`python benchmarks/vs_trl/run.py`,
`python benchmarks/levers/bench_switches.py`) and reaches the others as the package `benchmarks`
(it puts the repository root on `sys.path`; `benchmarks.vs_trl` is never importable as plain `trl`,
so TRL itself is not shadowed). Benchmarks use cohort's public API only: paths are switched
through `cohort.fastpath.FastConfig` (or `fast.*` config overrides), never by patching cohort.
"""
