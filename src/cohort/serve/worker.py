"""`cohort serve`: a rollout worker, an engine sampling its own copy of the model for a trainer.

The worker answers one request at a time on a ZeroMQ ROUTER socket (cohort.serve.protocol): the trainer's
hello (which engine and fast paths to sample with, LoRA settings), a weight channel, weight pushes, and
generate requests that carry the trainer's sampling generator state, so the worker draws exactly what the
in-process engine would and hands the advanced state back (or a seed: several workers, or a vLLM worker).
Started by a trainer (rollout.workers: N), it exits when that trainer's process ends, however it ends.

What it samples with is its backend (cohort.serve.backend): cohort's engines on a transformers model
(`--engine builtin`, the default) or vLLM (`--engine vllm`, cohort.serve.vllm_backend); the request loop,
the protocol, the weight channel and the timeouts here are the same for both.
"""

from __future__ import annotations

import ctypes
import errno
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from cohort.errors import NonFiniteSamplingError, first_line
from cohort.models import load_model, load_tokenizer
from cohort.serve.backend import Backend, BuiltinBackend
from cohort.serve.protocol import (
    DEFAULT_PORT,
    batch_reply,
    pack,
    params_from_dict,
    unpack,
)
from cohort.serve.vllm_backend import VLLMBackend, VLLMOptions

READY = "cohort serve: ready on "
"""The start of the line a worker prints on standard output once it listens (a trainer that started it reads
the address after it)."""


def zmq_module() -> Any:
    """Returns the zmq module; ImportError naming the extra to install when pyzmq is missing."""
    try:
        import zmq
    except ImportError:
        raise ImportError(
            "rollout workers need pyzmq: pip install 'cohort[serve]' (or pip install pyzmq)"
        ) from None
    return zmq


def die_with_parent() -> None:
    """Returns None; asks Linux to SIGKILL this process when the thread that started it ends (a Popen preexec_fn,
    run in the child before exec; a no-op elsewhere)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def watch_parent(parent_pid: int, every: float = 0.5) -> threading.Thread:
    """Returns a daemon thread that ends this process once its parent is gone (reparented: getppid changes).

    The belt to prctl's braces: PR_SET_PDEATHSIG fires when the parent's starting thread ends, and is Linux-only."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(every)
        os._exit(0)

    thread = threading.Thread(target=watch, name="cohort-serve-parent-watch", daemon=True)
    thread.start()
    return thread


class StaleWeightsError(RuntimeError):
    """A generate request names weights this worker does not hold (the push before it failed)."""


@dataclass
class Worker:
    """A worker's backend (its model and sampler) and what the trainer configured on it."""

    backend: Backend
    greeted: bool = False
    """A trainer's hello configured the backend (generate requests are refused before)."""
    version: int | None = None
    """The trainer's weight version the model holds (None: none received yet, or a push that failed)."""
    channel: Any = None
    """The weight channel the trainer opened (a weights.Channel, or the backend's own)."""
    received: int = 0
    """Tensors received of the push in progress."""
    log_pushes: bool = False
    """Print a line on standard error for each complete push (a worker started by hand; one a trainer started
    would print into the trainer's output)."""

    def ids(self) -> dict[str, Any]:
        """Returns this worker's identity (cohort.serve.protocol.identity), its engine and its device type."""
        return self.backend.identity()

    def handle(
        self, header: dict[str, Any], blobs: list[bytes]
    ) -> tuple[list[bytes], Callable[[], None] | None]:
        """Returns (the reply's frames, work to do after the reply is sent, or None)."""
        op = header.get("op")
        if op == "hello":
            return self._hello(header), None
        if op == "channel":
            return pack({"ok": True}), lambda: self._open_channel(header)
        if op == "weights":
            if self.channel is None:
                raise RuntimeError("a weight push arrived before a channel was opened (send `channel` first)")
            return pack({"ok": True}), lambda: self._receive(header)
        if op == "generate":
            return self._generate(header, blobs), None
        raise ValueError(f"unknown request {op!r}; this worker speaks hello, channel, weights, generate")

    def _hello(self, header: dict[str, Any]) -> list[bytes]:
        self.backend.hello(header)
        self.greeted = True
        ids = self.ids()
        if (header.get("cohort"), header.get("protocol")) != (ids["cohort"], ids["protocol"]):
            print(
                f"cohort serve: error: a trainer of cohort {header.get('cohort')} (protocol "
                f"{header.get('protocol')}) connected; this worker runs cohort {ids['cohort']}: install the same "
                "cohort version on both",
                file=sys.stderr,
                flush=True,
            )
        return pack({"ok": True, "identity": ids})

    def _open_channel(self, header: dict[str, Any]) -> None:
        self.channel = None
        self.channel = self.backend.open_channel(header)

    def _receive(self, header: dict[str, Any]) -> None:
        assert self.channel is not None
        self.version = None  # until every tensor has arrived
        spec = header["spec"]
        final = header.get("final", True)
        self.backend.receive(self.channel, spec, final=final)
        self.received += len(spec)
        # A push in buckets (several training processes, or NCCL) is whole with its last bucket.
        if final:
            self.version = int(header["version"])
            if self.log_pushes:
                print(
                    f"cohort serve: holds weights version {self.version} ({self.received} tensors received)",
                    file=sys.stderr,
                    flush=True,
                )
            self.received = 0

    def _generate(self, header: dict[str, Any], blobs: list[bytes]) -> list[bytes]:
        if not self.greeted:
            raise RuntimeError("a generate request arrived before hello")
        if header.get("version") != self.version:
            raise StaleWeightsError(
                f"this worker holds weights of version {self.version}, the request needs {header.get('version')} "
                "(the weight push before it failed)"
            )
        seed = int(header["seed"]) if header.get("seed") is not None else None
        state = torch.frombuffer(bytearray(blobs[0]), dtype=torch.uint8) if blobs else None
        params = params_from_dict(header["params"])
        batch, state = self.backend.generate(
            header["prompt_ids"], int(header["group_size"]), params, seed=seed, state=state
        )
        return batch_reply(batch, state)


