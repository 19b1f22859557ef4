"""Multi-process training on PyTorch's FSDP2 engine: the strategies, gathered sampling, sharded checkpoints.

Under ``torchrun`` the policy (and a full reference copy) is wrapped with ``fully_shard`` per decoder
layer, on the decoder and the LM head when their weights are untied (the chunked LM head calls them
separately, so each must gather its own weights), and once at the root, on a device mesh chosen by
``distributed.strategy``:

- ``fsdp``: a 1-D mesh over all processes; parameters, gradients and AdamW state are sharded, each
  process holds 1/K of them and a layer is all-gathered only while it runs;
- ``replicate``: a (K, 1) mesh, FSDP's hybrid form with a shard group of one, i.e. data parallelism:
  every process holds the whole model and optimizer state and FSDP all-reduces the gradients.

FSDP all-gathers a layer's weights inside that layer's forward, a collective every process must join.
Two rules keep the processes in lockstep although each samples different completions:

- work without gradients (sampling, held-out evaluation, the π_old and reference log-prob passes, whose
  counts of forward calls differ between processes) runs inside :func:`gathered`: every module is
  unsharded once, its forwards need no communication, and it is resharded at the end (the memory of
  the whole parameters while sampling, as DeepSpeed's ZeRO-3 gathered generation);
- the update's forward/backward passes run layer by layer (the sharded memory), and every process runs
  the same number of them per optimizer step: processes with fewer micro-batches run
  :func:`idle_backward`, a one-token pass whose loss is 0 (cohort.train.update).

The gradient reduction sums (divide factor 1): cohort's loss is already normalised over the global
batch. Checkpoints of a sharded run are written with ``torch.distributed.checkpoint`` (each process its
shard; loadable on any number of processes); the final model is gathered into a ``save_pretrained``
folder that plain transformers loads.
"""

from __future__ import annotations

import contextlib
import pickle
import warnings
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from cohort import choices
from cohort.choices import STRATEGIES as STRATEGIES  # re-exported: the names live with the config's
from cohort.choices import resolve_strategy as resolve_strategy  # re-exported (trainer, tests)
from cohort.errors import CheckpointMismatchError, UnsafeCheckpointError
from cohort.models import unwrap
from cohort.runtime import distributed as dist
from cohort.runtime.distributed import local as local  # re-exported (benchmarks/sharding)

MIXED_PRECISION = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}
"""distributed.mixed_precision: the dtype FSDP casts parameters to for compute (gradients reduce in float32)."""
if tuple(MIXED_PRECISION) != choices.MIXED_PRECISIONS:  # the config validates against the light list
    raise ImportError(
        f"cohort.choices.MIXED_PRECISIONS {choices.MIXED_PRECISIONS} must name the policies {tuple(MIXED_PRECISION)}"
    )

SHARDED_REASON = (
    "the model is wrapped by FSDP (distributed.strategy) and its LM head shares its weight with the input "
    "embeddings (tied): the decoder and the head, which this path calls separately, cannot be units of their own"
)
"""Why the chunked LM head is off for a sharded model with tied embeddings (the switchboard says it)."""


def fsdp_modules(model: torch.nn.Module | None) -> list[torch.nn.Module]:
    """Returns the FSDP-managed modules inside `model` (empty when it is not sharded)."""
    if model is None:
        return []
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def fsdp_managed(model: torch.nn.Module) -> bool:
    """Returns whether FSDP manages any part of `model`: its parameters are DTensors, or, inside a `gathered` block,
    plain tensors FSDP put in place of them (so the parameters' type alone does not tell)."""
    from torch.distributed.tensor import DTensor

    return bool(fsdp_modules(model)) or any(isinstance(p, DTensor) for p in model.parameters())


