"""Which training prompts a step draws: shuffled epochs over the dataset, resumable."""

from __future__ import annotations

from collections.abc import Callable

import torch

from cohort.runtime import seeds


class PromptSampler:
    """Yields dataset indices in shuffled epochs; its state is saved with checkpoints."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed, self.epoch, self.pos = n, seed, 0, 0
        self._order = self._shuffle()

    def _shuffle(self) -> list[int]:
        g = seeds.generator(seeds.epoch_shuffle(self.seed, self.epoch))
        return torch.randperm(self.n, generator=g).tolist()

    def take(self, k: int, allow: Callable[[int], bool] | None = None) -> list[int]:
        """Return the next k indices (an epoch boundary reshuffles), passing over those `allow` refuses.

        After a whole dataset's worth of refusals in one call every index is taken again, so a curriculum
        that has set almost everything aside cannot stall the run."""
        out: list[int] = []
        refused = 0
        while len(out) < k:
            if self.pos == self.n:
                self.epoch, self.pos = self.epoch + 1, 0
                self._order = self._shuffle()
            i = self._order[self.pos]
            self.pos += 1
            if allow is not None and refused < self.n and not allow(i):
                refused += 1
                continue
            out.append(i)
        return out

    def restart(self, seed: int) -> None:
        """Starts a new order from `seed` at its first epoch (a resume on another process count)."""
        self.seed, self.epoch, self.pos = seed, 0, 0
        self._order = self._shuffle()

    def state_dict(self) -> dict[str, int]:
        """Return the position to resume from."""
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume at a saved position."""
        self.epoch, self.pos = state["epoch"], state["pos"]
        self._order = self._shuffle()
