"""`cohort serve --engine vllm`: a rollout worker whose completions come from vLLM.

NOT RUN: no machine this was written on had a GPU with vLLM installed (docs/vllm.md). What is tested is cohort's
side of the seam, against a stand-in `vllm` package that records calls (tests/serve/test_serve_vllm.py).

Written against vLLM's own source, read in the wheels of 0.27.0, 0.32.0, 0.33.0 and 0.34.0 (the calls below are
the same in all four): `vllm.LLM` (vllm/entrypoints/llm.py: __init__, generate, collective_rpc, reset_prefix_cache),
`vllm.SamplingParams` (vllm/sampling_params.py), `RequestOutput` / `CompletionOutput` (vllm/outputs.py), the
`logprobs_mode` engine argument (vllm/config/model.py, vllm/engine/arg_utils.py) and the worker extension
(vllm/v1/worker/worker_base.py). TRL's `trl/scripts/vllm_serve.py` makes the same calls for its weight sync
(a worker extension whose method calls `model_runner.model.load_weights`, `logprobs_mode="processed_logprobs"`);
this module shares the idea, not the code.

The trainer's side is unchanged: the same hello, identity check, gloo weight channel and generate requests as
a builtin worker. What differs here:

- **Sampling.** One vLLM request per prompt with `n = group_size` (vLLM shares the prompt's KV cache across the
  n samples), `max_tokens`, the temperature (0 when greedy), top-p / top-k, the EOS ids as `stop_token_ids`
  and `logprobs=0` (the sampled token's log-prob only). The engine runs with
  `logprobs_mode="processed_logprobs"`: the log-prob of the sampled token under logits / temperature (raw
  logits when greedy; vllm/v1/sample/sampler.py, in 0.34 vllm/v1/worker/gpu/sample/sampler.py), cohort's convention (RolloutBatch.sampling_logprobs, and the
  trainer's log-probs at rollout.logprob_temperature()). vLLM computes that log-prob after top-p / top-k
  renormalise the distribution, cohort before; so this worker refuses top_p < 1 and top_k > 0 rather than
  report log-probs the trainer would misread (the config refuses them first).
- **Seeds.** vLLM cannot take a torch generator state; a request's chunk seed (drawn by the trainer from its
  own generator, so the trainer's stream stays reproducible) is turned into one seed per prompt, and vLLM seeds
  sample i of a prompt with seed + i (vllm/v1/engine/parallel_sampling.py). The identity says
  `generator_state: False`, so the trainer always sends seeds. Not bit-equal to the in-process engine.
- **Weights.** Over gloo a push is received by this process, into files in shared memory (/dev/shm; the
  temporary folder when it lacks room), then
  `LLM.collective_rpc("cohort_load_weights", ...)` has every vLLM worker map those files and hand the tensors
  to its model's `load_weights` (cohort.serve.vllm_extension). Over NCCL (rollout.weight_transport; the
  trainer on a GPU of its own) every vLLM GPU worker joins the trainer's group itself (ranks 1..n,
  `cohort_open_channel`) and receives each push straight into its GPU (`cohort_receive`), as TRL's vllm-serve
  does with its communicator. After a whole push the prefix cache is reset
  (its KV entries were computed by the old weights). Only file names and numbers cross vLLM's RPC: its engine
  core decodes arguments with msgpack, which does not rebuild tensors (vllm/v1/serial_utils.py,
  vllm/v1/engine/core.py `_convert_msgspec_args`), and vLLM's docstring asks for control messages only there.
- **LoRA** pushes (adapter tensors only) are refused on hello: merge the adapter or use a builtin worker.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from cohort.choices import (
    DTYPE_NAMES,
    VLLM_GPU_MEMORY_UTILIZATION,
    VLLM_MAX_TEMPERATURE,
    VLLM_MIN_TEMPERATURE,
)
from cohort.models import is_adapter_folder, load_model, load_tokenizer, stop_token_ids
from cohort.rollout import RolloutBatch, SamplingParams
from cohort.rollout.base import validate_request
from cohort.serve import weights
from cohort.serve.backend import CPU, Backend
from cohort.serve.protocol import identity

EXTENSION = "cohort.serve.vllm_extension.WeightLoader"
"""The worker extension class vLLM mixes into its workers (LLM(worker_extension_cls=...), by qualified name)."""

LOAD_METHOD = "cohort_load_weights"
"""Its method that loads a push (a name no vLLM worker has: vLLM asserts there is no clash)."""

PROBE_METHOD, OPEN_METHOD, RECEIVE_METHOD = "cohort_probe", "cohort_open_channel", "cohort_receive"
"""Its methods that say what a vLLM worker can receive on, join an NCCL weight channel, and receive a push."""


@dataclass
class InVLLMChannel:
    """A weight channel whose receivers are vLLM's GPU workers (they hold the process group, not this process)."""

    transport: str
    device: torch.device


