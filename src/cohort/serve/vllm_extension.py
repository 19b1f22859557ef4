"""Code that runs inside vLLM's worker processes for `cohort serve --engine vllm`: loading a weight push, from
files the cohort worker received it into (gloo), or received by the vLLM worker itself over NCCL.

vLLM imports `WeightLoader` by its qualified name (LLM(worker_extension_cls="cohort.serve.vllm_extension.
WeightLoader")) and adds it to the bases of its GPU worker class (vllm/v1/worker/worker_base.py, 0.27.0 to
0.34.0), so `LLM.collective_rpc("cohort_load_weights", args=...)` runs the method below on every worker, with
`self` the worker (its `model_runner.model` is the vLLM model). vLLM asserts that the extension adds no name
its worker already has: hence the `cohort_` prefix.

NOT RUN inside vLLM (docs/vllm.md); tests/serve/test_serve_vllm.py runs it against a stand-in worker. It
imports only torch and cohort.serve.weights (torch only), as it is imported in every vLLM worker process.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from cohort.serve import weights


class WeightLoader:
    """The methods vLLM mixes into its workers (see the module's docstring)."""

    model_runner: Any
    """vLLM's worker provides it (an annotation only: vLLM's name-clash check reads attributes, not this)."""
    rank: int
    """The worker's rank among vLLM's workers (vLLM's worker sets it)."""
    device: torch.device
    """The worker's GPU (vLLM's worker sets it when it initialises its device)."""
    cohort_channel: Any
    """The NCCL weight channel `cohort_open_channel` joined (set then: an annotation only, as above)."""

    def cohort_probe(self) -> dict[str, Any]:
        """Returns this worker's GPU UUID (None off a GPU) and the transports it can receive a push on."""
        device = getattr(self, "device", torch.device("cpu"))
        return {"gpu": weights.gpu_uuid(device), "transports": weights.receivable(device)}

    def cohort_open_channel(self, host: str, port: int, prefix: str, size: int, timeout: float) -> int:
        """Returns this worker's rank in the trainer's NCCL weight group (1 + its vLLM rank), after joining it
        through the trainer's store at host:port."""
        store = weights.join_store(host, port, timeout)
        rank = 1 + int(self.rank)
        address = weights.local_address_towards(host)
        self.cohort_channel = weights.Channel(
            store, prefix, rank, address, timeout, transport="nccl", size=size, device=self.device
        )
        return rank

    def cohort_receive(self, sizes: list[list], tensors: list[list]) -> int:
        """Returns the number of tensors handed to the model's `load_weights` after receiving a push over the
        NCCL channel: `sizes` [dtype, numel] of each flat buffer in the trainer's order, `tensors` as
        `cohort_load_weights` takes them."""
        channel = self.cohort_channel
        flats = {
            dtype: torch.empty(int(numel), dtype=getattr(torch, dtype), device=channel.device)
            for dtype, numel in sizes
        }
        channel.wait(channel.broadcast(list(flats.values())))
        self.model_runner.model.load_weights(weights=_views(flats, tensors))
        return len(tensors)

    def cohort_load_weights(self, files: list[list], tensors: list[list]) -> int:
        """Returns the number of tensors handed to the model's `load_weights`.

        `files`: [path, dtype, numel] of each flat buffer the cohort worker received a push into (a file in
        shared memory; "" for an empty one). `tensors`: [name, dtype, offset, numel, shape] of each tensor, named
        as the trainer's transformers model names it, which is what vLLM's `load_weights` reads from a
        checkpoint (it maps them onto its own fused modules, and splits them across tensor-parallel ranks)."""
        flats: dict[str, torch.Tensor] = {}
        for path, dtype, numel in files:
            kind = getattr(torch, dtype)
            # shared=False: a private, read-only use of the file's pages (nothing is written back)
            flats[dtype] = (
                torch.from_file(path, shared=False, size=numel, dtype=kind)
                if numel
                else torch.empty(0, dtype=kind)
            )

        # The call TRL's weight sync and vLLM's RLHF examples make (trl/scripts/vllm_serve.py update_named_param;
        # examples/offline_inference/rlhf.py): the tensors are copied into vLLM's parameters in place.
        self.model_runner.model.load_weights(weights=_views(flats, tensors))
        return len(tensors)


def _views(flats: dict[str, torch.Tensor], tensors: list[list]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (name, the tensor's view into its dtype's flat buffer) of each [name, dtype, offset, numel, shape]."""
    for name, dtype, offset, numel, shape in tensors:
        yield name, flats[dtype][offset : offset + numel].view(shape)