def is_sharded(model: torch.nn.Module | None) -> bool:
    """Returns True when `model` is wrapped by FSDP (either strategy)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Returns the model's repeated blocks (transformers' `_no_split_modules` classes): FSDP's units."""
    inner = unwrap(model)
    names = set(getattr(inner, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:  # a model without the attribute: the children of its largest ModuleList
        lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
        layers = list(max(lists, key=lambda m: len(list(m)))) if lists else []
    return layers


def split_units(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module] | None:
    """Returns (decoder, LM head) when they can be FSDP units of their own: both exist and share no parameter
    (a head tied to the input embeddings cannot: one parameter belongs to one unit); else None."""
    inner = unwrap(model)
    get_dec, get_head = getattr(inner, "get_decoder", None), getattr(inner, "get_output_embeddings", None)
    if not callable(get_dec) or not callable(get_head):
        return None
    decoder, head = get_dec(), get_head()
    if not isinstance(decoder, torch.nn.Module) or not isinstance(head, torch.nn.Module) or decoder is inner:
        return None
    if {id(p) for p in head.parameters()} & {id(p) for p in decoder.parameters()}:
        return None
    return decoder, head


def is_split_sharded(model: torch.nn.Module) -> bool:
    """Returns True when the model is sharded with its decoder and LM head as separate FSDP units."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(model, FSDPModule):
        return False
    split = split_units(model)
    return split is not None and all(isinstance(unit, FSDPModule) for unit in split)


def _mesh(strategy: str, world: int) -> Any:
    if strategy == "replicate":
        return dist.device_mesh((world, 1), ("replicate", "shard"))
    return dist.device_mesh((world,), ("shard",))


@dataclass
class Rank0Weights:
    """The whole weights process 0 read, from which a model built on the meta device gets its shards (every
    other process holds none)."""

    state: dict[str, torch.Tensor]
    """Process 0: the model's state dict; elsewhere empty."""
    buffers: dict[str, torch.Tensor]
    """Process 0: every buffer by name, those the state dict leaves out too (rotary `inv_freq`); elsewhere empty."""

    @classmethod
    def of(cls, model: torch.nn.Module | None) -> Rank0Weights:
        """Returns the weights of `model` (process 0's loaded model; None elsewhere: empty)."""
        if model is None:
            return cls({}, {})
        return cls(dict(model.state_dict()), dict(model.named_buffers()))


FILL_CHUNK_BYTES = 256 << 20
"""Bytes of whole tensors process 0 sends per `set_model_state_dict` call when it fills meta-built models. Process
0 lets each chunk go once sent; each call also copies every process's own shards once (torch loads the whole
local state dict), so smaller chunks cost time."""


def fill_from_rank0(models: list[torch.nn.Module], weights: Rank0Weights) -> None:
    """Gives every process its shards of process 0's weights (a collective), in models sharded on the meta device
    (the policy and its reference copy: the same weights), then runs their first forward (see `warm`).

    torch.distributed.checkpoint's `set_model_state_dict(broadcast_from_rank0=True)` sends one tensor at a time
    and each process keeps its shard of it, so no process but 0 ever holds a whole tensor beyond the one in
    flight. It is called chunk by chunk, and process 0 drops each chunk of `weights` once every model has it:
    its peak is its whole copy, not that plus its shards. Buffers are not sharded: process 0 broadcasts each
    one, those outside the state dict included (a rotary embedding's inv_freq, computed when the model was
    built, which a meta-built model lacks)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    for model in models:
        model.to_empty(device=dist.device())
    names = {k: t.numel() * t.element_size() for k, t in models[0].state_dict().items()}  # whole sizes
    missing = sorted(set(names) - set(weights.state)) if dist.is_main() else []
    dist.raise_together(
        ValueError(f"process 0's weights lack {missing[:3]} of the model it reads") if missing else None
    )
    # strict=False: each call loads only its chunk's tensors (the others keep what earlier chunks gave them).
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
    chunk: list[str] = []
    size = 0
    for k, (name, nbytes) in enumerate(names.items()):
        chunk.append(name)
        size += nbytes
        if size < FILL_CHUNK_BYTES and k < len(names) - 1:
            continue
        for model in models:
            part: dict[str, Any] = {n: weights.state[n] for n in chunk} if dist.is_main() else {}
            set_model_state_dict(model, part, options=options)
        for n in chunk:
            weights.state.pop(n, None)  # process 0: the whole tensor goes once every model holds its shard
        chunk, size = [], 0
    with torch.no_grad():
        for model in models:
            for name, buffer in model.named_buffers():
                if dist.is_main():
                    buffer.copy_(weights.buffers[name])
                torch.distributed.broadcast(buffer, src=0)
    for model in models:
        warm(model)


def shard(
    model: torch.nn.Module,
    strategy: str,
    *,
    mixed_precision: str = "none",
    empty: bool = False,
) -> torch.nn.Module:
    """Returns `model`, wrapped in place by fully_shard per decoder layer and at the root on the strategy's mesh;
    `empty`: a model built on the meta device, whose shards fill_from_rank0 then fills (and warms)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = _mesh(strategy, dist.world_size())
    dtype = MIXED_PRECISION[mixed_precision]
    policy = (
        MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        if dtype is not None
        else MixedPrecisionPolicy()
    )
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=True)
    split = split_units(model)
    if split is not None:  # the chunked LM head calls the decoder and the head separately: units of their own
        for unit in split:
            fully_shard(unit, mesh=mesh, mp_policy=policy, reshard_after_forward=True)
    # Whatever the root still holds (embeddings, norm and head when they are not units) is needed again at
    # once by the backward pass: not resharded after the forward.
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    for m in fsdp_modules(model):
        m.set_gradient_divide_factor(1.0)  # type: ignore[operator]  # sum: the loss is globally normalised
        m.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]  # plain SUM (gloo has no PREMUL_SUM)
    if not empty:
        warm(model)
    return model