SEED_BOUND = 2**62
"""Per-prompt seeds are drawn below this: vLLM adds the sample's index and keeps seeds as int64 (its model
runner V2, vllm/v1/worker/gpu/sample/states.py) or hands them to torch.Generator.manual_seed."""


def vllm_module() -> Any:
    """Returns the vllm package; ImportError naming the extra to install when it is missing."""
    # The engine core runs in this process unless the environment says otherwise: a worker a trainer started is
    # SIGKILLed when the trainer goes (cohort.serve.worker.die_with_parent), and vLLM's engine core process,
    # unlike its GPU worker processes (a death pipe, vllm/v1/executor/multiproc_executor.py), would outlive it.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    try:
        import vllm
    except ModuleNotFoundError as e:
        if e.name != "vllm":
            raise  # vLLM is there but one of its own imports failed: that message is the useful one
        raise ImportError(
            "`cohort serve --engine vllm` needs vLLM, which is not installed: pip install 'cohort[vllm]' "
            "(on a machine with a GPU; see docs/vllm.md)"
        ) from None
    return vllm


@dataclass
class VLLMOptions:
    """The vLLM engine settings `cohort serve --engine vllm` passes to `vllm.LLM` (None: vLLM's default)."""

    seed: int = 0
    """The engine's seed (LLM(seed=...)): only requests without a seed of their own use it."""
    gpu_memory_utilization: float = VLLM_GPU_MEMORY_UTILIZATION
    """Share of each GPU's memory vLLM may take for the weights, activations and KV cache (always passed)."""
    tensor_parallel_size: int | None = None
    """GPUs the model is split over (those CUDA_VISIBLE_DEVICES shows, in order)."""
    max_model_len: int | None = None
    """Longest prompt + completion in tokens (None: the model's)."""
    enable_prefix_caching: bool | None = None
    """Reuse the KV cache of prompt prefixes across requests (reset after every weight push)."""
    enforce_eager: bool | None = None
    """No CUDA graphs (faster start, slower decoding)."""

    def llm_kwargs(self) -> dict[str, Any]:
        """Returns the keyword arguments of vllm.LLM these settings give (the unset ones left to vLLM)."""
        return {k: v for k, v in vars(self).items() if v is not None}


