"""Every random stream of a run, named, with the formula that seeds it from the run's `seed`.

One place, so that a reader sees what each draw depends on and a new stream is chosen apart from the others.
Streams that feed the same kind of draw differ between ranks and steps; streams of different kinds may
share a seed value (e.g. `held_out_sampling(0, s)` and `sampling(0, s)`), which is harmless since they
feed different draws on different generators. The
formulas are part of a run's reproducibility (a checkpoint resumed by a newer cohort keeps drawing what
the older one would): change one only with a note in the CHANGELOG.
"""

from __future__ import annotations

import random

import numpy as np
import torch


def process(seed: int, rank: int) -> int:
    """Returns the seed of a process's global Python/NumPy/torch generators (model initialisations, dropout)."""
    return seed + rank


def sampling(seed: int, rank: int) -> int:
    """Returns the seed of a process's rollout sampling stream (the generator the engine draws tokens from)."""
    return seed * 7919 + rank


def sampling_after_resume(seed: int, step: int, rank: int) -> int:
    """Returns the sampling seed of a process resumed on another process count (its saved stream has no owner)."""
    return seed * 7919 + 1_000_003 * step + rank


def prompt_order(seed: int, rank: int) -> int:
    """Returns the seed of a process's prompt sampler (each epoch's shuffle is `epoch_shuffle` of it)."""
    return seed + 1000 * rank


def epoch_shuffle(order_seed: int, epoch: int) -> int:
    """Returns the seed of one epoch's permutation of the prompts."""
    return order_seed * 100003 + epoch


def minibatch_shuffle(seed: int) -> int:
    """Returns the seed of the minibatch permutations (the same stream on every process)."""
    return seed * 104729


def clip_cov_draws(shared_draw: int, rank: int) -> int:
    """Returns the seed of Clip-Cov's token draws on a process, from one draw of the shared minibatch stream."""
    return shared_draw + rank


def held_out_sampling(seed: int, step: int) -> int:
    """Returns the seed of the sampled held-out evaluation at `step` (TRL's eval_* metrics)."""
    return seed * 7907 + step


def logged_samples(seed: int, step: int) -> int:
    """Returns the seed of the held-out completions written to samples.jsonl at `step`."""
    return seed + step


def iterative_prompts(seed: int, step: int) -> int:
    """Returns the seed of the prompts iterative GRPO labels at `step`."""
    return seed * 7919 + step


def iterative_samples(seed: int, step: int) -> int:
    """Returns the seed of the completions iterative GRPO samples at `step` (apart from the training stream)."""
    return seed * 1_000_033 + step


def iterative_retrain(seed: int, step: int) -> int:
    """Returns the seed of the reward model's retraining at `step` (its example order)."""
    return seed * 31 + step


def pairs_epoch(seed: int, epoch: int) -> int:
    """Returns the seed of one epoch's order of reward-model training pairs."""
    return seed * 1_000_003 + epoch


def seed_globals(seed: int) -> None:
    """Seeds Python's, NumPy's and torch's global generators with `seed`."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """Returns a torch generator on `device` seeded with `seed`."""
    return torch.Generator(device=device).manual_seed(seed)
