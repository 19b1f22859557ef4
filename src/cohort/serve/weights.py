"""Weight pushes from the trainer to its rollout workers with torch.distributed.

Each worker gets a process group of two of its own (trainer rank 0, worker rank 1), built from a TCPStore the
trainer hosts and gloo's constructor directly, never through `init_process_group`: it coexists with a
torchrun default group and with other workers' groups, and a worker that dies breaks only its own pair (the
others keep receiving). A push lays the tensors of each dtype end to end in one buffer (one broadcast per
dtype, not one per tensor) and names what it holds, so the worker copies each slice into its tensor of the
same name. Every collective has a timeout: a worker that stops receiving is reported, never waited on forever.

Transport (rollout.weight_transport): gloo, on CPU and for CUDA tensors alike (staged through host memory), or
NCCL from the trainer's GPU straight into the worker's GPU(s) (`choose_transport`: auto takes NCCL when both
ends are on distinct GPUs). NCCL's own timeout tears the process down, so an NCCL channel polls its transfers
against the worker timeout instead and aborts the pair's communicator when one is late (as torchft does for
its fault-tolerant groups); the watchdog's timeout is set well past it. NOT RUN on a GPU yet (docs/serving.md):
the NCCL path is tested on CPU with gloo standing in for the group (tests/serve/test_serve_transport.py).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as tdist

from cohort.choices import WEIGHT_TRANSPORTS
from cohort.errors import first_line


def torch_dtype(name: str) -> torch.dtype:
    """Returns the torch dtype called `name` ("float32", "bfloat16", "int64", ...); ValueError for another name."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return dtype


def local_address_towards(host: str) -> str:
    """Returns this machine's address on the route to `host` (127.0.0.1 for a loopback peer).

    A UDP socket's connect sends nothing; it only asks the kernel which interface would be used."""
    if host in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return str(s.getsockname()[0])


def host_store(address: str, timeout: float) -> tdist.TCPStore:
    """Returns a TCPStore served by this process on `address`, at an ephemeral port (read `.port`).

    The listening socket is bound here and handed over, so the store listens on that one address rather than
    on every interface of the machine."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((address, 0))
    listener.listen(64)
    store = tdist.TCPStore(
        address,
        listener.getsockname()[1],
        None,
        True,
        timeout=datetime.timedelta(seconds=timeout),
        wait_for_workers=False,
        master_listen_fd=listener.fileno(),
    )
    listener.detach()  # the store owns the descriptor now (and closes it)
    return store


def join_store(host: str, port: int, timeout: float) -> tdist.TCPStore:
    """Returns a client of the trainer's TCPStore at host:port."""
    return tdist.TCPStore(host, port, None, False, timeout=datetime.timedelta(seconds=timeout))


TRANSPORTS = WEIGHT_TRANSPORTS
"""rollout.weight_transport's values (named once, in cohort.choices)."""

NCCL_WATCHDOG_FACTOR = 4
"""NCCL's watchdog fires this many worker timeouts after a transfer starts: the channel's own poll aborts first."""