class VLLMBackend(Backend):
    """vLLM's LLM on the worker's GPUs, with the model's HF layout kept for the identity and the pushes."""

    name = "vllm"

    def __init__(
        self, model_path: str, *, dtype: str = "float32", options: VLLMOptions | None = None, vllm: Any = None
    ) -> None:
        """`vllm`: the vllm package (None: imported here, ImportError naming the extra when missing)."""
        if is_adapter_folder(model_path):
            raise ValueError(
                f"{model_path} is a LoRA adapter folder and vLLM serves whole models: merge it first (`cohort merge "
                f"{model_path} OUT`) and serve OUT"
            )
        self.vllm = vllm if vllm is not None else vllm_module()
        options = options or VLLMOptions()
        self.model_path = model_path
        vllm_dtype = DTYPE_NAMES.get(str(dtype).lower())
        if vllm_dtype is None:
            raise ValueError(f"--dtype {dtype!r} is not one of {', '.join(DTYPE_NAMES)}")
        self.tokenizer = load_tokenizer(model_path)
        # The transformers model on the meta device (no weights read): its tensor names and shapes are what the
        # trainer pushes and compares, its generation config names the stop tokens, as on a builtin worker.
        layout = load_model(model_path, dtype=vllm_dtype, device="meta")
        self.eos, self.pad = stop_token_ids(layout, self.tokenizer)
        self.shapes = {name: list(t.shape) for name, t in layout.state_dict().items()}
        self._identity = identity(layout, self.tokenizer, self.eos, self.pad)
        del layout
        self.llm = self.vllm.LLM(
            model=model_path,
            dtype=vllm_dtype,
            worker_extension_cls=EXTENSION,
            logprobs_mode="processed_logprobs",
            **options.llm_kwargs(),
        )
        # What each vLLM GPU worker can receive a push on: NCCL only when every one of them can.
        probes = self.llm.collective_rpc(PROBE_METHOD)
        nccl = all("nccl" in p["transports"] for p in probes)
        # The dtype vLLM loaded (it resolves "auto" its own way: float16 for a float32 checkpoint, on a GPU).
        config = getattr(getattr(self.llm, "llm_engine", None), "model_config", None)
        loaded = getattr(config, "dtype", None)
        if isinstance(loaded, torch.dtype):
            self._identity["dtype"] = str(loaded).removeprefix("torch.")
        self._identity.update(
            # vLLM runs its own attention kernels: nothing to compare with the trainer's (protocol.mismatch)
            attn_implementation="vllm",
            engine=self.name,
            device="cuda",
            # it samples from seeds only; the trainer sends one per chunk (client._ticket)
            generator_state=False,
            transports=["gloo", "nccl"] if nccl else ["gloo"],
            gpus=[p["gpu"] for p in probes if p["gpu"] is not None],
            receivers=len(probes),
        )
        # Pushes land in shared memory where there is room for them (a container's /dev/shm is often 64 MiB, and
        # writing past a full tmpfs kills the process with SIGBUS), else in the temporary folder (page cache).
        self.shm_dir = (
            tempfile.mkdtemp(prefix="cohort-vllm-push-", dir="/dev/shm")
            if os.path.isdir("/dev/shm")
            else None
        )
        self.disk_dir = tempfile.mkdtemp(prefix="cohort-vllm-push-")
        self._cleanup = weakref.finalize(self, _remove, [self.shm_dir, self.disk_dir])
        self._files: list[list] = []
        self._pushes = 0

    def hello(self, header: dict[str, Any]) -> None:
        """Returns None for a trainer sampling with rollout.engine=vllm and no LoRA adapter; ValueError else."""
        if header.get("engine", "builtin") != "vllm":
            raise ValueError(
                f"this worker samples with vLLM (cohort serve --engine vllm) and the trainer with "
                f"rollout.engine={header.get('engine', 'builtin')}: set rollout.engine=vllm, or start the worker "
                "without --engine vllm"
            )
        if header.get("lora") is not None:
            raise ValueError(
                "a vLLM worker does not take LoRA adapter pushes (not built): train the full model "
                "(model.lora.enabled=false), merge the adapter into the model first (cohort merge), or use a "
                "builtin worker (rollout.engine=builtin)"
            )

    def identity(self) -> dict[str, Any]:
        """Returns the identity of the model vLLM serves, built from its tokenizer and config as a builtin worker's."""
        return dict(self._identity)

    def open_channel(self, header: dict[str, Any]) -> Any:
        """Returns this process's gloo channel, or for NCCL the channel every vLLM GPU worker joined (each as rank
        1 + its vLLM rank of the trainer's group)."""
        transport = header.get("transport", "gloo")
        if transport != "nccl":
            return super().open_channel(header)
        args = (header["store_host"], int(header["store_port"]), header["prefix"], int(header["size"]))
        self.llm.collective_rpc(OPEN_METHOD, args=(*args, float(header["timeout"])))
        return InVLLMChannel(transport, torch.device("cuda"))

    def receive(self, channel: Any, spec: list[list], *, final: bool) -> None:
        """Returns None once the push is the served model's: received here into files (gloo), or by vLLM's GPU
        workers themselves (NCCL); after its last bucket the prefix cache is reset."""
        if not isinstance(channel, InVLLMChannel):
            super().receive(channel, spec, final=final)
            return
        sizes = weights.dtype_sizes(spec)
        self.llm.collective_rpc(
            RECEIVE_METHOD, args=([[d, n] for d, n in sizes.items()], self._tensors(spec))
        )
        if final:
            self.llm.reset_prefix_cache()

    def receive_buffers(self, spec: list[list], device: torch.device = CPU) -> list[torch.Tensor]:
        """Returns one buffer per dtype, each backed by a file (in shared memory when it has room) that vLLM's
        workers map (`device` is host memory: a gloo push)."""
        sizes = weights.dtype_sizes(spec)
        self._drop_files()  # a push whose transfer failed left its files
        self._pushes += 1
        folder = self.files_dir(sum(numel * weights.torch_dtype(d).itemsize for d, numel in sizes.items()))
        buffers = []
        for dtype, numel in sizes.items():
            path = os.path.join(folder, f"{self._pushes}-{dtype}") if numel else ""
            kind = weights.torch_dtype(dtype)
            # shared=True: the file is created, and what gloo writes into the tensor is the file's content
            buffers.append(
                torch.from_file(path, shared=True, size=numel, dtype=kind)
                if numel
                else torch.empty(0, dtype=kind)
            )
            self._files.append([path, dtype, numel])
        return buffers

    def load(self, spec: list[list], buffers: list[torch.Tensor], *, final: bool) -> None:
        """Returns None once every vLLM worker loaded the push's tensors (and, after the last bucket, the prefix
        cache is reset); KeyError naming a tensor the served model lacks."""
        try:
            self.llm.collective_rpc(LOAD_METHOD, args=(self._files, self._tensors(spec)))
        finally:
            self._drop_files()
        if final:
            self.llm.reset_prefix_cache()

    def _tensors(self, spec: list[list]) -> list[list]:
        """Returns [name, dtype, offset, numel, shape] of each tensor of a push, its offset in its dtype's flat
        buffer; KeyError naming a tensor the served model lacks in that size."""
        offsets: dict[str, int] = {}
        tensors = []
        for name, dtype, numel in spec:
            shape = self.shapes.get(name)
            if shape is None or _numel(shape) != int(numel):
                raise KeyError(
                    f"the push holds {name!r} ({numel} values), which {self.model_path} has not in that size "
                    "(the handshake compares layouts, so a trainer of another model does not get here)"
                )
            at = offsets.get(dtype, 0)
            tensors.append([name, dtype, at, int(numel), shape])
            offsets[dtype] = at + int(numel)
        return tensors

    def generate(
        self,
        prompt_ids: list[list[int]],
        group_size: int,
        params: SamplingParams,
        *,
        seed: int | None,
        state: torch.Tensor | None,
    ) -> tuple[RolloutBatch, torch.Tensor | None]:
        """Returns vLLM's batch for the request, sampled from per-prompt seeds derived from its seed (no state)."""
        if state is not None:
            raise ValueError(
                "a vLLM worker samples from seeds, not from the trainer's generator state (its identity says "
                "generator_state: false); install the same cohort version on the trainer and the worker"
            )
        validate_request(prompt_ids, group_size, params)
        check_params(params)
        requests = sampling_params(
            self.vllm, params, group_size, prompt_seeds(seed, len(prompt_ids)), self.eos
        )
        prompts = [{"prompt_token_ids": [int(t) for t in p]} for p in prompt_ids]
        outputs = self.llm.generate(prompts, requests, use_tqdm=False)
        return read_outputs(outputs, prompt_ids, group_size, params, self.eos), None

    def describe(self) -> str:
        """Returns "vllm" and the vLLM version (the ready line's words after the model's name)."""
        return f"vllm {getattr(self.vllm, '__version__', '?')}"

    def close(self) -> None:
        """Returns None after removing the push files' folders."""
        self._cleanup()

    def files_dir(self, nbytes: int) -> str:
        """Returns the folder a push of `nbytes` is received into: shared memory when it has room (with a
        quarter to spare), else the temporary folder."""
        if self.shm_dir is not None:
            stats = os.statvfs(self.shm_dir)
            if stats.f_bavail * stats.f_frsize >= nbytes * 1.25:
                return self.shm_dir
        return self.disk_dir

    def _drop_files(self) -> None:
        """Returns None after removing the current push's files (mappings over them live on until freed)."""
        for path, _, _ in self._files:
            if path and os.path.exists(path):
                os.unlink(path)
        self._files = []


