"""Multi-process helpers for ``torchrun``: the process group, rank information and the few collectives the
trainer's statistics need. The model itself is wrapped by FSDP (cohort.runtime.sharding), which reduces the
gradients; each process computes its loss with the global batch's normalisers, so the summed gradient is
the single-process one on the whole batch.

Each collective is a host synchronisation, so a step batches what it reduces: `Reductions` collects named
sums and maxima and reduces them in one call, `all_gather_table` gathers a step's rows with per-process
numbers in one all-gather, `all_gather_objects` gathers picklable objects in one (docs/architecture.md).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import gc
import os
import pickle
import sys
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as tdist

from cohort.errors import ConfigError, ReportedElsewhere

_MESHES: dict[tuple[tuple[int, ...], tuple[str, ...]], Any] = {}
"""Device meshes by shape and dimension names, made once per process group (FSDP units share them)."""


def is_distributed() -> bool:
    """Return True when running under torchrun with more than one process."""
    return tdist.is_available() and tdist.is_initialized() and tdist.get_world_size() > 1


def init_from_env(backend: str = "auto", timeout: float | None = None) -> None:
    """Initialise the default process group when torchrun's environment asks for several processes.

    backend: "auto" (nccl with GPUs, gloo without), "nccl" or "gloo"; timeout: seconds a collective may wait for
    the other processes (None: torch's default for the backend)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and tdist.is_available() and not tdist.is_initialized():
        check_local_gpu()
        if backend == "auto":
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if timeout is None:
            tdist.init_process_group(backend=backend)
        else:
            tdist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout))
        # a script that never calls shutdown() still releases its groups before the interpreter's teardown
        atexit.register(_destroy)
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))


def collective_timeout(worker_timeout: float, workers: int) -> float:
    """Returns the seconds a collective of a run may wait for a process held up by its rollout workers.

    torch's NCCL default is 10 minutes, no more than one worker's own timeout (rollout.worker_timeout, 10 minutes
    by default), while process 0 may wait for a push's acknowledgement and then its transfer, worker after worker,
    with the other processes already in the next collective: past NCCL's timeout its watchdog ends the job. Never
    below gloo's default of 30 minutes."""
    return max(1800.0, 2 * worker_timeout * max(1, workers) + 300.0)


def check_local_gpu() -> None:
    """Raises ConfigError when CUDA is visible but this process's LOCAL_RANK names no GPU of this machine.

    Each process of a CUDA run takes the GPU of its local rank; without this check a second process on a one-GPU
    machine stops inside torch.cuda.set_device with "invalid device ordinal", after the process group is up."""
    if not torch.cuda.is_available():
        return
    rank, count = int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()
    if rank >= count:
        raise ConfigError(
            f"this process has LOCAL_RANK={rank} but only {count} CUDA GPU(s) are visible on this machine: each "
            f"process of a CUDA run takes one GPU, so start at most {count} per machine (torchrun "
            "--nproc-per-node), or hide the GPUs (CUDA_VISIBLE_DEVICES=) to run the processes on the CPU (gloo). "
            "If your launcher already gives each process a GPU of its own (SLURM's --gpus-per-task), cohort cannot "
            "tell that from processes sharing one: start one torchrun per machine instead (srun --ntasks-per-node=1 "
            "torchrun --nproc-per-node=N, docs/serving.md), or set LOCAL_RANK=0 in each process's environment"
        )


def device_mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> Any:
    """Returns the device mesh of `shape` with dimension `names` over all processes (made once, then reused)."""
    from torch.distributed.device_mesh import init_device_mesh

    key = (shape, names)
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh(
            "cuda" if torch.cuda.is_available() else "cpu", shape, mesh_dim_names=names
        )
    return _MESHES[key]


def shutdown() -> None:
    """Wait for every process, then release the process groups (no-op when not distributed)."""
    if tdist.is_available() and tdist.is_initialized():
        if tdist.get_world_size() > 1:
            tdist.barrier()
        _destroy()


