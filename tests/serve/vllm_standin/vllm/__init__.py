"""A STAND-IN for the `vllm` package, for cohort's tests. It is NOT vLLM: nothing it does shows that vLLM runs
cohort's worker, and no test that uses it claims so (docs/vllm.md: the vLLM worker has not run anywhere).

What it is for: checking cohort's side of the seam in cohort.serve.vllm_backend and cohort.serve.vllm_extension:
the arguments cohort passes (engine settings, SamplingParams, prompts, seeds, RPC calls), and what cohort makes of
vLLM's answers (finish reasons, token ids, log-probs). Every call is recorded in `CALLS` (in the test's process)
and, when the environment variable COHORT_VLLM_STANDIN_LOG names a file, appended there as a JSON line (for a
test that runs it inside a `cohort serve --engine vllm` process).

What it mirrors, as read in the wheels of vLLM 0.27.0, 0.32.0, 0.33.0 and 0.34.0 (the same in the four, but where
said):

- `LLM` (vllm/entrypoints/llm.py): `__init__(model, *, dtype="auto", seed=0, gpu_memory_utilization=0.92 (None
  from 0.34: sized to the free memory, cohort always passes one),
  tensor_parallel_size=1, enforce_eager=False, **kwargs)` (kwargs go to EngineArgs, vllm/engine/arg_utils.py:
  max_model_len, enable_prefix_caching, logprobs_mode, worker_extension_cls); `generate(prompts,
  sampling_params=None, *, use_tqdm=True, lora_request=None, priority=None, ...)` returning one RequestOutput
  per prompt in the prompts' order; `collective_rpc(method, timeout=None, args=(), kwargs=None)` returning one
  result per worker; `reset_prefix_cache(reset_running_requests=False, reset_connector=False)`;
  `llm_engine.model_config.dtype` (a torch.dtype once resolved); the engine seed in [0, 2**32 - 1] (checked
  by 0.34, vllm/config/model.py).
- `SamplingParams` (vllm/sampling_params.py): the fields cohort sets and their checks (temperature in [0, 2],
  one in (0, 0.01) raised to 0.01, top_p in (0, 1], top_k 0 or -1 = off, max_tokens >= 1, n = 1 when greedy,
  seed -1 = None).
- `RequestOutput` / `CompletionOutput` (vllm/outputs.py) and `Logprob` (vllm/logprobs.py): completion token ids
  with the stop token kept (vllm/v1/engine/output_processor.py drops it from the text only), finish_reason
  "stop" or "length" (vllm/v1/request.py), one {token_id: Logprob} per sampled token with logprobs=0.
- Seeds: sample i of a request with seed s uses seed s + i (vllm/v1/engine/parallel_sampling.py).
- Stopping: EOS / stop_token_ids first, then max_tokens (vllm/v1/core/sched/utils.py check_stop).
- The worker extension (vllm/v1/worker/worker_base.py): the class named by worker_extension_cls is imported by
  qualified name and added to the worker's bases, after asserting it adds no name the worker already has.
- collective_rpc's arguments cross msgpack in vLLM's engine core, which does not rebuild tensors
  (vllm/v1/serial_utils.py, vllm/v1/engine/core.py): the stand-in refuses any argument that is not plain data.
- logprobs_mode="processed_logprobs": the sampled token's log_softmax(logits / temperature) (raw logits when
  greedy), after top-k / top-p (vllm/v1/sample/sampler.py; 0.34: vllm/v1/worker/gpu/sample/sampler.py); the stand-in has no top-k / top-p (cohort never
  sends them to vLLM) and refuses them.

How it samples: the transformers model of the folder on the CPU, token by token, each sample from its own
torch.Generator seeded as above. Nothing like vLLM's kernels, batching or memory management.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import warnings
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

__version__ = "0.0.0+cohort-test-standin"

CALLS: list[tuple[str, Any]] = []
"""Every call made to the stand-in, in order: (what, details)."""


def record(what: str, details: Any) -> None:
    """Returns None after recording a call (CALLS, and the log file when COHORT_VLLM_STANDIN_LOG is set)."""
    CALLS.append((what, details))
    path = os.environ.get("COHORT_VLLM_STANDIN_LOG")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"what": what, "details": details}) + "\n")


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    prompt_logprobs: Any
    outputs: list[CompletionOutput]
    finished: bool


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: list[int] | None = None
    max_tokens: int | None = 16
    logprobs: int | None = None
    detokenize: bool = True
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.seed == -1:
            self.seed = None
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}.")
        if 0 < self.temperature < 0.01:
            warnings.warn(f"temperature {self.temperature} is less than 0.01, set to 0.01", stacklevel=2)
            self.temperature = 0.01
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be 0 (disable), or at least 1, got {self.top_k}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if self.temperature < 1e-5 and self.n > 1:
            raise ValueError(f"n must be 1 when using greedy sampling, got {self.n}.")


class _WorkerBase:
    """Some of the names vLLM's GPU worker has (vllm/v1/worker/gpu_worker.py), for the extension's clash check."""

    def load_model(self) -> None: ...
    def reload_weights(self) -> None: ...
    def update_weights(self, update_info: Any) -> None: ...
    def init_weight_transfer_engine(self, init_info: Any) -> None: ...
    def get_model(self) -> Any: ...
    def sleep(self, level: int = 1) -> None: ...
    def wake_up(self, tags: Any = None) -> None: ...
    def execute_model(self, scheduler_output: Any) -> None: ...


class _Model:
    """What `worker.model_runner.model` is in the stand-in: `load_weights` copies tensors named as in the
    transformers checkpoint into the transformers model (vLLM's maps them onto its own modules)."""

    def __init__(self, hf: torch.nn.Module) -> None:
        self.hf = hf

    def load_weights(self, weights) -> set[str]:
        """Returns the names loaded, after copying each (name, tensor) into the model's tensor of that name."""
        state = self.hf.state_dict()
        loaded = []
        for name, tensor in weights:
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"load_weights got {type(tensor).__name__} for {name}, not a tensor")
            target = state[name]  # KeyError: a name the checkpoint does not have
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(f"{name}: shape {tuple(tensor.shape)}, the model's is {tuple(target.shape)}")
            with torch.no_grad():
                target.copy_(tensor)
            loaded.append([name, list(tensor.shape), str(tensor.dtype).removeprefix("torch.")])
        record("load_weights", loaded)
        return {name for name, _, _ in loaded}


