"""The messages between a trainer and a rollout worker (`cohort serve`), and what each side checks of the other.

A message is a list of ZeroMQ frames: a JSON header, then raw byte blobs (a generator's state, log-probs as
float32). Nothing is pickled: a worker never runs code a peer sent it, and a trainer never loads an object a
worker built. Tensors travel as their bytes, so what arrives is bit-for-bit what was sent.

Requests (header `op`): `hello` (versions, then the engine the trainer samples with; the worker answers with
its identity), `channel` (open the weight-push process group), `weights` (receive a push), `generate`
(sample groups), `bye` (the trainer is done). Every reply carries `ok`, and `error` with a one-line message
when the request failed.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from typing import Any

import torch

from cohort import __version__
from cohort.rollout import RolloutBatch, SamplingParams

PROTOCOL = 1
"""Bumped whenever a message changes shape: a trainer and a worker of different protocols refuse each other."""

DEFAULT_PORT = 5555
"""The port `cohort serve` listens on unless --port says otherwise."""


def pack(header: dict[str, Any], blobs: list[bytes] | None = None) -> list[bytes]:
    """Returns the frames of a message: the JSON header, then each blob."""
    return [json.dumps(header).encode(), *(blobs or [])]


def unpack(frames: list[bytes]) -> tuple[dict[str, Any], list[bytes]]:
    """Returns (header, blobs) of a message's frames; ValueError when the header is not a JSON object."""
    if not frames:
        raise ValueError("empty message")
    header = json.loads(frames[0].decode())
    if not isinstance(header, dict):
        raise ValueError(f"a message header must be a JSON object, got {type(header).__name__}")
    return header, list(frames[1:])


def params_to_dict(params: SamplingParams) -> dict[str, Any]:
    """Returns the sampling parameters as a JSON-ready dict."""
    d = asdict(params)
    if not d["logprobs_topk"]:
        # Off, the request is the one workers have always been sent (no worker returns top-K log-probs).
        del d["logprobs_topk"]
    return d


def params_from_dict(d: dict[str, Any]) -> SamplingParams:
    """Returns the SamplingParams of a request (their own checks run on it)."""
    return SamplingParams(**d)


def tensor_bytes(t: torch.Tensor) -> bytes:
    """Returns a tensor's raw bytes, in its own dtype (through a uint8 view: numpy has no bfloat16)."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def batch_reply(batch: RolloutBatch, generator_state: torch.Tensor | None) -> list[bytes]:
    """Returns the frames of a generate reply: the completions, then log-probs and the generator's state."""
    logps = batch.sampling_logprobs
    assert logps is not None  # the engines behind a worker always report them
    flat = torch.cat(logps) if logps else torch.zeros(0)
    header = {
        "ok": True,
        "completion_ids": batch.completion_ids,
        "truncated": batch.truncated.tolist(),
        "paths": batch.paths,
        "has_state": generator_state is not None,
    }
    blobs = [tensor_bytes(flat.float())]
    if generator_state is not None:
        blobs.append(tensor_bytes(generator_state))
    return pack(header, blobs)


def read_batch(
    header: dict[str, Any], blobs: list[bytes], prompt_ids: list[list[int]], group_size: int
) -> tuple[RolloutBatch, torch.Tensor | None]:
    """Returns (the RolloutBatch of a generate reply, the worker's advanced generator state or None)."""
    completions = [list(c) for c in header["completion_ids"]]
    flat = torch.frombuffer(bytearray(blobs[0]), dtype=torch.float32) if blobs[0] else torch.zeros(0)
    lengths = [len(c) for c in completions]
    if sum(lengths) != flat.numel() or len(completions) != len(prompt_ids) * group_size:
        raise ValueError(
            f"a worker's reply holds {len(completions)} completions and {flat.numel()} log-probs for "
            f"{len(prompt_ids)} prompts x {group_size} (a worker of another protocol?)"
        )
    state = torch.frombuffer(bytearray(blobs[1]), dtype=torch.uint8) if header.get("has_state") else None
    batch = RolloutBatch(
        prompt_ids=[list(p) for p in prompt_ids],
        completion_ids=completions,
        truncated=torch.tensor(header["truncated"], dtype=torch.bool),
        group_size=group_size,
        sampling_logprobs=list(flat.split(lengths)) if completions else [],
        paths={k: bool(v) for k, v in header.get("paths", {}).items()},
    )
    return batch, state


