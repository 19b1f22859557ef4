"""The trainer's side of rollout workers: `RemoteGeneration`, a generation source whose completions come from
`cohort serve` processes, and the local workers a trainer starts itself (rollout.workers: N).

A step's groups are split into one contiguous chunk per configured worker. With one worker the request
carries the trainer's own sampling generator state and the worker hands back the advanced state: the run
draws exactly what the in-process engine would (rollout.max_staleness: 0). With several, each chunk samples
from a seed drawn from the trainer's generator, so the batch is the same whichever worker serves a chunk, and
when one is lost its chunks are served by the others unchanged. A worker is lost when its process ends, its
connection drops, or it makes no progress (answers nothing) for rollout.worker_timeout; the loss is reported
as a warning and the run goes on with the others, or stops with WorkersLostError when none is left.

Asynchronous steps (rollout.max_staleness > 0) send requests ahead (`submit`, later `collect`) and do not
wait for a weight push to land: a worker serves its requests in the order they were sent, so a request sent
after a push is sampled with the pushed weights, and one sent before it with the older ones.
"""

from __future__ import annotations

import itertools
import os
import select
import socket
import subprocess
import sys
import time
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as tdist

from cohort import __version__
from cohort.errors import ConfigError, NonFiniteError, TrainingError
from cohort.models import stop_token_ids
from cohort.rollout import RolloutBatch, SamplingParams, select_groups
from cohort.rollout.base import RolloutEngine
from cohort.runtime import distributed as dist
from cohort.runtime.sharding import full_value
from cohort.serve import ranks, weights
from cohort.serve.protocol import PROTOCOL, identity, mismatch, pack, params_to_dict, read_batch, unpack
from cohort.serve.worker import READY, die_with_parent, zmq_module


class WorkersLostError(TrainingError):
    """Every rollout worker of the run is lost: nothing can generate the step's completions."""


class _Lost(Exception):
    """One worker stopped answering (its process ended, its connection dropped, or it timed out)."""


