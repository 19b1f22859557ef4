"""The prepared GPU check (benchmarks/gpu/check.sh): test suite, decode benchmark, cohort vs TRL."""