def weights_layout(model: torch.nn.Module) -> list[tuple[str, list[int]]]:
    """Returns the (name, shape) of every tensor of the model's state dict, in its order."""
    return [(name, list(t.shape)) for name, t in model.state_dict().items()]


def _digest(obj: Any) -> str:
    """Returns a short SHA-256 of a JSON-ready object."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def identity(model: torch.nn.Module, tokenizer: Any, eos_ids: list[int], pad_id: int) -> dict[str, Any]:
    """Returns what a trainer and a worker compare before any weight moves: versions, the model's architecture
    and tensor layout, the tokenizer's vocabulary and stop tokens."""
    config = getattr(model, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    return {
        "cohort": __version__,
        "protocol": PROTOCOL,
        "model_type": getattr(config, "model_type", type(model).__name__),
        "name": str(getattr(config, "_name_or_path", "") or "?"),
        "layout": _digest(weights_layout(model)),
        "vocab": _digest(sorted(tokenizer.get_vocab().items())),
        "stop": {"eos": list(eos_ids), "pad": pad_id},
        "attn_implementation": impl,
        "dtype": str(next(iter(model.parameters())).dtype).removeprefix("torch."),
    }


def mismatch(trainer: dict[str, Any], worker: dict[str, Any], where: str) -> str | None:
    """Returns a one-line error naming the first difference that forbids training with this worker (None: none).

    `where` names the worker (its address). The dtype may differ: the worker casts what it receives. A vLLM
    worker's attention is not compared (its kernels are vLLM's)."""
    fix_model = f"start the worker with the trainer's model (cohort serve --model {trainer['name']})"
    checks = [
        (
            "protocol",
            f"the worker at {where} runs cohort {worker.get('cohort')} (protocol {worker.get('protocol')}) and "
            f"the trainer cohort {trainer['cohort']} (protocol {trainer['protocol']}): install the same cohort "
            "version on both",
        ),
        (
            "cohort",
            f"the worker at {where} runs cohort {worker.get('cohort')} and the trainer cohort "
            f"{trainer['cohort']}: install the same cohort version on both",
        ),
        (
            "model_type",
            f"the worker at {where} serves a {worker.get('model_type')} model ({worker.get('name')}) and the "
            f"trainer trains a {trainer['model_type']} ({trainer['name']}): {fix_model}",
        ),
        (
            "layout",
            f"the worker at {where} serves {worker.get('name')}, whose tensors differ from those of the trained "
            f"model {trainer['name']} (another size or variant): {fix_model}",
        ),
        (
            "vocab",
            f"the worker at {where} has another tokenizer vocabulary than the trainer's ({worker.get('name')} "
            f"vs {trainer['name']}): {fix_model}",
        ),
        (
            "stop",
            f"the worker at {where} stops at tokens {worker.get('stop')} and the trainer at {trainer['stop']}: "
            f"{fix_model}",
        ),
        (
            "attn_implementation",
            f"the worker at {where} runs attention {worker.get('attn_implementation')!r} and the trainer "
            f"{trainer['attn_implementation']!r}: start the worker with --attn-implementation "
            f"{trainer['attn_implementation']}",
        ),
    ]
    for key, message in checks:
        if key == "attn_implementation" and worker.get("engine") == "vllm":
            continue  # vLLM runs its own kernels: such a worker is not bit-equal to the trainer anyway
        if worker.get(key) != trainer.get(key):
            return message
    return None
