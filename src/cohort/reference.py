"""The reference policy the KL term anchors to, and when and how it follows the policy.

Three ways to move the anchor (the section ``algo.ref_sync``, off by default; any combination of the first two):

- **periodic**: every ``algo.ref_sync.every`` steps (alias ``algo.ref_update_every``; TRL's ``ref_model_sync_steps``);
- **KL-triggered**: after a step whose mean per-token KL exceeds ``algo.ref_sync.kl`` (alias ``algo.ref_sync_kl``;
  seed 002 suggests 0.5: past it the penalty mostly fights the distance already travelled);
- each sync sets ``ref ← α·policy + (1 - α)·ref`` with α = ``algo.ref_sync.alpha`` (alias ``algo.ref_mixup_alpha``;
  TRL's ``ref_model_mixup_alpha``); α = 1 is a hard copy.

Without LoRA the reference is a frozen copy of the model. With LoRA it starts as the base model with
the adapter off (no copy at all); the first sync adds a second adapter, ``reference``, that holds the
reference's adapter weights, and reference passes run with it active. Under LoRA the mixup is taken on
the adapter parameters (A and B each mixed), which is what α means there: it is not the mixup of the
merged weights (B·A is not linear in the pair), and α = 1 is still an exact copy.

The reference is state: :meth:`Reference.state_dict` goes into every checkpoint once it has moved, so a
resumed run anchors where the uninterrupted one did.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import torch

REFERENCE_ADAPTER = "reference"
"""The peft adapter name that holds the reference under LoRA once it has been synced."""


class Reference:
    """The frozen reference policy of a run and its sync rule (see the module docstring)."""

    def __init__(
        self, model: torch.nn.Module, *, every: int = 0, kl_threshold: float | None = None, alpha: float = 1.0
    ):
        self.model = model
        self.every, self.kl_threshold, self.alpha = every, kl_threshold, alpha
        self.lora = hasattr(model, "disable_adapter") and hasattr(model, "peft_config")
        self.copy: torch.nn.Module | None = None
        if not self.lora:
            self.copy = copy.deepcopy(model).eval().requires_grad_(False)
        self.syncs = 0

    @property
    def follows_policy(self) -> bool:
        """Returns True when some rule can move the reference during the run."""
        return bool(self.every) or self.kl_threshold is not None

    @contextlib.contextmanager
    def __call__(self) -> Iterator[torch.nn.Module]:
        """Yields the module whose forward pass is the reference policy."""
        if self.copy is not None:
            yield self.copy
        elif not self._has_adapter():
            with self.model.disable_adapter():  # type: ignore[operator]  # peft's method
                yield self.model
        else:
            active = self._policy_adapter()
            self.model.set_adapter(REFERENCE_ADAPTER)  # type: ignore[operator]
            try:
                yield self.model
            finally:
                # peft's set_adapter also sets requires_grad: switching back makes the policy's adapter
                # trainable again and leaves the reference's frozen.
                self.model.set_adapter(active)  # type: ignore[operator]

    def maybe_sync(self, step: int, kl: float | None) -> bool:
        """Returns True when step `step` (1-based, just completed, its mean KL `kl`) moved the reference."""
        due = bool(self.every) and step % self.every == 0
        drift = self.kl_threshold is not None and kl is not None and kl > self.kl_threshold
        if due or drift:
            self.sync()
            return True
        return False

    @torch.no_grad()
    def sync(self, alpha: float | None = None) -> None:
        """Moves the reference to α·policy + (1 - α)·reference (`alpha` overrides the configured α; 1 resets)."""
        saved = self.alpha
        if alpha is not None:
            self.alpha = alpha
        try:
            self._sync()
        finally:
            self.alpha = saved

    def _sync(self) -> None:
        if self.copy is not None:
            # named_parameters lists a tied weight (embeddings = LM head) once, so it is mixed once.
            current = dict(self.model.named_parameters())
            for name, ref in self.copy.named_parameters():
                ref.lerp_(current[name].detach().to(ref.dtype), self.alpha)
            buffers = dict(self.model.named_buffers())
            for name, buf in self.copy.named_buffers():
                buf.copy_(buffers[name])
        else:
            first = not self._has_adapter()
            if first:
                self._add_adapter()
            theirs = self._adapter_params(REFERENCE_ADAPTER)
            for name, p in self._adapter_params(self._policy_adapter()).items():
                # The first sync starts from the base model: an adapter whose B is 0 adds nothing.
                target = theirs[name]
                if first and self.alpha < 1:
                    target.zero_()
                target.lerp_(p.detach().to(target.dtype), self.alpha)
        self.syncs += 1

    def state_dict(self) -> dict[str, Any]:
        """Returns what a checkpoint needs to restore the reference (weights only once it has moved)."""
        state: dict[str, Any] = {"syncs": self.syncs}
        if self.syncs:
            if self.copy is not None:
                state["weights"] = {k: v.detach().cpu().clone() for k, v in self.copy.state_dict().items()}
            else:
                state["adapter"] = {
                    k: v.detach().cpu().clone() for k, v in self._adapter_params(REFERENCE_ADAPTER).items()
                }
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores a :meth:`state_dict` (or a bare model state dict, as checkpoints before 0.3 saved it)."""
        if "syncs" not in state:  # an older checkpoint's reference.pt: the copy's weights themselves
            state = {"syncs": 1, "weights": state}
        self.syncs = int(state["syncs"])
        if "weights" in state:
            if self.copy is None:
                raise ValueError("the checkpoint's reference is a full model copy, but this run trains LoRA")
            self.copy.load_state_dict(state["weights"])
        if "adapter" in state:
            if not self.lora:
                raise ValueError(
                    "the checkpoint's reference is a LoRA adapter, but this run trains the full model"
                )
            if not self._has_adapter():
                self._add_adapter()
            params = self._adapter_params(REFERENCE_ADAPTER)
            with torch.no_grad():
                for name, value in state["adapter"].items():
                    params[name].copy_(value)

    # ------------------------------------------------------------------ LoRA adapters
    def _policy_adapter(self) -> str:
        active: Any = self.model.active_adapter
        return active if isinstance(active, str) else str(active[0])

    def _has_adapter(self) -> bool:
        return REFERENCE_ADAPTER in self.model.peft_config  # type: ignore[operator]

    def _add_adapter(self) -> None:
        active = self._policy_adapter()
        config = copy.deepcopy(self.model.peft_config[active])  # type: ignore[index]
        with torch.random.fork_rng(devices=[]):  # the adapter's random init must not shift the run's streams
            self.model.add_adapter(REFERENCE_ADAPTER, config)  # type: ignore[operator]
        self.model.set_adapter(active)  # type: ignore[operator]  # add_adapter may not keep the policy's active
        for p in self._adapter_params(REFERENCE_ADAPTER).values():
            p.requires_grad_(False)

    def _adapter_params(self, adapter: str) -> dict[str, torch.nn.Parameter]:
        """Returns the adapter's parameters keyed by their name with the adapter's name taken out."""
        marker = f".{adapter}."
        return {name.replace(marker, "."): p for name, p in self.model.named_parameters() if marker in name}