def gpu_uuid(device: torch.device | str) -> str | None:
    """Returns the UUID of a CUDA device (None for another device): two processes on one GPU share it."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return str(torch.cuda.get_device_properties(device).uuid)


def receivable(device: torch.device | str) -> list[str]:
    """Returns the transports a process whose tensors live on `device` can receive a push by."""
    nccl = torch.device(device).type == "cuda" and tdist.is_available() and tdist.is_nccl_available()
    return ["gloo", "nccl"] if nccl else ["gloo"]


def choose_transport(setting: str, device: torch.device, worker: dict[str, Any], where: str) -> str:
    """Returns "gloo" or "nccl": the transport of the weight channel from a trainer whose weights are on `device`
    to a worker of this identity (its `transports` and `gpus`), as rollout.weight_transport asks (auto: NCCL when
    it can work). ValueError with the reason and the fix when the setting is nccl and NCCL cannot work."""
    if setting not in TRANSPORTS:
        raise ValueError(f"rollout.weight_transport={setting!r} is not one of {', '.join(TRANSPORTS)}")
    if setting == "gloo":
        return "gloo"
    mine = gpu_uuid(device)
    why = None
    if "nccl" not in receivable(device):
        why = (
            f"the trainer's weights are on {device}"
            if device.type != "cuda"
            else "this torch has no NCCL (torch.distributed.is_nccl_available() is False)"
        )
    elif "nccl" not in worker.get("transports", ["gloo"]):
        why = f"the worker at {where} cannot receive over NCCL (its device: {worker.get('device', '?')})"
    elif mine is not None and mine in worker.get("gpus", []):
        why = (
            f"the worker at {where} runs on the trainer's own GPU ({mine}), and NCCL cannot pair two processes "
            "on one GPU"
        )
    if why is None:
        return "nccl"
    if setting == "nccl":
        raise ValueError(
            f"rollout.weight_transport=nccl, but {why}: set rollout.weight_transport=auto (gloo, through host "
            "memory, where NCCL cannot work), or run the worker on a GPU of its own (CUDA_VISIBLE_DEVICES)"
        )
    return "gloo"


def _gloo(store: tdist.Store, rank: int, size: int, address: str, timeout: float) -> Any:
    options = tdist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    # gloo binds its pair sockets to this address (the one that reaches the peer), not to the hostname's
    options._devices = [tdist.ProcessGroupGloo.create_device(hostname=address)]
    options._timeout = datetime.timedelta(seconds=timeout)
    return tdist.ProcessGroupGloo(store, rank, size, options)


def _nccl(store: tdist.Store, rank: int, size: int, address: str, timeout: float) -> Any:
    nccl = tdist.ProcessGroupNCCL
    options = nccl.Options()
    options._timeout = datetime.timedelta(seconds=timeout * NCCL_WATCHDOG_FACTOR)
    # Non-blocking communicator set-up: a peer that never joins cannot hold the first broadcast forever (torch
    # polls the set-up for TORCH_NCCL_NONBLOCKING_TIMEOUT seconds).
    if hasattr(options, "config"):  # torch built with an NCCL that has communicator configs (2.14 and later)
        options.config.blocking = False
    os.environ.setdefault("TORCH_NCCL_NONBLOCKING_TIMEOUT", str(int(timeout)))
    # A peer that dies mid-push is an error of this channel's works, which Channel.wait raises (the worker counts as
    # lost). Under torch's default (TORCH_NCCL_ASYNC_ERROR_HANDLING=3, read when the group is made), NCCL's watchdog
    # thread would also re-raise it on its own thread a minute later, which ends the whole trainer process.
    with _environment(TORCH_NCCL_ASYNC_ERROR_HANDLING="0"):
        return nccl(store, rank, size, options)


@contextlib.contextmanager
def _environment(**values: str) -> Iterator[None]:
    """Yields with the environment variables `values` set, then restores them as they were."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


GROUPS: dict[str, Callable[[tdist.Store, int, int, str, float], Any]] = {"gloo": _gloo, "nccl": _nccl}
"""The process group each transport builds (store, rank, size, this side's address, timeout)."""


class Channel:
    """The process group of one trainer and one worker's receivers: the trainer (rank 0) broadcasts, the
    receivers (ranks 1.., one per GPU of a vLLM worker, else one) receive into buffers on `device`."""

    def __init__(
        self,
        store: tdist.Store,
        prefix: str,
        rank: int,
        address: str,
        timeout: float,
        *,
        transport: str = "gloo",
        size: int = 2,
        device: torch.device | str = "cpu",
    ) -> None:
        self.timeout, self.transport, self.device = timeout, transport, torch.device(device)
        self.group = GROUPS[transport](tdist.PrefixStore(prefix, store), rank, size, address, timeout)

    def broadcast(self, buffers: list[torch.Tensor]) -> list[tdist.Work]:
        """Returns the pending works of broadcasting each buffer from the trainer (rank 0)."""
        return [self.group.broadcast([b], tdist.BroadcastOptions()) for b in buffers]

    def wait(self, works: Iterable[tdist.Work]) -> None:
        """Returns None once every work finished; raises RuntimeError when one fails or times out."""
        if self.transport == "gloo":
            for w in works:
                w.wait(datetime.timedelta(seconds=self.timeout))
            return
        # NCCL: the host polls (NCCL's own timeout would end the process), then orders the current stream after
        # the transfer so what reads the buffers next sees them whole.
        deadline = time.monotonic() + self.timeout
        for w in works:
            while not w.is_completed():
                if time.monotonic() > deadline:
                    self.group.abort()
                    raise RuntimeError(
                        f"an NCCL weight transfer did not finish in {self.timeout:g} s (aborted)"
                    )
                time.sleep(0.001)
            try:
                w.wait()  # raises what failed it (a peer that died, say)
            except Exception as e:
                self.group.abort()  # its communicator is broken: nothing else waits on it
                raise RuntimeError(f"an NCCL weight transfer failed ({first_line(e)}; aborted)") from e

    def close(self, lost: bool = False) -> None:
        """Returns None after releasing an NCCL channel's communicator (torch warns about, and may hang on, one
        left to the garbage collector at exit); a gloo channel is left to its destructor, as before. lost: the
        worker is gone, so the communicator is aborted (a shutdown would wait for a peer that never answers)."""
        if self.transport == "nccl":
            try:
                if lost:
                    self.group.abort()
                else:
                    self.group.shutdown()
            except RuntimeError:
                pass  # already aborted (a late transfer): nothing left to release