class WorkerClient:
    """One worker's connection: a DEALER socket (requests matched to replies by id) and its event monitor."""

    _ids = itertools.count(1)

    def __init__(self, context: Any, address: str, process: subprocess.Popen | None = None) -> None:
        zmq = zmq_module()
        self.zmq, self.address, self.process = zmq, address, process
        self.sock = context.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.HEARTBEAT_IVL, 2000)
        self.sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 10000)
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self.sock.connect(f"tcp://{address}")
        self.connected = False
        self.lost: str | None = None
        self.identity: dict[str, Any] = {}
        self.channel: weights.Channel | None = None
        self.inbox: dict[int, tuple[dict[str, Any], list[bytes]]] = {}  # replies not taken yet, by request id
        self.awaited: set[int] = set()  # requests whose replies are wanted (others are dropped on arrival)
        self.heard = time.monotonic()  # when it last answered anything: a busy worker still makes progress

    def send(self, header: dict[str, Any], blobs: Sequence[bytes] = ()) -> int:
        """Returns the id of the request sent."""
        rid = next(self._ids)
        self.sock.send_multipart(pack({**header, "id": rid}, list(blobs)))
        self.awaited.add(rid)
        return rid

    def pump(self) -> None:
        """Returns None after moving every reply that arrived into the inbox (dropping those no one awaits);
        raises _Lost as `check`."""
        self.check()
        while self.sock.poll(0):
            header, blobs = unpack(self.sock.recv_multipart())
            self.heard = time.monotonic()
            if header.get("id") in self.awaited:
                self.inbox[header["id"]] = (header, blobs)

    def take(self, rid: int) -> tuple[dict[str, Any], list[bytes]] | None:
        """Returns the reply to request `rid` when it has arrived (once), else None."""
        reply = self.inbox.pop(rid, None)
        if reply is not None:
            self.awaited.discard(rid)
        return reply

    def forget(self, rid: int) -> None:
        """Returns None; the reply to request `rid` is no longer wanted (dropped when it arrives)."""
        self.awaited.discard(rid)
        self.inbox.pop(rid, None)

    def late(self, sent: float, timeout: float) -> bool:
        """Returns whether a request sent at `sent` has waited `timeout` seconds with no answer from the worker
        to anything since (requests are served in order: one queued behind others waits while they run)."""
        return time.monotonic() - max(sent, self.heard) > timeout

    def check(self) -> None:
        """Returns None; raises _Lost when the worker's process ended or its connection dropped."""
        if self.process is not None and self.process.poll() is not None:
            raise _Lost(f"its process exited with code {self.process.returncode}")
        while self.monitor.poll(0):
            from zmq.utils.monitor import recv_monitor_message

            event = recv_monitor_message(self.monitor)["event"]
            if event == self.zmq.EVENT_CONNECTED:
                self.connected = True
            elif event == self.zmq.EVENT_DISCONNECTED and self.connected:
                raise _Lost("its connection closed")

    def receive(self, rid: int, timeout: float) -> tuple[dict[str, Any], list[bytes]]:
        """Returns (header, blobs) of the reply to request `rid`; raises _Lost after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            self.pump()
            reply = self.take(rid)
            if reply is not None:
                return reply
            left = deadline - time.monotonic()
            if left <= 0:
                self.forget(rid)
                raise _Lost(f"it did not answer within {timeout:g} s")
            self.sock.poll(int(min(left, 0.2) * 1000))

    def request(self, header: dict[str, Any], blobs: Sequence[bytes] = (), *, timeout: float):
        """Returns (header, blobs) of the reply to one request; raises _Lost as `receive`."""
        return self.receive(self.send(header, blobs), timeout)

    def close(self) -> None:
        """Closes the sockets (the worker process, if this trainer started it, is stopped by LocalWorkers)."""
        self.sock.disable_monitor()
        self.monitor.close(0)
        self.sock.close(0)


class LocalWorkers:
    """Rollout worker processes this trainer started; they end with it (stop(), or its death: prctl + watch)."""

    def __init__(self, processes: list[subprocess.Popen], addresses: list[str]) -> None:
        self.processes, self.addresses = processes, addresses

    @classmethod
    def start(
        cls,
        n: int,
        model_path: str,
        *,
        device: str,
        dtype: str,
        attn_implementation: str,
        threads: int,
        timeout: float,
    ) -> LocalWorkers:
        """Returns n started workers on 127.0.0.1 (each on a free port), once each listens; ConfigError when one
        does not start within `timeout` seconds."""
        command = [
            sys.executable, "-m", "cohort", "serve", "--model", model_path, "--host", "127.0.0.1", "--port", "0",
            "--device", device, "--dtype", dtype, "--attn-implementation", attn_implementation,
            "--threads", str(threads), "--parent-pid", str(os.getpid()),
        ]  # fmt: skip
        processes: list[subprocess.Popen] = []
        workers = cls(processes, [])
        try:
            for _ in range(n):
                processes.append(
                    subprocess.Popen(command, stdout=subprocess.PIPE, preexec_fn=die_with_parent, text=True)
                )
            deadline = time.monotonic() + timeout
            for p in processes:
                workers.addresses.append(_read_address(p, deadline, timeout))
        except BaseException:
            workers.stop()
            raise
        return workers

    def stop(self) -> None:
        """Ends every worker process (SIGTERM, then SIGKILL after 5 s) and reaps it."""
        for p in self.processes:
            if p.poll() is None:
                p.terminate()
        for p in self.processes:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            if p.stdout is not None:
                p.stdout.close()


def _read_address(process: subprocess.Popen, deadline: float, timeout: float) -> str:
    """Returns the host:port a started worker printed it listens on; ConfigError when it exits or is silent."""
    assert process.stdout is not None
    while True:
        left = deadline - time.monotonic()
        if process.poll() is not None:
            raise ConfigError(
                f"a local rollout worker (rollout.workers) exited with code {process.returncode} while starting "
                "(its error is printed above); fix it, or set rollout.workers to null to sample in this process"
            )
        if left <= 0:
            raise ConfigError(
                f"a local rollout worker did not start within rollout.connect_timeout={timeout:g} s; raise "
                "rollout.connect_timeout (a loaded machine imports torch slowly) or set rollout.workers to null"
            )
        ready, _, _ = select.select([process.stdout], [], [], min(left, 0.2))
        if ready:
            line = process.stdout.readline()
            if line.startswith(READY):
                return line[len(READY) :].split()[0].removeprefix("tcp://")


@dataclass
class Ticket:
    """A batch requested from the workers: its chunk requests, and for each its reply or where it waits."""

    requests: list[tuple[dict[str, Any], list[bytes]]]
    group_size: int
    exact: bool
    """One chunk carrying the trainer's generator state: `collect` hands the advanced state back."""
    replies: list[tuple[dict[str, Any], list[bytes]] | None] = field(default_factory=list)
    pending: dict[int, tuple[WorkerClient, int, float]] = field(default_factory=dict)
    """chunk -> (worker, request id, when sent)."""


