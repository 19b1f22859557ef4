"""Processes of a gloo group started by torch.multiprocessing.spawn, for the tests of sharded loading
(test_sharded_loading.py) and of rollout workers under several training processes (serve/test_serve_torchrun.py).

Each function is one process: it joins the group through a file store, sets WORLD_SIZE so the config sees the
run's processes, does its case and writes what it saw to OUT/<name>-<rank>.pt, then leaves without the
interpreter's teardown (gloo's threads, still held by sharded tensors, can abort it)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from cohort.runtime.distributed import exit_without_teardown


def _join(rank: int, world: int, store: str) -> None:
    import torch.distributed as tdist

    os.environ.update({"WORLD_SIZE": str(world), "RANK": str(rank), "LOCAL_RANK": str(rank)})
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    tdist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)


def _overrides(model_dir: str, out: str, overrides: list[str]) -> list[str]:
    """Returns the command-line overrides of a small fsdp run on the tiny model (then `overrides`)."""
    reward = str(Path(__file__).parent / "digit_reward.py") + ":first_char_parity"
    return [
        f"model.name_or_path={model_dir}",
        "data.task=addition",
        "data.n_train=32",
        "data.n_eval=0",
        "rollout.group_size=4",
        "rollout.batch_size=8",
        "rollout.max_completion_length=4",
        "optim.lr=0.05",  # steps that move the weights visibly
        "model.device=cpu",
        "progress=false",
        "eval_at_ends=false",
        "threads=1",
        "distributed.strategy=fsdp",
        f"rewards=['{reward}']",
        f"out_dir={out}",
        *overrides,
    ]


def _config(model_dir: str, out: str, overrides: list[str]):
    from cohort.config import load_config

    return load_config(None, _overrides(model_dir, out, overrides))


def load_case(
    rank: int, world: int, store: str, out: str, model_dir: str, cases: dict[str, list[str]]
) -> None:
    """Builds a trainer per case (overrides), then records its whole weights and buffers after loading (and
    the reference copy's), one step's loss and the whole weights after it: OUT/<case>-<rank>.pt."""
    from cohort.runtime.sharding import full_state_dict
    from cohort.trainer import GRPOTrainer

    _join(rank, world, store)
    for name, overrides in cases.items():
        trainer = GRPOTrainer(_config(model_dir, f"{out}/{name}", overrides))
        seen = {
            "loaded": trainer.loaded,
            "weights": full_state_dict(trainer.model),
            "buffers": {k: b.clone() for k, b in trainer.model.named_buffers()},
        }
        if trainer.ref_model is not None:
            seen["reference"] = full_state_dict(trainer.ref_model)
        seen["loss"] = trainer.step().metrics["loss"]
        seen["after"] = full_state_dict(trainer.model)
        torch.save(seen, Path(out) / f"{name}-{rank}.pt")
    exit_without_teardown(0)


def error_case(rank: int, world: int, store: str, out: str, model_dir: str, overrides: list[str]) -> None:
    """Builds a trainer that must fail before training; writes the error's type and message to OUT/error-<rank>.pt."""
    from cohort.trainer import GRPOTrainer

    _join(rank, world, store)
    try:
        GRPOTrainer(_config(model_dir, f"{out}/run", overrides))
        seen = None
    except Exception as e:
        seen = (type(e).__name__, str(e))
    torch.save(seen, Path(out) / f"error-{rank}.pt")
    exit_without_teardown(0)


def unreachable_case(
    rank: int, world: int, store: str, out: str, model_dir: str, address: str, dead: str
) -> None:
    """Connects to the worker at `address`, except on the last process, whose rollout.workers names `dead` (nothing
    listens there); writes the error each process raised to OUT/error-<rank>.pt."""
    workers = dead if rank == world - 1 else address
    error_case(
        rank, world, store, out, model_dir, [f"rollout.workers=[{workers}]", "rollout.connect_timeout=3"]
    )


def together_case(rank: int, world: int, store: str, out: str, failing: int) -> None:
    """Raises WorkersLostError inside `failing_together` on process `failing` alone; writes what each process
    raised to OUT/error-<rank>.pt."""
    from cohort.runtime import distributed as dist
    from cohort.serve.client import WorkersLostError

    _join(rank, world, store)
    try:
        with dist.failing_together():
            if rank == failing:
                raise WorkersLostError("every rollout worker is lost (127.0.0.1:1: its connection closed)")
        seen = None
    except Exception as e:
        seen = (type(e).__name__, str(e))
    dist.barrier()  # every process got past the agreement: none waits in a collective
    torch.save(seen, Path(out) / f"error-{rank}.pt")
    exit_without_teardown(0)


def step_case(
    rank: int, world: int, store: str, out: str, model_dir: str, cases: dict[str, list[str]]
) -> None:
    """Builds a trainer per case and runs one step, then a held-out evaluation when the case has held-out rows,
    counting the explicit unshards of FSDP modules (what `cohort.runtime.sharding.gathered` does to hold the whole model)
    during each: OUT/<case>-<rank>.pt."""
    from torch.distributed.fsdp import FSDPModule

    from cohort.trainer import GRPOTrainer

    _join(rank, world, store)
    unshard = FSDPModule.unshard
    for name, overrides in cases.items():
        trainer = GRPOTrainer(_config(model_dir, f"{out}/{name}", overrides))
        calls: list[str] = []

        def counted(self, *args, calls=calls, **kwargs):
            calls.append(type(self).__name__)
            return unshard(self, *args, **kwargs)

        FSDPModule.unshard = counted  # type: ignore[method-assign]
        try:
            metrics = trainer.step().metrics
            stepped = len(calls)
            evaluated = trainer.evaluate() if trainer.held_out.rows else {}
        finally:
            FSDPModule.unshard = unshard  # type: ignore[method-assign]
        remote = trainer.remote
        seen = {
            "gathers": stepped,
            "eval_gathers": len(calls) - stepped,
            "evaluated": evaluated,
            "reward": metrics["reward"],
            "starts_workers": remote is not None and remote.local is not None,
            "addresses": [c.address for c in remote.clients] if remote is not None else [],
            "pushed": remote.pushed if remote is not None else None,
        }
        if remote is not None:
            remote.close()
        torch.save(seen, Path(out) / f"{name}-{rank}.pt")
    exit_without_teardown(0)


def full_disk_case(rank: int, world: int, store: str, out: str, model_dir: str) -> None:
    """Runs `cohort train` (fsdp, a checkpoint every step) where process 1 finds the disk full writing its part of
    the first checkpoint (torch's short write, the disk reported nearly full); writes each process's exit code and
    standard error to OUT/full-<rank>.pt."""
    import collections
    import contextlib
    import io
    import shutil

    from cohort.cli import main

    _join(rank, world, store)
    if rank == 1:
        real_save = torch.save

        def save(obj, f, *args, **kwargs):
            if "rank-1.pt" in str(f):
                raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 1088 vs 986")
            return real_save(obj, f, *args, **kwargs)

        usage = collections.namedtuple("usage", "total used free")
        torch.save = save  # type: ignore[assignment]
        shutil.disk_usage = lambda path: usage(2**30, 2**30 - 4096, 4096)  # type: ignore[assignment]
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["train", *_overrides(model_dir, str(Path(out) / "run"), ["steps=2", "save_every=1"])])
    torch.save((code, err.getvalue()), Path(out) / f"full-{rank}.pt")
    exit_without_teardown(0)