def _remove(folders: list[str | None]) -> None:
    """Returns None after removing the push folders (and whatever a killed push left in them)."""
    for folder in folders:
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)


def _numel(shape: list[int]) -> int:
    """Returns the number of values of a tensor of this shape."""
    n = 1
    for d in shape:
        n *= int(d)
    return n


MAX_TEMPERATURE, MIN_TEMPERATURE = VLLM_MAX_TEMPERATURE, VLLM_MIN_TEMPERATURE  # what the config checks too


def check_params(params: SamplingParams) -> None:
    """Returns None; ValueError when the request asks for top-p or top-k, whose log-probs vLLM reports
    renormalised and cohort's trainer unrenormalised (greedy requests ignore both), or a temperature vLLM
    refuses or changes."""
    if params.greedy:
        return
    if params.top_p < 1.0 or params.top_k > 0:
        raise ValueError(
            f"a vLLM worker does not sample with top_p={params.top_p} / top_k={params.top_k}: vLLM reports the "
            "log-probs after top-p / top-k renormalise the distribution and the trainer compares them with its own "
            "before; set rollout.top_p=1.0 and rollout.top_k=0, or use rollout.engine=builtin"
        )
    if params.temperature > MAX_TEMPERATURE:
        raise ValueError(
            f"a vLLM worker does not sample at temperature {params.temperature}: vLLM takes at most "
            f"{MAX_TEMPERATURE:g}; lower rollout.temperature, or use rollout.engine=builtin"
        )
    if params.temperature < MIN_TEMPERATURE:
        raise ValueError(
            f"a vLLM worker does not sample at temperature {params.temperature}: vLLM would sample at "
            f"{MIN_TEMPERATURE:g} instead and the trainer recompute at {params.temperature}; set "
            f"rollout.temperature >= {MIN_TEMPERATURE:g} (or 0 for greedy), or use rollout.engine=builtin"
        )


