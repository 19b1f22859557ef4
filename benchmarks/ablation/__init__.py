"""Ablation of the GRPO family on the demo task (see run.py)."""