@dataclass
class _Push:
    """A weight push on its way: per worker the id of its request and the transfers' works (and the buffers
    they read, kept alive until they finish)."""

    sent: list[tuple[WorkerClient, int, list]]
    buffers: list[torch.Tensor]


class RemoteGeneration:
    """A generation source whose completions come from rollout workers (cohort serve), weights pushed to them."""

    def __init__(
        self,
        clients: list[WorkerClient],
        model: torch.nn.Module,
        *,
        timeout: float,
        local: LocalWorkers | None = None,
        context: Any = None,
        bucket_bytes: int,
        pushes_in_flight: int = 0,
        transport: str = "auto",
    ) -> None:
        """pushes_in_flight: weight pushes that may still be landing while the trainer goes on (0: each push
        is waited for; rollout.max_staleness > 0 lets that many land behind the requests queued before them).
        transport: rollout.weight_transport (auto, gloo or nccl; cohort.serve.weights.choose_transport)."""
        self.clients, self.model, self.timeout = clients, model, timeout
        # Several training processes, or NCCL: what a push gathers and sends at a time (rollout.push_bucket_mib).
        self.bucket_bytes = bucket_bytes
        self.transport = transport
        self.chunks = len(clients)  # fixed for the run: a batch does not depend on how many workers are left
        self.local, self.context = local, context
        self.pushes_in_flight = pushes_in_flight
        self.version = 0
        self.pushed: int | None = None
        self.push_seconds = 0.0
        self.store: Any = None
        self._pushes: list[_Push] = []
        self._finalizer = weakref.finalize(self, _shutdown, clients, local, context, self._pushes)

    @property
    def live(self) -> list[WorkerClient]:
        """Returns the workers not lost yet."""
        return [c for c in self.clients if c.lost is None]

    def weights_changed(self) -> None:
        """Records that the policy's weights changed (an optimizer step, a resume): the next push sends them."""
        self.version += 1

    def open_channels(self, timeout: float) -> None:
        """Opens each worker's weight channel (a process group of the trainer and the worker's receivers) over
        the transport rollout.weight_transport picks for it, raising ConfigError when one fails."""
        hosts = {c.address.rsplit(":", 1)[0] for c in self.clients}
        address = weights.local_address_towards(next(iter(hosts)))
        self.store = weights.host_store(address, timeout)
        device = next(self.model.parameters()).device
        for i, c in enumerate(self.clients):
            prefix = f"cohort-serve/{os.getpid()}/{i}/"
            try:
                transport = weights.choose_transport(self.transport, device, c.identity, c.address)
            except ValueError as e:
                raise ConfigError(str(e)) from None
            size = 1 + int(c.identity.get("receivers", 1)) if transport == "nccl" else 2
            try:
                c.request(
                    {
                        "op": "channel",
                        "store_host": address,
                        "store_port": self.store.port,
                        "prefix": prefix,
                        "timeout": self.timeout,
                        "transport": transport,
                        "size": size,
                    },
                    timeout=timeout,
                )
                c.channel = weights.Channel(
                    self.store,
                    prefix,
                    0,
                    address,
                    self.timeout,
                    transport=transport,
                    size=size,
                    device=device if transport == "nccl" else "cpu",
                )
            except (_Lost, RuntimeError) as e:
                raise ConfigError(
                    f"the weight channel ({transport}) to the rollout worker at {c.address} did not open ({e}); "
                    f"check that it can reach this machine at {address} (firewall), or raise "
                    "rollout.connect_timeout"
                ) from None

    @property
    def buffer_device(self) -> torch.device | None:
        """Returns where a push's buffers are built when a channel is NCCL (its GPU: one whole copy of the weights
        there at most a bucket at a time); None when every channel is gloo (host memory)."""
        for c in self.live:
            if c.channel is not None and c.channel.transport == "nccl":
                return c.channel.device
        return None

    def _share_losses(self, *, src: int | None = None) -> None:
        """Returns None after every process marked lost the workers another process lost (all of them pooled, or
        process `src`'s alone), each with a warning."""
        if not dist.is_distributed():
            return  # one training process: its own losses are all there are
        mine = {i: c.lost for i, c in enumerate(self.clients) if c.lost is not None}
        if src is None:
            seen = dist.all_gather_object(mine)
        else:
            box = [mine]
            tdist.broadcast_object_list(box, src=src)
            seen = [box[0]]
        for r, lost in enumerate(seen):
            for i, why in lost.items():
                c = self.clients[i]
                if c.lost is None:
                    rank = src if src is not None else r
                    self._lose(c, f"{why}, seen by training process {rank}")

    def _push_in_buckets(self, *, full: bool) -> None:
        """Returns None once process 0 has sent the current weights to every live worker, bucket by bucket, and
        every process knows which workers the push lost; WorkersLostError on every process when none is left.
        Every training process must call it together (cohort.serve.ranks says how the buckets travel)."""
        t0 = time.perf_counter()
        self._share_losses()
        self._require_live()
        everything = full or self.pushed is None
        named = weights.push_tensors(self.model, full=everything)
        runs = list(ranks.buckets(named, self.bucket_bytes))
        for k, run in enumerate(runs):
            # sharded tensors: an all-gather every process joins; process 0 alone keeps the values, in the buffers
            # (built on the GPU of an NCCL channel; only process 0 holds channels, the others keep nothing)
            device = self.buffer_device or "cpu"
            spec, buffers = weights.flatten_each(run, full_value, keep=dist.is_main(), device=device)
            if dist.is_main():
                self.send_weights(spec, buffers, final=k == len(runs) - 1)
            del spec, buffers
        # also the barrier: no process samples before every worker holds the weights
        self._share_losses(src=0)
        self._require_live()
        self.pushed = self.version
        self.push_seconds += time.perf_counter() - t0

    def push_weights(self, *, full: bool = False) -> None:
        """Sends the current weights to every live worker (the whole state dict when `full` or a worker has
        none yet), losing a worker whose receive fails or times out. A full push, or any push without
        pushes_in_flight, returns once the workers hold the weights; otherwise it returns at once, and the
        push lands when each worker reaches it among its requests. Several training processes, or an NCCL
        channel, push bucket by bucket (_push_in_buckets), each bucket landing before the next."""
        if self.pushed == self.version and not full:
            return
        if dist.is_distributed() or self.buffer_device is not None:
            self._push_in_buckets(full=full)
            return
        t0 = time.perf_counter()
        everything = full or self.pushed is None
        self._land(keep=max(self.pushes_in_flight - 1, 0) if not everything else 0)
        spec, buffers = weights.flatten(weights.push_tensors(self.model, full=everything))
        self.send_weights(spec, buffers, wait=False)
        self.pushed = self.version
        self._land(keep=0 if everything else self.pushes_in_flight)
        self._require_live()
        self.push_seconds += time.perf_counter() - t0

    def send_weights(
        self, spec: list[list], buffers: list[torch.Tensor], *, final: bool = True, wait: bool = True
    ) -> None:
        """Sends flattened tensors (weights.flatten) to every live worker as the current version (`final`: the
        push's last part, with which a worker holds that version), losing a worker whose receive fails; `wait`:
        returns once every earlier push and this one have landed (else this one is left on its way). A worker
        whose channel receives on another device than the buffers' gets a copy there (one per device)."""
        header = {"op": "weights", "version": self.version, "spec": spec, "final": final}
        sent = []
        held = list(buffers)
        copies: dict[torch.device, list[torch.Tensor]] = {}
        for c in self.live:
            try:
                assert c.channel is not None
                mine = buffers
                if buffers and buffers[0].device != c.channel.device:
                    if c.channel.device not in copies:
                        copies[c.channel.device] = [b.to(c.channel.device) for b in buffers]
                        held += copies[c.channel.device]
                    mine = copies[c.channel.device]
                rid = c.send(header)
                sent.append((c, rid, c.channel.broadcast(mine)))
            except RuntimeError as e:
                self._lose(c, f"weight push: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
        self._pushes.append(_Push(sent, held))
        if wait:
            self._land(keep=0)

    def _land(self, keep: int) -> None:
        """Returns once at most `keep` pushes are still on their way (the oldest are waited for: each worker's
        acknowledgement, then its transfers); a worker whose push fails or times out is lost."""
        while len(self._pushes) > keep:
            push = self._pushes.pop(0)
            for c, rid, works in push.sent:
                if c.lost is not None:
                    continue
                try:
                    reply, _ = c.receive(rid, self.timeout)
                    if not reply.get("ok"):
                        raise RuntimeError(reply.get("error") or "refused")
                    assert c.channel is not None
                    c.channel.wait(works)
                except (_Lost, RuntimeError) as e:
                    self._lose(c, f"weight push: {str(e).splitlines()[0] if str(e) else type(e).__name__}")

    def generate(
        self,
        prompt_ids: list[list[int]],
        group_size: int,
        params: SamplingParams,
        generator: torch.Generator | None,
        rows: list[dict] | None = None,
        on_finished: Callable[[int, list[int]], None] | None = None,
    ) -> RolloutBatch:
        """Returns the workers' rollout of the current weights: the same batch as the in-process engine with one
        worker; chunk by chunk, each from its own seed, with several (on_finished hears each completion that
        ended with EOS once the batch is back: the workers do not stream)."""
        self.push_weights()
        batch = self.collect(self._ticket(prompt_ids, group_size, params, generator, exact=True), generator)
        if on_finished is not None:
            for row in (~batch.truncated).nonzero().flatten().tolist():
                on_finished(row, batch.completion_ids[row])
        return batch

    def submit(
        self,
        prompt_ids: list[list[int]],
        group_size: int,
        params: SamplingParams,
        generator: torch.Generator | None,
    ) -> Ticket:
        """Returns the ticket of a batch requested now, sampled with the weights last pushed (each chunk from a
        seed drawn from `generator`); `collect` waits for it."""
        return self._ticket(prompt_ids, group_size, params, generator, exact=False)

    def collect(self, ticket: Ticket, generator: torch.Generator | None = None) -> RolloutBatch:
        """Returns the batch of a ticket once every chunk is back (a lost worker's chunks are sent to the others);
        an exact ticket's advanced generator state is set on `generator`."""
        self._wait(ticket)
        parts = []
        for (header, _), reply in zip(ticket.requests, ticket.replies):
            assert reply is not None
            batch, state = read_batch(reply[0], reply[1], header["prompt_ids"], ticket.group_size)
            parts.append((batch, range(batch.num_prompts)))
            if ticket.exact and state is not None and generator is not None:
                generator.set_state(state)
        return select_groups(parts)

    def abandon(self, ticket: Ticket) -> None:
        """Returns None; the ticket's replies are no longer wanted (the workers still serve its requests)."""
        for c, rid, _ in ticket.pending.values():
            c.forget(rid)
        ticket.pending.clear()

    def _ticket(
        self,
        prompt_ids: list[list[int]],
        group_size: int,
        params: SamplingParams,
        generator: torch.Generator | None,
        *,
        exact: bool,
    ) -> Ticket:
        """Returns a sent ticket of the requests `requests` builds."""
        ticket = self.requests(prompt_ids, group_size, params, generator, exact=exact)
        for i in range(len(ticket.requests)):
            self._dispatch(ticket, i)
        return ticket

    def requests(
        self,
        prompt_ids: list[list[int]],
        group_size: int,
        params: SamplingParams,
        generator: torch.Generator | None,
        *,
        exact: bool,
    ) -> Ticket:
        """Returns the ticket of a batch, not sent yet: one chunk request per configured worker; `exact` with one
        worker carries the generator's state (the in-process stream), else each chunk carries a seed drawn from
        it (so does every chunk for a worker that cannot take the state: another device type, or vLLM)."""
        n = min(self.chunks, len(prompt_ids))
        bounds = [len(prompt_ids) * i // n for i in range(n + 1)]
        exact = exact and n == 1 and generator is not None
        if generator is not None and not all(
            c.identity.get("device") == generator.device.type and c.identity.get("generator_state", True)
            for c in self.live
        ):
            # A generator state does not carry across device types, and a vLLM worker samples from seeds only:
            # each chunk gets a seed drawn from the trainer's generator, which stays reproducible.
            exact = False
        seeds: list[int | None] = [None] * n
        if not exact and generator is not None:
            seeds = torch.randint(2**62, (n,), generator=generator, device=generator.device).tolist()
        requests: list[tuple[dict[str, Any], list[bytes]]] = []
        for i in range(n):
            header: dict[str, Any] = {
                "op": "generate",
                "prompt_ids": prompt_ids[bounds[i] : bounds[i + 1]],
                "group_size": group_size,
                "params": params_to_dict(params),
                "seed": seeds[i],
            }
            blobs = [weights_bytes(generator.get_state())] if exact and generator is not None else []
            requests.append((header, blobs))
        return Ticket(requests, group_size, exact, [None] * n)

    def _dispatch(self, ticket: Ticket, chunk: int) -> None:
        """Sends a chunk's request to the live worker with the fewest requests awaited; WorkersLostError when none
        is left. The request names the weights last pushed, which the worker holds when it reaches it."""
        live = self._require_live()
        c = min(live, key=lambda w: len(w.awaited))
        header, blobs = ticket.requests[chunk]
        header["version"] = self.pushed
        ticket.pending[chunk] = (c, c.send(header, blobs), time.monotonic())

    def _wait(self, ticket: Ticket) -> None:
        """Returns once every chunk of the ticket has its reply, sending a lost worker's chunks to the others."""
        while ticket.pending:
            progressed = False
            for i, (c, rid, sent) in list(ticket.pending.items()):
                try:
                    if c.lost is not None:
                        raise _Lost(c.lost)
                    c.pump()
                    reply = c.take(rid)
                    if reply is not None and reply[0].get("kind") == "StaleWeightsError":
                        raise _Lost(f"a weight push did not land ({reply[0].get('error')})")
                    if reply is None:
                        if c.late(sent, self.timeout):
                            raise _Lost(f"it did not answer within rollout.worker_timeout={self.timeout:g} s")
                        continue
                except _Lost as e:
                    if c.lost is None:
                        self._lose(c, str(e))
                    c.forget(rid)
                    del ticket.pending[i]
                    self._dispatch(ticket, i)
                    progressed = True
                    continue
                del ticket.pending[i]
                ticket.replies[i] = (self._check_reply(c, reply[0]), reply[1])
                progressed = True
            if ticket.pending and not progressed:
                time.sleep(0.002)  # the sockets have nothing yet; poll again shortly

    def _check_reply(self, c: WorkerClient, header: dict[str, Any]) -> dict[str, Any]:
        """Returns a reply's header; raises the typed error of a worker that could not serve the request."""
        if header.get("ok"):
            return header
        if header.get("kind") == "non_finite":
            raise NonFiniteError(
                f"the policy produced non-finite logits while sampling on the rollout worker at {c.address} "
                f"({header.get('error')}); usually half-precision overflow (try model.dtype=float32 or bfloat16)"
            )
        raise TrainingError(f"the rollout worker at {c.address} failed: {header.get('error')}")

    def _lose(self, c: WorkerClient, why: str) -> None:
        """Marks a worker lost, with a warning naming it and what is left."""
        c.lost = why
        left = len(self.live)
        warnings.warn(
            f"the rollout worker at {c.address} is lost ({why}); "
            + (f"{left} worker(s) left take over its requests" if left else "no worker is left"),
            stacklevel=3,
        )

    def _require_live(self) -> list[WorkerClient]:
        """Returns the live workers; WorkersLostError when there are none."""
        live = self.live
        if not live:
            reasons = "; ".join(f"{c.address}: {c.lost}" for c in self.clients)
            # A resume checks that rollout.workers is unchanged: listed workers must come back where they were.
            how = (
                "continue from the last checkpoint with resume=auto (it starts new local workers)"
                if self.local is not None
                else "restart the workers at the same addresses "
                f"({', '.join(c.address for c in self.clients)}) and continue from the last checkpoint with "
                "resume=auto (a resume refuses a changed rollout.workers; allow_config_change=true accepts "
                "other workers, whose batches may differ from an uninterrupted run's)"
            )
            raise WorkersLostError(f"every rollout worker is lost ({reasons}): the run stops; {how}")
        return live

    def metrics(self) -> dict[str, float]:
        """Returns the workers' share of the step's metrics (live workers, seconds spent pushing weights), and
        resets the push time."""
        out = {"serve/workers": float(len(self.live)), "time/weight_push": self.push_seconds}
        self.push_seconds = 0.0
        return out

    def close(self) -> None:
        """Closes the connections and stops the workers this trainer started (also done when it is collected)."""
        self._finalizer()


def weights_bytes(state: torch.Tensor) -> bytes:
    """Returns a generator state's bytes."""
    return state.contiguous().numpy().tobytes()


def _shutdown(
    clients: list[WorkerClient], local: LocalWorkers | None, context: Any, pushes: list[_Push]
) -> None:
    # A push still on its way must land before its worker stops: a gloo transfer cut short by the peer's exit
    # can leave the process group's destructor waiting (the process would not exit).
    for push in pushes:
        for c, _, works in push.sent:
            if c.lost is None and c.channel is not None:
                try:
                    c.channel.wait(works)
                except RuntimeError:
                    pass  # the worker failed it: it is being stopped anyway
    pushes.clear()
    for c in clients:
        if c.channel is not None:
            c.channel.close(lost=c.lost is not None)
        c.close()
    if local is not None:
        local.stop()
    if context is not None:
        context.term()


def speaks_zeromq(address: str, seconds: float = 2.0) -> bool | None:
    """Returns whether the server at `address` ("host:port") opens with ZeroMQ's greeting (True), accepts a
    connection and says something else or nothing within `seconds` (False: another program's server, an HTTP one
    say), or accepts none (None: nothing listens yet, as while a worker loads its model).

    A ZeroMQ peer sends its greeting's signature (0xFF first) as soon as a connection opens, so another program on
    a worker's port is told at once, where waiting for an answer to the hello took all of connect_timeout."""
    host, _, port = address.rpartition(":")
    try:
        conn = socket.create_connection((host.strip("[]"), int(port)), timeout=seconds)
    except (OSError, ValueError):
        return None
    with conn:
        conn.settimeout(seconds)
        try:
            first = conn.recv(1)
        except OSError:  # said nothing within `seconds`
            return False
    return first == b"\xff"


def connect_workers(
    workers: int | list[str],
    model: torch.nn.Module,
    tokenizer: Any,
    engine: RolloutEngine,
    *,
    engine_name: str | None = None,
    model_path: str,
    dtype: str,
    device: str,
    attn_implementation: str,
    lora: dict[str, Any] | None,
    timeout: float,
    connect_timeout: float,
    autocast: str | None = None,
    bucket_bytes: int,
    pushes_in_flight: int = 0,
    transport: str = "auto",
) -> RemoteGeneration:
    """Returns the remote generation source of rollout.workers, after starting the local workers it asks for,
    greeting each worker (ConfigError on silence or on a mismatch of versions, engine, model or tokenizer),
    opening the weight channels and pushing the trainer's weights. Under torchrun every training process calls
    it: process 0 starts the local workers and opens the channels, each process greets every worker, and an
    error one process hits is raised on all (cohort.serve.ranks).

    `engine_name`: the engine the workers must sample with (rollout.engine; None: `engine`'s name). With vllm,
    `engine` is only the trainer's own (held-out evaluation samples in the trainer). `autocast`: the dtype name
    the trainer's forward passes autocast to on CUDA (None: none); a builtin worker on CUDA samples under it."""
    name = engine_name or engine.name
    zmq = zmq_module()
    local = None
    if isinstance(workers, int):
        if not model_path:
            raise ConfigError(
                "rollout.workers starts local workers from model.name_or_path, which is empty (the model was "
                "given as an object); set model.name_or_path, or list running workers' addresses"
            )

        def start() -> list[str]:
            nonlocal local
            ranks.check_one_machine(workers)
            local = LocalWorkers.start(
                workers,
                model_path,
                device=device,
                dtype=dtype,
                attn_implementation=attn_implementation,
                threads=torch.get_num_threads(),  # the trainer's: the same float reductions as in-process sampling
                timeout=connect_timeout,
            )
            return local.addresses

        addresses = ranks.on_main(start)  # several training processes: process 0 starts them, all connect
    else:
        addresses = list(workers)
    context = zmq.Context()
    processes = local.processes if local is not None else [None] * len(addresses)
    clients = [WorkerClient(context, a, p) for a, p in zip(addresses, processes)]
    source = RemoteGeneration(
        clients,
        model,
        timeout=timeout,
        local=local,
        context=context,
        bucket_bytes=bucket_bytes,
        pushes_in_flight=pushes_in_flight,
        transport=transport,
    )
    try:
        eos, pad = stop_token_ids(model, tokenizer)
        mine = identity(model, tokenizer, eos, pad)
        hello = {
            "op": "hello",
            "cohort": __version__,
            "protocol": PROTOCOL,
            "engine": name,
            "fast": asdict(engine.fast) if name == "builtin" and hasattr(engine, "fast") else None,
            "lora": lora,
            # The precision the trainer's own sampling computes in: a worker on a GPU samples under the same
            # autocast, so its log-probs are the ones in-process sampling would give.
            "autocast": autocast,
        }
        failed = None
        try:
            for c in clients:
                port = c.address.rsplit(":", 1)[-1]
                if speaks_zeromq(c.address) is False:
                    raise ConfigError(
                        f"the server at {c.address} is not a cohort rollout worker (it accepts connections but does "
                        f"not speak ZeroMQ, as `cohort serve` does): point rollout.workers at the address a `cohort "
                        f"serve` printed, or stop that server and start one there with `cohort serve --model PATH "
                        f"--port {port}`"
                    )
                try:
                    reply, _ = c.request(hello, timeout=connect_timeout)
                    if "ok" not in reply or (reply["ok"] and not isinstance(reply.get("identity"), dict)):
                        raise ValueError(f"a reply with the keys {sorted(reply)}")
                except _Lost as e:
                    raise ConfigError(
                        f"no rollout worker answered at {c.address} ({e}): start one there with `cohort serve --model "
                        f"PATH --port {port}`, or correct rollout.workers"
                    ) from None
                except ValueError as e:  # another program's server: its reply is not cohort's protocol
                    raise ConfigError(
                        f"the server at {c.address} is not a cohort rollout worker (its answer to the greeting is "
                        f"not cohort's protocol: {e}): point rollout.workers at the address a `cohort serve` "
                        f"printed, or stop that server and start one there with `cohort serve --model PATH "
                        f"--port {port}`"
                    ) from None
                if not reply.get("ok"):
                    raise ConfigError(
                        f"the rollout worker at {c.address} refused the trainer: {reply.get('error')}"
                    )
                c.identity = reply["identity"]
                theirs = c.identity.get("engine", name)  # a worker's identity names its engine since vLLM's
                if theirs != name:
                    fix = (
                        "set rollout.engine=vllm, or start the worker without --engine vllm"
                        if theirs == "vllm"
                        else "start the worker with `cohort serve --engine vllm`, or set rollout.engine=builtin"
                        if name == "vllm"
                        else f"set rollout.engine={theirs}"
                    )
                    raise ConfigError(
                        f"the rollout worker at {c.address} samples with {theirs} and this run with "
                        f"rollout.engine={name}: {fix}"
                    )
                problem = mismatch(mine, c.identity, c.address)
                if problem is not None:
                    raise ConfigError(problem)
                if dtype != "auto" and c.identity.get("dtype") != dtype:
                    raise ConfigError(
                        f"the rollout worker at {c.address} holds {c.identity.get('dtype')} weights and this run samples "
                        f"in {dtype} (rollout.sampler_dtype, else model.dtype): start it with --dtype {dtype}"
                    )
        except Exception as e:  # a ConfigError above, or a reply this process could not read
            failed = e
        # Several training processes: each greets each worker, and every one learns of a failure; process 0
        # alone opens the weight channels and pushes.
        dist.raise_together(failed)
        ranks.on_main(lambda: source.open_channels(connect_timeout))
        source.push_weights(full=True)
    except BaseException:
        source.close()
        raise
    return source