def exit_without_teardown(code: int) -> None:
    """Ends this process with `code` after its exit handlers, skipping the interpreter's teardown.

    FSDP's sharded tensors keep gloo's process group alive past destroy_process_group(); the teardown then
    destroys its threads in no set order and, on a loaded machine, aborts a finished run ("terminate called
    without an active exception", about once in ten CPU runs). A torchrun process that is done calls this."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _destroy() -> None:
    """Release the process groups if still open, with the meshes that hold them."""
    _MESHES.clear()
    if tdist.is_available() and tdist.is_initialized():
        tdist.destroy_process_group()
    gc.collect()


def rank() -> int:
    """Return this process's rank (0 when not distributed)."""
    return tdist.get_rank() if is_distributed() else 0


def world_size() -> int:
    """Return the number of processes (1 when not distributed)."""
    return tdist.get_world_size() if is_distributed() else 1


def local_rank() -> int:
    """Return this process's rank on its machine (torchrun's LOCAL_RANK; 0 when not distributed)."""
    return int(os.environ.get("LOCAL_RANK", "0")) if is_distributed() else 0


def is_main() -> bool:
    """Return True on the process that writes logs, reports and checkpoints."""
    return rank() == 0


def all_sum_int(value: int) -> int:
    """Return `value` summed over all processes."""
    if not is_distributed():
        return int(value)
    t = torch.tensor([value], dtype=torch.int64, device=device())
    tdist.all_reduce(t)
    return int(t.item())


def all_sum_float(value: float) -> float:
    """Return `value` summed over all processes."""
    if not is_distributed():
        return float(value)
    t = torch.tensor([value], dtype=torch.float64, device=device())
    tdist.all_reduce(t)
    return float(t.item())


def all_max_int(value: int) -> int:
    """Return the largest `value` over all processes."""
    if not is_distributed():
        return int(value)
    t = torch.tensor([value], dtype=torch.int64, device=device())
    tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
    return int(t.item())


def all_gather_object(obj: object) -> list:
    """Return every process's `obj` (picklable) in rank order ([obj] on one process)."""
    if not is_distributed():
        return [obj]
    out: list = [None] * world_size()
    tdist.all_gather_object(out, obj)
    return out


def raise_together(error: Exception | None) -> None:
    """Returns None when no process has an error; else raises on every process: its own error, or, on a process
    without one, the first failing process's error (same type and message) naming that process.

    For a failure only some processes see (a file only process 0 reads, a worker one process cannot reach): the
    others would otherwise wait in their next collective until its timeout."""
    if not is_distributed():
        if error is not None:
            raise error
        return
    if not all_max_int(int(error is not None)):  # the usual answer, in one small all-reduce
        return
    errors = all_gather_object(None if error is None else (type(error), str(error)))
    if error is not None:
        raise error
    for r, found in enumerate(errors):
        if found is not None:
            kind, message = found
            try:
                raised = kind(f"training process {r} of {world_size()}: {message}")
            except TypeError:  # an error class whose constructor takes more than a message
                raised = RuntimeError(f"training process {r} of {world_size()}: {kind.__name__}: {message}")
            raise raised


def raise_once(error: BaseException | None) -> None:
    """Returns None when no process has an error; else raises on process 0 its own error, or the first failing
    process's (same type and message, naming that process), and ReportedElsewhere on the others: a failure every
    process meets (a full disk under a sharded checkpoint) is told once, not once per process."""
    if not is_distributed():
        if error is not None:
            raise error
        return
    if not all_max_int(int(error is not None)):
        return
    errors = all_gather_object(None if error is None else (type(error), str(error)))
    if not is_main():
        raise ReportedElsewhere(
            f"training process {rank()} of {world_size()} stops; process 0 reports why"
            + (f" (here: {error})" if error is not None else "")
        )
    if error is not None:
        raise error
    r, (kind, message) = next((r, e) for r, e in enumerate(errors) if e is not None)
    try:
        raised: BaseException = kind(f"training process {r} of {world_size()}: {message}")
    except TypeError:  # an error class whose constructor takes more than a message
        raised = RuntimeError(f"training process {r} of {world_size()}: {kind.__name__}: {message}")
    raise raised


