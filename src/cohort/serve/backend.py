"""What a rollout worker samples with: a `Backend` holds the worker's copy of the model and the engine that samples
from it, behind the few calls the worker's request loop makes (cohort.serve.worker).

Two exist: `BuiltinBackend` (a transformers module in this process and one of cohort's engines, builtin or hf:
`cohort serve`, the default) and `cohort.serve.vllm_backend.VLLMBackend` (vLLM's `LLM`: `cohort serve --engine
vllm`). The request loop, the protocol, the weight channel and the timeouts are the worker's and the same for
both; a backend only answers what differs: what a trainer's hello configures, the identity the trainer checks,
where a weight push lands (and who receives it: this process, or vLLM's GPU workers over NCCL), and how a
generate request is sampled.
"""

from __future__ import annotations

import abc
from typing import Any

import torch

from cohort.config import LoraConfig
from cohort.fastpath import FastConfig
from cohort.models import stop_token_ids, wrap_lora
from cohort.rollout import RolloutBatch, SamplingParams, make_engine
from cohort.rollout.base import RolloutEngine
from cohort.serve import weights
from cohort.serve.protocol import identity

CPU = torch.device("cpu")


class Backend(abc.ABC):
    """A worker's model and sampler (see the module's docstring)."""

    name: str = "?"
    """The `cohort serve --engine` value that selects it, and the engine it reports in its identity."""

    @abc.abstractmethod
    def hello(self, header: dict[str, Any]) -> None:
        """Returns None once configured for a trainer's hello (its engine, fast paths, LoRA settings); raises
        ValueError with a one-line message naming the fix when it cannot serve that trainer."""

    @abc.abstractmethod
    def identity(self) -> dict[str, Any]:
        """Returns what the trainer compares before any weight moves (cohort.serve.protocol.identity), with the
        worker's engine, its device type, and whether it samples from the trainer's generator state."""

    @abc.abstractmethod
    def receive_buffers(self, spec: list[list], device: torch.device = CPU) -> list[torch.Tensor]:
        """Returns the flat buffers on `device` a push of this spec is received into (one per dtype, as
        cohort.serve.weights.empty_buffers lays them out)."""

    def channel_device(self, transport: str) -> torch.device:
        """Returns where a push over `transport` lands in this process (host memory for gloo)."""
        return CPU

    def open_channel(self, header: dict[str, Any]) -> Any:
        """Returns the weight channel a trainer's `channel` request opens: a weights.Channel in this process (rank
        1 of the trainer's group, over the transport the trainer chose)."""
        timeout = float(header["timeout"])
        store = weights.join_store(header["store_host"], int(header["store_port"]), timeout)
        address = weights.local_address_towards(header["store_host"])
        transport = header.get("transport", "gloo")
        return weights.Channel(
            store,
            header["prefix"],
            1,
            address,
            timeout,
            transport=transport,
            size=int(header.get("size", 2)),
            device=self.channel_device(transport),
        )

    def receive(self, channel: Any, spec: list[list], *, final: bool) -> None:
        """Returns None once a push's tensors arrived over `channel` and are the model's (`final`: its last
        bucket)."""
        buffers = self.receive_buffers(spec, channel.device)
        channel.wait(channel.broadcast(buffers))
        self.load(spec, buffers, final=final)

    @abc.abstractmethod
    def load(self, spec: list[list], buffers: list[torch.Tensor], *, final: bool) -> None:
        """Returns None once the received tensors are the model's (`final`: the push's last bucket)."""

    @abc.abstractmethod
    def generate(
        self,
        prompt_ids: list[list[int]],
        group_size: int,
        params: SamplingParams,
        *,
        seed: int | None,
        state: torch.Tensor | None,
    ) -> tuple[RolloutBatch, torch.Tensor | None]:
        """Returns (the request's RolloutBatch, the advanced generator state when the request carried one)."""

    def describe(self) -> str:
        """Returns what the worker's ready line says about it after the model's name."""
        return self.name

    def close(self) -> None:  # noqa: B027 (optional: most backends hold nothing to release)
        """Returns None after releasing what the backend holds outside Python's memory (nothing here)."""


