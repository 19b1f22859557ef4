"""The one step that sets what a config implies, and the one place that reads the environment for it.

A config holds what the user chose; some fields follow from others and from where the run starts.
:func:`derive` sets those, in place, before the checks: validation (:mod:`cohort.config.validation`) then
checks the config as it is, with the facts about the machine passed in as arguments, and changes nothing.
:meth:`RunEnvironment.detect` is where those facts are read (torchrun's ``WORLD_SIZE``, whether CUDA is
visible); ``TrainConfig.validate`` runs detect, derive and the checks in that order.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from cohort.config.schema import AutoSamplerIS, TokenTIS

if TYPE_CHECKING:
    from cohort.config.schema import TrainFields

__all__ = ["RunEnvironment", "derive", "per_process_batch", "torchrun_world_size"]


def torchrun_world_size() -> int:
    """Returns torchrun's process count (1 outside torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


@dataclass(frozen=True)
class RunEnvironment:
    """What a config is derived for and checked against besides itself: the process count and the GPUs."""

    world_size: int = 1
    """Processes the run is launched on (torchrun's WORLD_SIZE; 1 without torchrun)."""
    cuda_available: bool = False
    """Whether this machine has a CUDA GPU visible (the nccl backend needs one)."""

    @classmethod
    def detect(cls) -> RunEnvironment:
        """Returns this process's environment: torchrun's WORLD_SIZE and whether torch sees a CUDA GPU."""
        return cls(world_size=torchrun_world_size(), cuda_available=torch.cuda.is_available())


def per_process_batch(cfg: TrainFields, world_size: int) -> int | None:
    """Returns each process's share of distributed.global_batch_size, or None when there is no global batch
    or it does not split into `world_size` processes of whole groups (validation refuses that one)."""
    total, group = cfg.distributed.global_batch_size, cfg.rollout.group_size
    if total is None or total <= 0 or group <= 0 or total % (world_size * group):
        return None
    return total // world_size


def derive(cfg: TrainFields, *, world_size: int) -> TrainFields:
    """Returns `cfg` with the fields that follow from others set, in place, for a run on `world_size` processes.

    - rollout.batch_size: each process's share of distributed.global_batch_size, when one is given;
    - fast.*: a switch given as a boolean (a bare YAML on / off, or True / False from Python) as on / off;
    - algo.sampler_is=auto: token_tis when rollout.max_staleness > 0 (the batches' sampler is an older
      policy) or rollout.engine=vllm (another implementation's log-probs), else none; always none with
      algo.trust_region_anchor=sampler (the ratio is then taken against the sampler itself).

    Deriving twice gives the same config, so a config that was derived may be derived again."""
    share = per_process_batch(cfg, world_size)
    if share is not None:
        cfg.rollout.batch_size = share
    cfg.fast.normalise_switches()
    if isinstance(cfg.algo.sampler_is, AutoSamplerIS):
        stale = isinstance(cfg.rollout.max_staleness, int) and cfg.rollout.max_staleness > 0
        other = cfg.rollout.engine == "vllm"  # its kernels and precision differ from the trainer's
        anchored = cfg.algo.trust_region_anchor == "sampler"
        cfg.algo.sampler_is = TokenTIS() if (stale or other) and not anchored else None
    return cfg