def _plain(value: Any) -> bool:
    """Returns whether a value would cross vLLM's RPC as itself (msgpack: no tensors, no objects)."""
    if isinstance(value, str | int | float | bool | type(None)):
        return True
    if isinstance(value, list | tuple):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    return False


def digest(model: torch.nn.Module) -> str:
    """Returns a SHA-256 of a model's state dict (names and float32 values), to compare weights across processes."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()


class LLM:
    """The stand-in engine (see the module's docstring)."""

    DEFAULTS = {
        "tensor_parallel_size": 1,
        "dtype": "auto",
        "seed": 0,
        "gpu_memory_utilization": 0.92,
        "enforce_eager": False,
        "max_model_len": None,
        "enable_prefix_caching": None,
        "logprobs_mode": "raw_logprobs",
        "worker_extension_cls": "",
    }
    """The arguments of vllm.LLM (and of EngineArgs, which its **kwargs reach) cohort may pass, with vLLM's
    defaults; any other is refused, so a misspelt one fails here as it would in vLLM."""

    def __init__(self, model: str, **kwargs: Any) -> None:
        from transformers import AutoModelForCausalLM

        unknown = set(kwargs) - set(self.DEFAULTS)
        if unknown:
            raise TypeError(f"the stand-in does not know the engine arguments {sorted(unknown)}")
        record("LLM", {"model": model, **kwargs})
        self.settings = {**self.DEFAULTS, **kwargs}
        if not 0 <= self.settings["seed"] <= 2**32 - 1:
            raise ValueError(f"seed {self.settings['seed']} is outside [0, 2**32 - 1]")  # 0.34's ModelConfig
        dtype = self.settings["dtype"]
        torch_dtype = torch.float32 if dtype in ("auto", "float32", "float") else getattr(torch, dtype)
        hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch_dtype).eval()
        self.llm_engine = SimpleNamespace(model_config=SimpleNamespace(dtype=torch_dtype))
        worker_cls = type("Worker", (_WorkerBase,), {})
        qualname = self.settings["worker_extension_cls"]
        if qualname:
            module, _, name = qualname.rpartition(".")
            extension = getattr(importlib.import_module(module), name)
            for attr in dir(extension):
                if attr.startswith("__"):
                    continue
                assert not hasattr(worker_cls, attr), f"{attr} clashes with the worker's"
            worker_cls.__bases__ = worker_cls.__bases__ + (extension,)
        self.worker = worker_cls()
        self.worker.model_runner = SimpleNamespace(model=_Model(hf))
        # what vLLM's GPU worker sets (vllm/v1/worker/gpu_worker.py): its rank, and its device (here the CPU)
        self.worker.rank = 0
        self.worker.device = torch.device("cpu")
        self.hf = hf

    def generate(
        self,
        prompts: Any,
        sampling_params: Any = None,
        *,
        use_tqdm: bool = True,
        lora_request: Any = None,
        priority: Any = None,
        **kwargs: Any,
    ) -> list[RequestOutput]:
        """Returns one RequestOutput per prompt, in the prompts' order (each with its n samples)."""
        prompts = prompts if isinstance(prompts, list) else [prompts]
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError("The lengths of prompts and sampling_params must be the same.")
        record(
            "generate",
            {
                "prompts": [p["prompt_token_ids"] for p in prompts],
                "params": [dict(vars(sp)) for sp in params],
                "use_tqdm": use_tqdm,
            },
        )
        out = []
        for i, (prompt, sp) in enumerate(zip(prompts, params)):
            ids = list(prompt["prompt_token_ids"])
            samples = [
                self._sample(ids, sp, None if sp.seed is None else sp.seed + k, k) for k in range(sp.n)
            ]
            out.append(RequestOutput(str(i), None, ids, None, samples, True))
        return out

    @torch.no_grad()
    def _sample(
        self, prompt: list[int], sp: SamplingParams, seed: int | None, index: int
    ) -> CompletionOutput:
        """Returns one sample of a prompt, decoded token by token with the transformers model."""
        if sp.top_p < 1.0 or sp.top_k > 0:
            raise NotImplementedError("the stand-in has no top-p / top-k")
        if self.settings.get("logprobs_mode") != "processed_logprobs":
            raise NotImplementedError("the stand-in reports processed_logprobs only")
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        stops = set(sp.stop_token_ids or [])
        ids = list(prompt)
        tokens: list[int] = []
        logprobs: list[dict[int, Logprob]] = []
        finish, stop_reason = "length", None
        for _ in range(sp.max_tokens or 16):
            logits = self.hf(torch.tensor([ids])).logits[0, -1].float()
            if sp.temperature < 1e-5:
                token = int(logits.argmax())
                logp = torch.log_softmax(logits, -1)
            else:
                logp = torch.log_softmax(logits / sp.temperature, -1)
                token = int(torch.multinomial(logp.exp(), 1, generator=generator))
            tokens.append(token)
            ids.append(token)
            logprobs.append({token: Logprob(float(logp[token]), rank=int((logp > logp[token]).sum()) + 1)})
            if token in stops:
                finish, stop_reason = "stop", token
                break
        return CompletionOutput(
            index,
            "",
            tokens,
            sum(lp[t].logprob for lp, t in zip(logprobs, tokens)),
            logprobs,
            finish,
            stop_reason,
        )

    def collective_rpc(
        self, method: Any, timeout: float | None = None, args: tuple = (), kwargs: dict | None = None
    ) -> list[Any]:
        """Returns the method's result on the (one) worker, after refusing arguments vLLM's RPC would not carry."""
        if not isinstance(method, str):
            raise TypeError("the stand-in takes method names only")
        if not _plain(list(args)) or not _plain(kwargs or {}):
            raise TypeError(f"collective_rpc({method!r}) got arguments msgpack would not carry as they are")
        record("collective_rpc", {"method": method, "args": list(args)})
        return [getattr(self.worker, method)(*args, **(kwargs or {}))]

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """Returns True, recording the digest of the weights held at that moment (after a whole push)."""
        record("reset_prefix_cache", {"weights": digest(self.hf)})
        return True
