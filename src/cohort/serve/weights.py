"""Weight pushes from the trainer to its rollout workers with torch.distributed.

Each worker gets a process group of two of its own (trainer rank 0, worker rank 1), built from a TCPStore the
trainer hosts and gloo's constructor directly, never through `init_process_group`: it coexists with a
torchrun default group and with other workers' groups, and a worker that dies breaks only its own pair (the
others keep receiving). A push lays the tensors of each dtype end to end in one buffer (one broadcast per
dtype, not one per tensor) and names what it holds, so the worker copies each slice into its tensor of the
same name. Every collective has a timeout: a worker that stops receiving is reported, never waited on forever.

Transport: gloo, on CPU and for CUDA tensors alike (they are staged through host memory); NCCL between GPUs
is not built yet.
"""

from __future__ import annotations

import datetime
import socket
from collections.abc import Callable, Iterable

import torch
import torch.distributed as tdist


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


class Channel:
    """The process group of one trainer-worker pair: the trainer (rank 0) broadcasts, the worker receives."""

    def __init__(self, store: tdist.Store, prefix: str, rank: int, address: str, timeout: float) -> None:
        options = tdist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        # gloo binds its pair sockets to this address (the one that reaches the peer), not to the hostname's
        options._devices = [tdist.ProcessGroupGloo.create_device(hostname=address)]
        options._timeout = datetime.timedelta(seconds=timeout)
        self.timeout = timeout
        self.group = tdist.ProcessGroupGloo(tdist.PrefixStore(prefix, store), rank, 2, options)

    def broadcast(self, buffers: list[torch.Tensor]) -> list[tdist.Work]:
        """Returns the pending works of broadcasting each buffer from the trainer (rank 0)."""
        return [self.group.broadcast([b], tdist.BroadcastOptions()) for b in buffers]  # type: ignore[attr-defined]

    def wait(self, works: Iterable[tdist.Work]) -> None:
        """Returns None once every work finished; raises RuntimeError when one fails or times out."""
        for w in works:
            w.wait(datetime.timedelta(seconds=self.timeout))


def push_tensors(model: torch.nn.Module, *, full: bool) -> list[tuple[str, torch.Tensor]]:
    """Returns the (name, tensor) pairs a push sends: the whole state dict (`full`, on connect and after a
    resume), else the trainable parameters only (with LoRA: the adapter)."""
    if full:
        return list(model.state_dict().items())
    return [(n, p.detach()) for n, p in model.named_parameters() if p.requires_grad]


def flatten(named: list[tuple[str, torch.Tensor]]) -> tuple[list[list], list[torch.Tensor]]:
    """Returns (spec, buffers): spec lists [name, dtype, numel] in send order; buffers holds one flat CPU
    tensor per dtype, in order of first appearance, the tensors of that dtype end to end."""
    return flatten_each(named, lambda t: t)


def flatten_each(
    named: list[tuple[str, torch.Tensor]], value: Callable[[torch.Tensor], torch.Tensor], *, keep: bool = True
) -> tuple[list[list], list[torch.Tensor]]:
    """Returns `flatten`'s (spec, buffers) of `named`, each tensor's value taken through `value` (an all-gather
    of a sharded tensor) one at a time, in spec order, and copied into the buffers at once: the buffers are the
    only whole copy held. `keep=False` (a process that only joins the all-gathers): values are dropped, and the
    spec and buffers are empty. Shapes and dtypes are read from `named`, so every process calls `value` alike."""
    by_dtype: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
    for name, t in named:
        by_dtype.setdefault(t.dtype, []).append((name, t))
    spec: list[list] = []
    buffers = []
    for dtype, items in by_dtype.items():
        flat = torch.empty(sum(t.numel() for _, t in items) if keep else 0, dtype=dtype)  # [sum numel]
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


def empty_buffers(spec: list[list]) -> list[torch.Tensor]:
    """Returns the receive buffers of a push's spec: one flat CPU tensor per dtype, as `flatten` lays them out."""
    sizes: dict[str, int] = {}
    for _, dtype, numel in spec:
        sizes[dtype] = sizes.get(dtype, 0) + int(numel)
    out = []
    for dtype, numel in sizes.items():
        out.append(torch.empty(numel, dtype=torch_dtype(dtype)))
    return out


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