def prompt_seeds(seed: int | None, n: int) -> list[int | None]:
    """Returns one vLLM seed per prompt of a request, drawn from its seed (None: vLLM's own randomness)."""
    if seed is None:
        return [None] * n
    generator = torch.Generator().manual_seed(int(seed))
    return [int(s) for s in torch.randint(SEED_BOUND, (n,), generator=generator).tolist()]


def sampling_params(
    vllm: Any, params: SamplingParams, group_size: int, seeds: list[int | None], eos: list[int]
) -> list[Any]:
    """Returns the vllm.SamplingParams of each prompt of a request (greedy: one sample, repeated by
    read_outputs; vLLM refuses n > 1 with temperature 0)."""
    out = []
    for seed in seeds:
        out.append(
            vllm.SamplingParams(
                n=1 if params.greedy else group_size,
                max_tokens=params.max_completion_length,
                temperature=0.0 if params.greedy else float(params.temperature),
                top_p=1.0 if params.greedy else float(params.top_p),
                top_k=0 if params.greedy else int(params.top_k),
                seed=seed,
                stop_token_ids=list(eos),
                logprobs=0,  # the sampled token's log-prob only
                detokenize=False,  # cohort reads token ids; the text would be thrown away
            )
        )
    return out


def read_outputs(
    outputs: list[Any], prompt_ids: list[list[int]], group_size: int, params: SamplingParams, eos: list[int]
) -> RolloutBatch:
    """Returns the RolloutBatch of vLLM's RequestOutputs, one per prompt in request order: each completion's
    tokens (its EOS included), truncated where vLLM's finish_reason is "length", the sampled tokens' log-probs;
    RuntimeError for an output that does not fit (another count, finish reason or stop token)."""
    if len(outputs) != len(prompt_ids):
        raise RuntimeError(f"vLLM returned {len(outputs)} outputs for {len(prompt_ids)} prompts")
    completions: list[list[int]] = []
    truncated: list[bool] = []
    logprobs: list[torch.Tensor] = []
    stops = set(eos)
    for j, out in enumerate(outputs):
        samples = sorted(out.outputs, key=lambda c: c.index)
        if params.greedy:
            samples = samples[:1] * group_size  # the argmax is the same for every sample of the group
        if len(samples) != group_size:
            raise RuntimeError(f"vLLM returned {len(samples)} completions of prompt {j}, not {group_size}")
        for c in samples:
            ids = [int(t) for t in c.token_ids]
            if c.finish_reason == "length":
                truncated.append(True)
            elif c.finish_reason == "stop" and ids and ids[-1] in stops:
                truncated.append(False)
            else:
                raise RuntimeError(
                    f"vLLM ended a completion of prompt {j} with finish_reason={c.finish_reason!r} "
                    f"(stop_reason={getattr(c, 'stop_reason', None)!r}, last token "
                    f"{ids[-1] if ids else None}); cohort expects 'length', or 'stop' at one of {sorted(stops)}"
                )
            if c.logprobs is None or len(c.logprobs) != len(ids):
                raise RuntimeError(
                    f"vLLM returned {0 if c.logprobs is None else len(c.logprobs)} log-probs for a completion of "
                    f"{len(ids)} tokens (logprobs=0 asks for one per sampled token)"
                )
            logprobs.append(
                torch.tensor([float(at[t].logprob) for at, t in zip(c.logprobs, ids)], dtype=torch.float32)
            )
            completions.append(ids)
    return RolloutBatch(
        prompt_ids=[list(p) for p in prompt_ids],
        completion_ids=completions,
        truncated=torch.tensor(truncated, dtype=torch.bool),
        group_size=group_size,
        sampling_logprobs=logprobs,
    )
