"""Reward hacking against a learned reward model, and iterative GRPO against it (see run.py)."""
