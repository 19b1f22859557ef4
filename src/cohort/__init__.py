"""cohort: GRPO-family reinforcement learning for Hugging Face causal language models."""

__version__ = "0.1.0"