def warm(model: torch.nn.Module) -> None:
    """Returns None after a sharded model's first forward (one token, no gradient; on every process together).

    FSDP initialises itself lazily at the root's first forward; the chunked LM head and its check call the
    decoder unit directly, which must not come first."""
    with torch.no_grad():
        model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=dist.device()), use_cache=False)
    reshard(model)


def reshard(model: torch.nn.Module) -> None:
    """Returns None once every FSDP module of `model` holds only its shard again: the root, which FSDP reshards
    after its backward, stays whole after a forward without gradients (and the optimizer needs its DTensors)."""
    for m in fsdp_modules(model):
        m.reshard()  # type: ignore[operator]


_GATHERED: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
"""The models an enclosing `gathered` block holds unsharded now."""


@contextlib.contextmanager
def gathered(*models: torch.nn.Module | None) -> Iterator[None]:
    """Yields with every FSDP module of `models` unsharded, so forward calls need no collective; reshards after.

    Every process must enter and leave together (the unshard is an all-gather); inside, each may run any
    number of forward passes, and nested blocks (a step's varying number of sampling rounds) cost nothing.
    A model that is not sharded passes through untouched.
    """
    # A model already gathered by an enclosing block (a step's sampling rounds) is left to that block.
    todo = [m for m in models if m is not None and m not in _GATHERED]
    mods = [m for model in todo for m in fsdp_modules(model)]
    if not mods:
        yield
        return
    roots = {id(model) for model in todo}
    for m in mods:
        m.set_reshard_after_forward(False, recurse=False)  # type: ignore[operator]
        m.unshard()  # type: ignore[operator]
    _GATHERED.update(todo)
    try:
        yield
    finally:
        for model in todo:
            _GATHERED.discard(model)
        for m in mods:
            m.reshard()  # type: ignore[operator]
            m.set_reshard_after_forward(id(m) not in roots, recurse=False)  # type: ignore[operator]


def idle_forward(model: torch.nn.Module, device: torch.device) -> None:
    """Runs a one-token forward without gradients: a process's share of the layers' all-gathers it has no rows for."""
    with torch.no_grad():
        model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device), use_cache=False)


def idle_backward(model: torch.nn.Module, device: torch.device) -> None:
    """Runs a one-token forward and a zero-loss backward: a process's share of a gradient reduction it has no rows for."""
    out = model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device), use_cache=False)
    (out.logits.float().sum() * 0.0).backward()


def full_value(t: torch.Tensor) -> torch.Tensor:
    """Returns the whole value of a DTensor (a collective), or a plain tensor itself."""
    full = getattr(t, "full_tensor", None)
    return full() if callable(full) else t


# ------------------------------------------------------------------------------------------ checkpoints
SHARDED_DIR = "sharded"
"""The subfolder of a checkpoint that holds torch.distributed.checkpoint's files."""


def _state(model, optimizer, reference) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    msd, osd = get_state_dict(model, optimizer)
    state = {"model": msd, "optimizer": osd}
    if reference is not None:
        state["reference"] = get_model_state_dict(reference)
    return state


def save_sharded(folder: Path, model, optimizer, reference=None) -> None:
    """Writes model, optimizer (and reference copy) state to folder/sharded: every process its shard (collective)."""
    import torch.distributed.checkpoint as dcp

    dcp.save(_state(model, optimizer, reference), checkpoint_id=str(folder / SHARDED_DIR))


