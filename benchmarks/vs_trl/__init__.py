"""cohort against TRL's GRPOTrainer (run.py); see benchmarks/__init__.py."""
