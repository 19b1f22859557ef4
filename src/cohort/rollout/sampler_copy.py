"""A copy of the policy in another dtype for sampling, as an inference engine holds one (rollout.sampler_dtype).

Engines such as vLLM sample from their own copy of the weights, usually in bfloat16, while the trainer
computes log-probs in float32: the two disagree slightly on every token, which biases a policy gradient that
assumes they are the same (the mismatch `sampler/logprob_gap` measures and `algo.sampler_correction`
corrects). This copy reproduces that setting on any machine: it is refreshed from the policy before every
rollout (only the trainable tensors change between rollouts, so only those are copied after the first time).
"""

from __future__ import annotations

import copy

import torch


class SamplerCopy:
    """Holds the policy cast to `dtype`; `sync(policy)` returns it with the policy's current weights."""

    def __init__(self, policy: torch.nn.Module, dtype: torch.dtype):
        self.dtype = dtype
        self.model = copy.deepcopy(policy).to(dtype)
        self.model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        names = {n for n, p in policy.named_parameters() if p.requires_grad}
        self._pairs = [
            (dst, src)
            for (n, src), (_, dst) in zip(policy.named_parameters(), self.model.named_parameters())
            if n in names
        ]

    @torch.no_grad()
    def sync(self, policy: torch.nn.Module) -> torch.nn.Module:
        """Return the sampling copy after copying the policy's trainable weights into it (cast to its dtype)."""
        for dst, src in self._pairs:
            dst.copy_(src)
        return self.model
