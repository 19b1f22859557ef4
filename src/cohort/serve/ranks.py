"""Rollout workers shared by several training processes (torchrun, distributed.strategy fsdp or replicate).

Each training process sends its own share of prompts to the workers through connections of its own (a worker's
ROUTER socket serves every process's DEALER socket, one request at a time). Process 0 starts the local workers
(rollout.workers: N) and hands their addresses to the others; it alone holds the weight channels.

A push is collective. The processes first pool the workers any of them lost, so process 0 pushes only to
workers every process still uses. Then, bucket by bucket (about rollout.push_bucket_mib of tensors each), every
process joins the all-gather of each sharded tensor (`DTensor.full_tensor`), one tensor at a time; process 0
copies each into the bucket's buffers and sends them to the workers, the others drop it at once. Beyond its
shards, process 0 holds one bucket and one tensor, the others one tensor: never the whole model. The push
ends with process 0 telling every process which workers it lost; that exchange is also the barrier that keeps
any process from asking for completions of the new version before every worker holds it (a worker refuses a
generate request of a version other than its own).

Under `replicate` each process's tensors are already whole; process 0 sends its own, the others wait.

One training process pushes the same way when a channel is NCCL (rollout.weight_transport): its buckets are
built on its GPU, so a push never holds a second whole copy of the weights there.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch
import torch.distributed as tdist

from cohort.errors import ConfigError
from cohort.runtime import distributed as dist

T = TypeVar("T")


def on_main(work: Callable[[], T]) -> T:
    """Returns what `work` returned on process 0, on every process (work runs on process 0 only); an error it
    raised is raised on every process."""
    result, error = None, None
    if dist.is_main():
        try:
            result = work()
        except Exception as e:  # every process must learn of it, or the others wait in the next collective
            error = e
    dist.raise_together(error)
    if not dist.is_distributed():
        return result  # type: ignore[return-value]
    box = [result]
    tdist.broadcast_object_list(box, src=0)
    return box[0]  # type: ignore[return-value]


def check_one_machine(workers: int) -> None:
    """Returns None when every training process runs on this machine; ConfigError when some run elsewhere: local
    workers (rollout.workers: N) listen on 127.0.0.1 of process 0's machine, which other machines cannot reach."""
    world = dist.world_size()
    here = int(os.environ.get("LOCAL_WORLD_SIZE", world))  # torchrun's processes on this machine
    if here < world:
        raise ConfigError(
            f"rollout.workers={workers} starts workers on process 0's machine, listening on 127.0.0.1, which the "
            f"training processes of the other machines cannot reach ({here} of {world} processes run here); start "
            "workers with `cohort serve --host 0.0.0.0` and list their host:port addresses in rollout.workers"
        )


def buckets(named: list[tuple[str, torch.Tensor]], limit: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Yields `named` in order, in runs whose whole tensors hold about `limit` bytes (the same runs on every
    process: sizes are of the whole tensors, not of this process's shards)."""
    run: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in named:
        if run and size + t.numel() * t.element_size() > limit:
            yield run
            run, size = [], 0
        run.append((name, t))
        size += t.numel() * t.element_size()
    if run:
        yield run