COLLECTIVES = (
    "allreduce",
    "allreduce_coalesced",
    "allgather",
    "allgather_coalesced",
    "all_gather_single",
    "all_gather_single_coalesced",
    "broadcast",
    "barrier",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_single",
    "reduce_scatter_single_coalesced",
    "gather",
    "scatter",
    "alltoall",
    "all_to_all_single",
    "send",
    "recv",
)
"""The ProcessGroup methods that put a collective on the wire (torch.distributed's functions call them)."""


def _caller_outside_c10d() -> str:
    """Returns 'file:line function' of the first frame above torch.distributed's collective functions and this
    module: the code that asked for the collective (cohort's own, or torch's FSDP / DTensor)."""
    import sys

    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.endswith(("distributed_c10d.py", "c10d_logger.py", "_rank_workers.py", "functools.py")):
            return f"{name}:{frame.f_lineno} {frame.f_code.co_name}"
        frame = frame.f_back
    return "?"


def collectives_case(
    rank: int, world: int, store: str, out: str, model_dir: str, cases: dict[str, list[str]]
) -> None:
    """Trains 3 steps per case (train(): the loop's bookkeeping too) with every ProcessGroup collective wrapped,
    and writes the collectives cohort's own code issued during the second step and its bookkeeping (from the
    second step() to the third), each as its call site, and the most micro-batches an update planned:
    OUT/<case>-<rank>.pt.

    Counted: each collective on the wire whose first caller above torch.distributed's functions is in cohort's
    source (an all_gather_object is its two all-gathers). Not counted: those FSDP and DTensor issue themselves
    (gathering parameters, reducing gradients, the gradient norm)."""
    import torch.distributed as tdist

    from cohort.train import update
    from cohort.trainer import GRPOTrainer

    _join(rank, world, store)
    plan = update.plan_micro_batches
    most = [0]

    def planned(*args, **kwargs):
        micros = plan(*args, **kwargs)
        most[0] = max(most[0], len(micros))
        return micros

    update.plan_micro_batches = planned  # type: ignore[assignment]
    pg = tdist.ProcessGroup
    originals = {name: vars(pg)[name] for name in COLLECTIVES if name in vars(pg)}
    calls: list[tuple[int, str]] = []
    steps = [0]

    def counting(name, method):
        def wrapper(self, *args, **kwargs):
            calls.append((steps[0], f"{name} from {_caller_outside_c10d()}"))
            return method(self, *args, **kwargs)

        return wrapper

    for case, overrides in cases.items():
        trainer = GRPOTrainer(_config(model_dir, f"{out}/{case}", ["steps=3", "save_every=0", *overrides]))
        step = trainer.step

        def counted_step(step=step):
            steps[0] += 1
            return step()

        trainer.step = counted_step  # type: ignore[method-assign]
        calls.clear()
        steps[0] = most[0] = 0
        for name, method in originals.items():
            setattr(pg, name, counting(name, method))
        try:
            trainer.train()
        finally:
            for name, method in originals.items():
                setattr(pg, name, method)
        second = [site for s, site in calls if s == 2]
        torch.save(
            {
                "cohort": [site for site in second if "/cohort/" in site],
                "all": second,
                "micro_batches": most[0],
            },
            Path(out) / f"{case}-{rank}.pt",
        )
    exit_without_teardown(0)


