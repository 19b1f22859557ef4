"""The GRPO training loop's parts: the registry of stateful parts (state.py)."""

from cohort.train.state import Part, Stateful, StateRegistry

__all__ = ["Part", "StateRegistry", "Stateful"]