def serve(
    model_path: str,
    *,
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    device: str = "cpu",
    dtype: str = "float32",
    attn_implementation: str = "sdpa",
    threads: int = 1,
    parent_pid: int | None = None,
    engine: str = "builtin",
    vllm_options: VLLMOptions | None = None,
) -> int:
    """Returns the exit code after serving requests until interrupted (or until the parent trainer is gone).

    `engine`: builtin (cohort's engines on a transformers model on `device`) or vllm (vLLM's LLM, configured by
    `vllm_options`, a cohort.serve.vllm_backend.VLLMOptions; `device` and `attn_implementation` are vLLM's own)."""
    zmq = zmq_module()
    if parent_pid is not None:
        watch_parent(parent_pid)
    torch.set_num_threads(threads)
    # The port is bound before the model loads: a taken one is reported at once, not after minutes of loading.
    context = zmq.Context()
    sock = context.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    # A peer that vanishes without closing its connection (a machine that went down) is dropped after 10 s.
    sock.setsockopt(zmq.HEARTBEAT_IVL, 2000)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 10000)
    try:
        if port == 0:
            port = sock.bind_to_random_port(f"tcp://{host}")
        else:
            sock.bind(f"tcp://{host}:{port}")
    except zmq.ZMQError as e:
        sock.close(0)
        context.term()
        if e.errno == errno.EADDRINUSE:
            raise ValueError(
                f"{host}:{port} is already in use by another program: pass another --port, or --port 0 for a "
                "free one (printed on start)"
            ) from None
        raise ValueError(f"cannot listen on {host}:{port} ({e}): check --host and --port") from None
    backend: Backend
    try:
        if engine == "vllm":
            backend = VLLMBackend(model_path, dtype=dtype, options=vllm_options or VLLMOptions())
        elif engine == "builtin":
            tokenizer = load_tokenizer(model_path)
            model = load_model(
                model_path, dtype=dtype, device=device, attn_implementation=attn_implementation
            )
            model.eval()
            backend = BuiltinBackend(model, tokenizer, torch.device(device), threads)
        else:
            raise ValueError(f"--engine {engine!r} is not one of builtin, vllm")
    except BaseException:
        sock.close(0)
        context.term()
        raise
    worker = Worker(backend, log_pushes=parent_pid is None)
    print(f"{READY}tcp://{host}:{port} (model {model_path}, {backend.describe()})", flush=True)
    if parent_pid is not None:
        os.dup2(2, 1)  # nothing more on the pipe the trainer read the address from: it is no longer drained
    try:
        while True:
            frames = sock.recv_multipart()
            peer, rest = frames[0], frames[1:]
            after = None
            try:
                header, blobs = unpack(rest)
                reply, after = worker.handle(header, blobs)
                reply[0] = _with_id(reply[0], header.get("id"))
            except NonFiniteSamplingError as e:
                reply = pack({"ok": False, "kind": "non_finite", "error": first_line(e), "id": _id(rest)})
            except Exception as e:  # the trainer gets the message; this worker serves on
                reply = pack({"ok": False, "kind": type(e).__name__, "error": first_line(e), "id": _id(rest)})
            sock.send_multipart([peer, *reply])
            if after is not None:
                try:
                    after()
                except Exception as e:  # the trainer sees its side of the collective fail, and reports it
                    print(f"cohort serve: {first_line(e)}", file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        return 0
    finally:
        sock.close(0)
        context.term()
        backend.close()


def _id(frames: list[bytes]) -> Any:
    """Returns the request id of a message's header (None when unreadable)."""
    try:
        return unpack(frames)[0].get("id")
    except Exception:
        return None


def _with_id(header_frame: bytes, request_id: Any) -> bytes:
    """Returns a reply's header frame with the request's id added (the trainer drops replies it gave up on)."""
    header, _ = unpack([header_frame])
    header["id"] = request_id
    return pack(header)[0]