def push_tensors(model: torch.nn.Module, *, full: bool) -> list[tuple[str, torch.Tensor]]:
    """Returns the (name, tensor) pairs a push sends: the whole state dict (`full`, on connect and after a
    resume), else the trainable parameters only (with LoRA: the adapter)."""
    if full:
        return list(model.state_dict().items())
    return [(n, p.detach()) for n, p in model.named_parameters() if p.requires_grad]


def flatten(
    named: list[tuple[str, torch.Tensor]], device: torch.device | str = "cpu"
) -> tuple[list[list], list[torch.Tensor]]:
    """Returns (spec, buffers): spec lists [name, dtype, numel] in send order; buffers holds one flat tensor on
    `device` per dtype, in order of first appearance, the tensors of that dtype end to end."""
    return flatten_each(named, lambda t: t, device=device)


def flatten_each(
    named: list[tuple[str, torch.Tensor]],
    value: Callable[[torch.Tensor], torch.Tensor],
    *,
    keep: bool = True,
    device: torch.device | str = "cpu",
) -> tuple[list[list], list[torch.Tensor]]:
    """Returns `flatten`'s (spec, buffers) of `named`, each tensor's value taken through `value` (an all-gather
    of a sharded tensor) one at a time, in spec order, and copied into the buffers (on `device`) at once: the
    buffers are the only whole copy held. `keep=False` (a process that only joins the all-gathers): values are
    dropped, and the spec and buffers are empty. Shapes and dtypes are read from `named`, so every process calls
    `value` alike."""
    by_dtype: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
    for name, t in named:
        by_dtype.setdefault(t.dtype, []).append((name, t))
    spec: list[list] = []
    buffers = []
    for dtype, items in by_dtype.items():
        flat = torch.empty(sum(t.numel() for _, t in items) if keep else 0, dtype=dtype, device=device)
        at = 0
        for name, t in items:
            whole = value(t)
            if keep:
                flat[at : at + t.numel()].copy_(whole.detach().reshape(-1))
                spec.append([name, str(dtype).removeprefix("torch."), t.numel()])
            at += t.numel()
            del whole
        if keep:
            buffers.append(flat)
    return spec, buffers


def dtype_sizes(spec: list[list]) -> dict[str, int]:
    """Returns the values of each dtype a push's spec holds, in the order `flatten` lays out its buffers."""
    sizes: dict[str, int] = {}
    for _, dtype, numel in spec:
        sizes[dtype] = sizes.get(dtype, 0) + int(numel)
    return sizes


def empty_buffers(spec: list[list], device: torch.device | str = "cpu") -> list[torch.Tensor]:
    """Returns the receive buffers of a push's spec: one flat tensor on `device` per dtype, as `flatten` lays
    them out."""
    return [
        torch.empty(numel, dtype=torch_dtype(dtype), device=device)
        for dtype, numel in dtype_sizes(spec).items()
    ]


@torch.no_grad()
def apply(model: torch.nn.Module, spec: list[list], buffers: list[torch.Tensor]) -> int:
    """Returns the number of tensors copied into `model` from received buffers (cast to the model's dtypes).

    Raises KeyError naming a tensor the model lacks (the handshake compares layouts, so only a bug gets here)."""
    state = model.state_dict()
    buffer_of = {str(b.dtype).removeprefix("torch."): b for b in buffers}
    offset = dict.fromkeys(buffer_of, 0)
    for name, dtype, numel in spec:
        at = offset[dtype]
        target = state[name]
        target.copy_(buffer_of[dtype][at : at + numel].view(target.shape))
        offset[dtype] = at + numel
    return len(spec)