@contextlib.contextmanager
def failing_together() -> Iterator[None]:
    """Yields; an exception raised inside on any process is then raised on every process (see raise_together)."""
    error = None
    try:
        yield
    except Exception as e:
        error = e
    raise_together(error)


def barrier() -> None:
    """Wait until every process reaches this point (nothing on one process)."""
    if is_distributed():
        tdist.barrier()


def broadcast_model(model: torch.nn.Module) -> None:
    """Copy rank 0's parameters to every process so all start identical."""
    if not is_distributed():
        return
    with torch.no_grad():
        for p in model.parameters():
            tdist.broadcast(p.data, src=0)


def device() -> torch.device:
    """Returns the device collectives run on: this process's GPU, else the CPU."""
    return (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )


def local(t: torch.Tensor) -> torch.Tensor:
    """Returns this process's part of a DTensor (a plain tensor itself)."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def assert_in_sync(model: torch.nn.Module) -> None:
    """Raise RuntimeError if the processes' copies of the trainable parameters differ."""
    if not is_distributed():
        return
    with torch.no_grad():  # a replicated FSDP model's parameters are DTensors: their local part is the whole
        total = sum(float(local(p).double().sum()) for p in model.parameters() if p.requires_grad)
    t = torch.tensor([total], dtype=torch.float64, device=device())
    gathered = [torch.zeros_like(t) for _ in range(world_size())]
    tdist.all_gather(gathered, t)
    values = [float(g) for g in gathered]
    if max(values) - min(values) > 1e-6 * max(1.0, abs(values[0])):
        raise RuntimeError(
            f"processes hold different parameters after training (checksums {values}); this is a bug"
        )