def reductions_case(rank: int, world: int, store: str, out: str) -> None:
    """Runs cohort.runtime.distributed's batched reductions on values that differ by process, next to the one-value
    collectives they replace, and writes what each gave: OUT/reductions-<rank>.pt."""
    import math

    from cohort.runtime import distributed as dist

    _join(rank, world, store)
    floats = [math.pi * (rank + 1) / (k + 3) + math.e**k for k in range(5)] + [1 / 3 + rank * 1e-3]
    seen: dict = {"alone": [dist.all_sum_float(v) for v in floats], "most": dist.all_max_int(7 * rank + 1)}
    sums = dist.Reductions()
    for k, v in enumerate(floats):
        sums.sum(f"f{k}", v)
    seen["sums"] = sums.reduce()
    ints = dist.Reductions()  # whole-number sums with a maximum: one all-gather
    ints.sum("tokens", 1000 + rank)
    ints.max("micro", 7 * rank + 1)
    seen["ints"] = ints.reduce()
    mixed = dist.Reductions()  # float sums with a maximum: the sums stay an all-reduce
    mixed.sum("loss", floats[-1])
    mixed.max("flag", float(rank == 1))
    seen["mixed"] = mixed.reduce()
    # process 1 holds more rows than the capacity: every process gathers a second time
    n = 5 if rank == 1 else 2
    rows = torch.arange(n * 3, dtype=torch.float64).reshape(n, 3) + 100 * rank
    seen["table"] = dist.all_gather_table(rows, [rank + 0.5, 2**40 + rank], capacity=3)
    seen["objects"] = dist.all_gather_objects({"rank": rank, "pad": "x" * (10 if rank else 100)}, capacity=64)
    seen["objects_small"] = dist.all_gather_objects(("r", rank), capacity=64)
    torch.save(seen, Path(out) / f"reductions-{rank}.pt")
    exit_without_teardown(0)
