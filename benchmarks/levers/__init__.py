"""Per-mechanism benchmarks of cohort's fast paths; see benchmarks/__init__.py."""