class BuiltinBackend(Backend):
    """A transformers model in this process, sampled by the engine the trainer's hello names (builtin or hf)
    from the trainer's own generator state: the draws are the in-process engine's."""

    name = "builtin"

    def __init__(
        self, model: torch.nn.Module, tokenizer: Any, device: torch.device, threads: int = 1
    ) -> None:
        self.model, self.tokenizer, self.device, self.threads = model, tokenizer, device, threads
        self.engine: RolloutEngine | None = None
        self.autocast: torch.dtype | None = None

    def hello(self, header: dict[str, Any]) -> None:
        """Returns None after wrapping the model with the trainer's LoRA settings (once) and building its engine;
        ValueError for a trainer that samples with vLLM."""
        name = header.get("engine", "builtin")
        if name == "vllm":
            raise ValueError(
                "this worker samples with cohort's engines (builtin, hf) and the trainer with rollout.engine=vllm: "
                "start the worker with `cohort serve --engine vllm`, or set rollout.engine=builtin"
            )
        lora = header.get("lora")
        if lora is not None and not hasattr(self.model, "disable_adapter"):
            # the trainer trains an adapter: the same modules here, so pushes can name the adapter's tensors
            self.model = wrap_lora(self.model, LoraConfig(**lora)).eval()
        eos, pad = stop_token_ids(self.model, self.tokenizer)
        fast = header.get("fast")
        options = {"fast": FastConfig(**fast)} if name == "builtin" and fast else {}
        self.engine = make_engine(name, eos_token_ids=eos, pad_token_id=pad, **options)
        autocast = header.get("autocast")
        if autocast is not None and not isinstance(getattr(torch, str(autocast), None), torch.dtype):
            raise ValueError(
                f"the trainer asked to sample under autocast to {autocast!r}, which is no torch dtype"
            )
        # Autocast only where the trainer's own passes take it (CUDA): a CPU worker samples as the trainer does.
        self.autocast = (
            getattr(torch, autocast) if autocast is not None and self.device.type == "cuda" else None
        )

    def identity(self) -> dict[str, Any]:
        """Returns the model's identity, the engine built on hello, the device type, the transports a push may
        take and the worker's GPU (its UUID: NCCL cannot pair it with a trainer on the same GPU)."""
        eos, pad = stop_token_ids(self.model, self.tokenizer)
        engine = self.engine.name if self.engine is not None else None
        gpu = weights.gpu_uuid(self.device)
        return {
            **identity(self.model, self.tokenizer, eos, pad),
            "device": self.device.type,
            "engine": engine,
            "transports": weights.receivable(self.device),
            "gpus": [gpu] if gpu is not None else [],
            "receivers": 1,
        }

    def channel_device(self, transport: str) -> torch.device:
        """Returns the model's device for NCCL (straight into its GPU), host memory for gloo."""
        return self.device if transport == "nccl" else CPU

    def receive_buffers(self, spec: list[list], device: torch.device = CPU) -> list[torch.Tensor]:
        """Returns fresh buffers on `device` for the push."""
        return weights.empty_buffers(spec, device)

    def load(self, spec: list[list], buffers: list[torch.Tensor], *, final: bool) -> None:
        """Returns None after copying each received tensor into the model's tensor of that name."""
        weights.apply(self.model, spec, buffers)

    def generate(
        self,
        prompt_ids: list[list[int]],
        group_size: int,
        params: SamplingParams,
        *,
        seed: int | None,
        state: torch.Tensor | None,
    ) -> tuple[RolloutBatch, torch.Tensor | None]:
        """Returns the engine's batch drawn from the request's seed or generator state, and the advanced state."""
        assert self.engine is not None  # the worker refuses generate requests before hello
        generator = torch.Generator(device=self.device)
        if seed is not None:
            generator.manual_seed(int(seed))
        elif state is not None:
            generator.set_state(state)
        with torch.autocast(
            self.device.type, dtype=self.autocast or torch.bfloat16, enabled=self.autocast is not None
        ):
            batch = self.engine.generate(self.model, prompt_ids, group_size, params, generator)
        return batch, generator.get_state() if state is not None else None

    def describe(self) -> str:
        """Returns the device and torch thread count (the ready line's words since the first worker)."""
        return f"{self.device}, {self.threads} thread(s)"