def all_gather_rows(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Return (every process's rows of `t` concatenated in rank order, the index of this process's first row).

    `t` is [n, ...] with n free to differ between processes (the trailing shape must match). On one process
    it is `t` itself and 0.
    """
    if not is_distributed():
        return t, 0
    where = device()
    n = torch.tensor([t.shape[0]], dtype=torch.int64, device=where)
    sizes = [torch.zeros_like(n) for _ in range(world_size())]
    tdist.all_gather(sizes, n)
    counts = [int(c) for c in sizes]
    width = max(counts)
    padded = torch.zeros((width, *t.shape[1:]), dtype=t.dtype, device=where)
    padded[: t.shape[0]] = t.to(where)
    parts = [torch.zeros_like(padded) for _ in counts]
    tdist.all_gather(parts, padded)
    rows = torch.cat([p[:c] for p, c in zip(parts, counts)]).to(t.device)
    return rows, sum(counts[: rank()])


class Reductions:
    """Named sums and maxima of this process's ints and floats, reduced over every process together by `reduce`.

    One collective for the lot (none on one process): sums alone in one float64 all-reduce, maxima alone in
    one MAX all-reduce, both with only whole-number sums in one all-gather reduced here (exact in any order).
    Each float is summed by the same all-reduce, in float64, as `all_sum_float` sums it alone (an all-reduce
    of a vector is elementwise), so the results are those bits; ints come back as ints, exact below 2**53."""

    def __init__(self) -> None:
        self.sums: dict[str, int | float] = {}
        self.maxima: dict[str, int | float] = {}

    def sum(self, name: str, value: int | float) -> None:
        """Adds `value` to be summed over every process under `name`."""
        self.sums[name] = value

    def max(self, name: str, value: int | float) -> None:
        """Adds `value` whose largest over every process is wanted under `name`."""
        self.maxima[name] = value

    def reduce(self) -> dict[str, int | float]:
        """Returns every name's sum or maximum over all processes (this process's values on one process)."""
        out = {**self.sums, **self.maxima}
        if not is_distributed() or not out:
            return out
        names = [*self.sums, *self.maxima]
        values = [*self.sums.values(), *self.maxima.values()]
        t = torch.tensor(values, dtype=torch.float64, device=device())
        if not self.maxima:
            tdist.all_reduce(t)
            reduced = t.tolist()
        elif not self.sums:
            tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
            reduced = t.tolist()
        elif all(isinstance(v, int) for v in self.sums.values()):
            parts = [torch.empty_like(t) for _ in range(world_size())]
            tdist.all_gather(parts, t)
            rows = torch.stack(parts).cpu()
            s = len(self.sums)
            reduced = [*rows[:, :s].sum(0).tolist(), *rows[:, s:].max(0).values.tolist()]
        else:  # float sums with maxima: the sums keep their all-reduce (a local sum's order could differ)
            s = len(self.sums)
            tdist.all_reduce(t[:s])
            tdist.all_reduce(t[s:], op=tdist.ReduceOp.MAX)
            reduced = t.tolist()
        return {n: int(r) if isinstance(v, int) else r for n, v, r in zip(names, values, reduced)}


def all_gather_table(
    rows: torch.Tensor, head: list[float], capacity: int
) -> tuple[list[torch.Tensor], list[list[float]]]:
    """Returns (every process's `rows` [n_p, C] in float64, every process's `head` numbers), in rank order.

    One all-gather when each process has at most `capacity` rows, a second one (at the largest n_p) otherwise;
    every process passes the same C, len(head) and capacity. Values travel as float64: floats and whole numbers
    below 2**53 come back exact. On one process: ([rows], [head]) without a collective."""
    if not is_distributed():
        return [rows.double()], [[float(h) for h in head]]
    where, width = device(), max(rows.shape[1], len(head) + 1)

    def exchange(height: int) -> list[torch.Tensor]:
        buf = torch.zeros(height + 1, width, dtype=torch.float64, device=where)
        buf[0, 0] = rows.shape[0]
        buf[0, 1 : 1 + len(head)] = torch.tensor(head, dtype=torch.float64)
        n = min(rows.shape[0], height)
        buf[1 : 1 + n, : rows.shape[1]] = rows[:n].to(where, torch.float64)
        parts = [torch.empty_like(buf) for _ in range(world_size())]
        tdist.all_gather(parts, buf)
        return [p.cpu() for p in parts]

    parts = exchange(capacity)
    counts = [int(p[0, 0]) for p in parts]
    if max(counts) > capacity:  # every process sees the same counts, so all of them gather again
        parts = exchange(max(counts))
    return (
        [p[1 : 1 + c, : rows.shape[1]] for p, c in zip(parts, counts)],
        [p[0, 1 : 1 + len(head)].tolist() for p in parts],
    )


def all_gather_objects(obj: object, capacity: int = 1 << 16) -> list:
    """Returns every process's `obj` (picklable) in rank order ([obj] on one process), like `all_gather_object`
    but in one all-gather when every pickle fits `capacity` bytes (torch's exchanges the sizes first)."""
    if not is_distributed():
        return [obj]
    data = pickle.dumps(obj)
    where = device()

    def exchange(size: int) -> list[torch.Tensor]:
        buf = torch.zeros(size + 8, dtype=torch.uint8, device=where)
        buf[:8] = torch.tensor([len(data)], dtype=torch.int64).view(torch.uint8).to(where)
        n = min(len(data), size)
        if n:
            buf[8 : 8 + n] = torch.frombuffer(bytearray(data[:n]), dtype=torch.uint8).to(where)
        parts = [torch.empty_like(buf) for _ in range(world_size())]
        tdist.all_gather(parts, buf)
        return [p.cpu() for p in parts]

    parts = exchange(capacity)
    sizes = [int(p[:8].view(torch.int64)) for p in parts]
    if max(sizes) > capacity:  # every process sees the same sizes, so all of them gather again
        parts = exchange(max(sizes))
    return [pickle.loads(p[8 : 8 + n].numpy().tobytes()) for p, n in zip(parts, sizes)]