def _materialise(optimizer: torch.optim.Optimizer) -> None:
    """Creates an optimizer's per-parameter state (a step at learning rate 0 on zero gradients) so a checkpoint
    can be loaded into it: torch's state-dict helpers skip that when gradients exist, and cohort keeps zeros."""
    if optimizer.state:
        return
    lrs = [g["lr"] for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["lr"] = 0.0
        for p in g["params"]:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
    optimizer.step()  # lr 0: no parameter moves (weight decay is scaled by lr too); the state is overwritten
    for g, lr in zip(optimizer.param_groups, lrs):
        g["lr"] = lr


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles a DCP checkpoint's `.metadata` admitting only the classes torch writes there.

    torch's FileSystemReader reads `.metadata` with plain `pickle.load`, so a crafted sharded checkpoint
    would run code on resume; this one refuses any other global (os.system, builtins.eval, ...)."""

    _CLASSES = {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch.serialization", "_get_layout"),
        ("torch", "Size"),
        ("collections", "OrderedDict"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PureWindowsPath"),
    }

    def find_class(self, module: str, name: str) -> Any:
        found = (
            super().find_class(module, name)
            if module.startswith(("torch", "collections", "pathlib"))
            else None
        )
        if (module, name) in self._CLASSES:
            return found
        if module == "torch" and isinstance(found, torch.dtype):
            return found
        if module == "torch.distributed.checkpoint.metadata" and isinstance(found, type):
            return found
        raise pickle.UnpicklingError(f"{module}.{name}")


def read_dcp_metadata(path: Path) -> Any:
    """Returns a DCP `.metadata` file's contents; UnsafeCheckpointError if it pickles anything but DCP's metadata."""
    try:
        with open(path, "rb") as f:
            return _MetadataUnpickler(f).load()
    except (pickle.UnpicklingError, AttributeError, ImportError) as e:
        raise UnsafeCheckpointError(
            f"{path} pickles {e} besides torch.distributed.checkpoint's metadata, which could run code when "
            "loaded; refusing to load it. Resume only from checkpoints you trust: remove this checkpoint folder "
            "(resume=auto then takes the one before) or start a new out_dir"
        ) from None


def _safe_reader(checkpoint_id: str) -> Any:
    """Returns a FileSystemReader for `checkpoint_id` whose metadata goes through :func:`read_dcp_metadata`."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            metadata = read_dcp_metadata(Path(self._get_metadata_path(kwargs.get("rank"))))
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(checkpoint_id)


def load_sharded(folder: Path, model, optimizer, reference=None) -> None:
    """Loads folder/sharded into the model, optimizer (and reference copy), resharding to this run's processes."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    metadata = read_dcp_metadata(folder / SHARDED_DIR / ".metadata")  # refused before anything is loaded
    _materialise(optimizer)
    state = _state(model, optimizer, reference)
    saved = {k: tuple(m.size) for k, m in metadata.state_dict_metadata.items() if hasattr(m, "size")}
    # DCP reads every tensor asked for and nothing else: the checkpoint may hold more, never less.
    mismatch = CheckpointMismatchError.between(saved, _flat_shapes(state), unexpected_ok=True)
    if mismatch is not None:
        raise mismatch
    with warnings.catch_warnings():  # one process reading shards is a supported case, not a surprise
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        try:
            dcp.load(state, storage_reader=_safe_reader(str(folder / SHARDED_DIR)))
        except CheckpointException as e:  # a BaseException holding each process's error: the first one
            causes = [getattr(f, "exception", f) for f in e.failures.values()]
            unsafe = [c for c in causes if isinstance(c, UnsafeCheckpointError)]
            if unsafe:
                raise unsafe[0] from None
            raise ValueError(str(causes[0]) if causes else str(e)) from None
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    if reference is not None:
        set_model_state_dict(reference, state["reference"])


def _flat_shapes(state: dict[str, Any], prefix: str = "") -> dict[str, tuple[int, ...]]:
    """Returns the whole shape of each tensor in a nested state dict, by DCP's dotted name ("model.<fqn>")."""
    shapes: dict[str, tuple[int, ...]] = {}
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, torch.Tensor):
            shapes[name] = tuple(value.shape)
        elif isinstance(value, dict):
            shapes.update(_flat_shapes(value, f"{name}."))
    return shapes


def load_plain_optimizer(model, optimizer, saved: dict[str, Any]) -> None:
    """Loads a one-process checkpoint's optimizer state (keyed by parameter index) into a sharded run's optimizer."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    _materialise(optimizer)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    keyed: dict[str, Any] = {
        "state": {names[int(i)]: s for i, s in saved["state"].items()},
        "param_groups": [
            {**g, "params": [names[int(i)] for i in g["params"]]} for g in saved["param_groups"]
        ],
    }
    set_optimizer_state_dict(model, optimizer, keyed, options=StateDictOptions(full_state_dict=True))


def load_full_weights(model, state_dict: dict[str, Any]) -> None:
    """Loads a whole (unsharded) state dict into a sharded model, each process keeping its shard."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, state_dict, options=StateDictOptions(full_state_dict=True))


def full_state_dict(model) -> dict[str, Any]:
    """Returns the whole state dict on the main process (empty on the others): a collective over all processes."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
