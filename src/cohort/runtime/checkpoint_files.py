"""Atomic checkpoints that resume exactly: model (save_pretrained), optimizer, scheduler, RNG and step.

A checkpoint is written to a temporary folder and renamed into place, so a crash or Ctrl-C mid-save
never leaves a half-written ``step-N`` folder that resume would pick up.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import random
import re
import shutil
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cohort.errors import (
    CheckpointMismatchError,
    DiskFullError,
    UnsafeCheckpointError,
    free_text,
    is_disk_full,
)
from cohort.fastpath.lm_head import unwrap
from cohort.models import corrupt_weights_error, fix_adapter_base_path
from cohort.runtime import distributed as dist

_STEP_DIR = re.compile(r"^step-(\d+)$")


def rng_state(generator: torch.Generator | None = None) -> dict[str, Any]:
    """Return every random-number-generator state a run depends on (tensors and plain values only)."""
    name, keys, pos, has_gauss, gauss = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python": random.getstate(),
        # As a tensor, not an ndarray: a checkpoint must load with torch.load(weights_only=True).
        "numpy": (
            str(name),
            torch.from_numpy(np.asarray(keys).astype(np.int64)),
            int(pos),
            int(has_gauss),
            float(gauss),
        ),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if generator is not None:
        state["generator"] = generator.get_state()
    return state


def set_rng_state(state: dict[str, Any], generator: torch.Generator | None = None) -> None:
    """Restore the states captured by :func:`rng_state`."""
    random.setstate(state["python"])
    name, keys, *rest = state["numpy"]
    # A tensor since checkpoints load with weights_only=True; an ndarray in older checkpoints.
    keys = keys.numpy() if isinstance(keys, torch.Tensor) else np.asarray(keys)
    np.random.set_state((name, keys.astype(np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        # One state per GPU the saving process saw; this one may see fewer (a torchrun job resumed on fewer GPUs,
        # another CUDA_VISIBLE_DEVICES), where set_rng_state_all fails on the first missing index.
        for index, cuda_state in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(cuda_state, index)
    if generator is not None and "generator" in state:
        restore_generator(generator, state["generator"])


def restore_generator(generator: torch.Generator, saved: torch.Tensor) -> None:
    """Returns None after `generator` continues the stream `saved` holds, or, when `saved` is the state of a
    generator of another device type (a CUDA run resumed on a CPU, or the other way: the states differ in size),
    after re-seeding it from a seed drawn from `saved` (the same on every resume of that checkpoint), with a
    warning: the run goes on, not as the original would have."""
    if saved.numel() == generator.get_state().numel():
        generator.set_state(saved)
        return
    seed = int(hashlib.sha256(saved.cpu().numpy().tobytes()).hexdigest()[:15], 16)
    generator.manual_seed(seed)
    warnings.warn(
        f"the checkpoint's sampling generator was saved on another kind of device ({saved.numel()} bytes of state, "
        f"this {generator.device.type} generator's {generator.get_state().numel()}): its stream restarts from a "
        "seed drawn from the saved state; the run continues, but not as it would have on the saving device",
        stacklevel=2,
    )


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    *,
    model: Any,
    tokenizer: Any,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    generator: torch.Generator | None = None,
    extra: dict[str, Any] | None = None,
    keep: int = 2,
    files: dict[str, Any] | None = None,
    write_sharded: Callable[[Path], None] | None = None,
    rank_state: dict[str, Any] | None = None,
) -> Path:
    """Return the folder of a new checkpoint for `step`, written atomically under run_dir/checkpoints.

    The checkpoint is written to a temporary folder, then renamed into place; a complete checkpoint of the
    same step is moved aside first and deleted only once its replacement is in place, so a kill at any
    moment leaves at least one complete checkpoint of the step. A full disk or any other write error is
    one clear OSError naming the folder, and the partial folder is removed. `files` maps extra file names
    to state dicts saved with torch.save inside the checkpoint (e.g. the reference model's weights).

    A sharded run (`write_sharded`, every process calls this): each process writes its shard of the model and
    optimizer through `write_sharded(folder)` and its own `rank_state` (sampling streams) as rank-R.pt; the
    main process then writes the model's config, the tokenizer and the trainer state and renames the folder.
    """
    if write_sharded is not None:
        return _save_sharded(
            run_dir,
            step,
            model,
            tokenizer,
            scheduler,
            generator,
            extra,
            keep,
            files,
            write_sharded,
            rank_state,
        )
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-step-{step}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    return _save_checkpoint_files(
        tmp, root, step, tokenizer, optimizer, scheduler, generator, extra, keep, files, model=model
    )


def _save_checkpoint_files(
    tmp: Path, root: Path, step, tokenizer, optimizer, scheduler, generator, extra, keep, files, *, model
) -> Path:
    """Returns the checkpoint folder after writing everything but the shards into `tmp` and renaming it in place."""
    final = root / f"step-{step}"
    old = root / f".old-step-{step}"
    try:
        if model is not None:
            model.save_pretrained(tmp, safe_serialization=True)
            fix_adapter_base_path(tmp)  # an adapter records a base path that resolves from anywhere
        tokenizer.save_pretrained(tmp)
        state = {"step": step, "rng": rng_state(generator), "extra": extra or {}}
        if optimizer is not None:
            state["optimizer"] = optimizer.state_dict()
        if scheduler is not None:
            state["scheduler"] = scheduler.state_dict()
        for name, value in (files or {}).items():
            torch.save(value, tmp / name)
        torch.save(state, tmp / "trainer_state.pt")
        (tmp / "step.json").write_text(json.dumps({"step": step}))
    except Exception as e:  # noqa: BLE001 - safetensors and tokenizers raise their own types for a full disk
        error = _write_error(e, step, tmp)  # before the removal, which frees the space it reads
        shutil.rmtree(tmp, ignore_errors=True)
        raise error from None
    if final.exists():
        if old.exists():
            shutil.rmtree(old)
        final.rename(old)  # the complete old copy stays on disk until its replacement is in place
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)
    _prune(root, keep)
    return final


def _write_error(e: BaseException, step: int, tmp: Path) -> BaseException:
    """Returns the one error a failed checkpoint write raises: OSError naming the step and folder (ENOSPC said
    plainly); an error that is no I/O failure is returned as it is."""
    causes = [e, *(getattr(f, "exception", f) for f in getattr(e, "failures", {}).values())]  # DCP's wrapper
    chain = [c for c in causes if isinstance(c, BaseException)]
    for c in list(chain):
        if c.__cause__ is not None:
            chain.append(c.__cause__)
    if is_disk_full(e, tmp):
        return DiskFullError(
            f"no space left on device while writing the checkpoint of step {step} to {tmp} (removed; "
            f"{free_text(tmp)} free there); free some space (or lower keep_checkpoints) and resume with "
            "resume=auto: the previous checkpoints are intact"
        )
    io = next((c for c in chain if isinstance(c, OSError)), None)
    if io is not None:
        return OSError(io.errno, f"could not write the checkpoint of step {step} to {tmp} (removed): {io}")
    return e


def _save_sharded(
    run_dir, step, model, tokenizer, scheduler, generator, extra, keep, files, write_sharded, rank_state
) -> Path:
    root = Path(run_dir) / "checkpoints"
    tmp = root / f".tmp-step-{step}"
    main = dist.is_main()
    if main:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    dist.barrier()
    error: BaseException | None = None
    try:
        write_sharded(tmp)  # collective: torch.distributed.checkpoint, every process its shard
        torch.save(rank_state or {}, tmp / f"rank-{dist.rank()}.pt")
    except BaseException as e:  # DCP's CheckpointException is a BaseException holding each process's error
        if isinstance(e, KeyboardInterrupt):
            raise
        error = _write_error(e, step, tmp)  # before the removal, which frees the space it reads
    # Every process agrees before any moves on; a failure (a full disk meets them all) is told once, by process 0.
    try:
        dist.raise_once(error)
    except BaseException:
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    final = root / f"step-{step}"
    if main:
        try:
            unwrap(model).config.save_pretrained(tmp)  # type: ignore[union-attr,operator]  # a transformers config
        except Exception as e:  # noqa: BLE001 - as in _save_checkpoint_files
            error = _write_error(e, step, tmp)
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            try:
                folder = _save_checkpoint_files(
                    tmp, root, step, tokenizer, None, scheduler, generator, extra, keep, files, model=None
                )
                assert folder == final
            except Exception as e:  # noqa: BLE001 - its own error, its temporary folder removed
                error = e
    dist.raise_once(error)  # no process moves on (and, say, saves again) before the folder is in place
    return final


def _prune(root: Path, keep: int) -> None:
    steps = list_checkpoints(root.parent)  # oldest first
    for old in steps[: max(0, len(steps) - max(keep, 1))]:
        shutil.rmtree(old, ignore_errors=True)


def set_aside_newer(run_dir: str | Path, step: int) -> list[Path]:
    """Returns the new names of the checkpoints newer than `step`, renamed ``abandoned-step-N``.

    A run resumed from an earlier checkpoint (the newer ones unreadable, or an explicit resume= folder)
    starts a new branch: the newer folders must neither be resumed from later nor count towards
    keep_checkpoints, or pruning would delete the checkpoint the run just resumed from. They are kept
    on disk, never deleted, because they may be all that is left of a long run."""
    moved = []
    for ckpt in list_checkpoints(run_dir):
        if int(ckpt.name.split("-")[1]) <= step:
            continue
        target = ckpt.with_name(f"abandoned-{ckpt.name}")
        n = 1
        while target.exists():
            target = ckpt.with_name(f"abandoned-{ckpt.name}.{n}")
            n += 1
        ckpt.rename(target)
        moved.append(target)
    return moved


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Return the complete checkpoint folders of a run, oldest first."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    for old in root.glob(".old-step-*"):
        # A kill between moving a checkpoint aside and renaming its replacement into place: restore it.
        final = root / old.name[len(".old-") :]
        if not final.exists() and (old / "trainer_state.pt").is_file():
            old.rename(final)
    found = [
        (int(m.group(1)), p)
        for p in root.iterdir()
        if (m := _STEP_DIR.match(p.name)) and (p / "trainer_state.pt").is_file()
    ]
    return [p for _, p in sorted(found)]


def find_resume_dir(resume: str, run_dir: str | Path) -> Path | None:
    """Return the checkpoint folder `resume` names ("auto" = latest in run_dir, None if there is none)."""
    if resume == "auto":
        found = list_checkpoints(run_dir)
        return found[-1] if found else None
    path = Path(resume)
    if not path.exists():
        found = list_checkpoints(run_dir)
        fix = (
            f"{run_dir} has {', '.join(p.name for p in found)}: pass one of them, or resume=auto for the newest"
            if found
            else f"{run_dir} has no checkpoint: leave resume unset to start the run"
        )
        raise FileNotFoundError(f"resume={resume!r}: there is no such folder; {fix}")
    if not (path / "trainer_state.pt").is_file():
        raise FileNotFoundError(
            f"resume={resume!r} is not a cohort checkpoint (no trainer_state.pt inside); pass a "
            f"run_dir/checkpoints/step-N folder or resume=auto"
        )
    return path


def _numpy_globals() -> list[Any]:
    """Returns what an ndarray needs to unpickle: older checkpoints saved numpy's random state as one."""
    core = getattr(np, "_core", None) or np.core  # numpy 2 renamed numpy.core
    reconstruct = core.multiarray._reconstruct
    return [
        np.ndarray,
        np.dtype,
        type(np.dtype(np.uint32)),
        (reconstruct, "numpy.core.multiarray._reconstruct"),
        (reconstruct, "numpy._core.multiarray._reconstruct"),
    ]


def load_state_file(path: str | Path, map_location: Any = "cpu") -> Any:
    """Returns the contents of a checkpoint's .pt file, loaded with torch.load(weights_only=True).

    Only tensors, numbers, strings and plain containers load (and numpy arrays, which older checkpoints
    hold); a file that pickles anything else, which could run code, raises UnsafeCheckpointError. A
    truncated or corrupt file raises ValueError, RuntimeError or EOFError (resume then tries the checkpoint
    before)."""
    path = Path(path)
    try:
        with torch.serialization.safe_globals(_numpy_globals()):
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError:
        if not zipfile.is_zipfile(path):  # not torch's format at all: torn or garbage, nothing was run
            raise ValueError(f"{path} is not a file torch.save wrote (truncated or corrupt)") from None
        try:
            unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
        except Exception:  # noqa: BLE001 - the listing is a courtesy; the refusal stands without it
            unsafe = []
        held = f" ({', '.join(unsafe[:5])})" if unsafe else ""
        raise UnsafeCheckpointError(
            f"{path} holds pickled Python objects{held}, not only tensors and plain containers: cohort never "
            "writes those, and they could run code when loaded; refusing to load it. Resume only from checkpoints you trust: remove this checkpoint "
            "folder (resume=auto then takes the one before) or start a new out_dir"
        ) from None


def load_trainer_state(ckpt_dir: str | Path) -> dict[str, Any]:
    """Return the trainer state saved in a checkpoint folder (tensors and plain values only)."""
    return load_state_file(Path(ckpt_dir) / "trainer_state.pt")


def readable_checkpoints(run_dir: str | Path) -> list[tuple[Path, dict[str, Any]]]:
    """Return (folder, trainer state) of every complete checkpoint whose state loads, newest first.

    An unreadable checkpoint (a truncated or corrupted file) is skipped with a warning naming it, so
    resume falls back to the previous one instead of failing."""
    out = []
    for ckpt in reversed(list_checkpoints(run_dir)):
        try:
            state = load_trainer_state(ckpt)
            if not isinstance(state, dict) or "step" not in state:
                raise ValueError("no step recorded")
        except UnsafeCheckpointError:
            raise  # a crafted file is a reason to stop, not to quietly take another checkpoint
        except Exception as e:  # noqa: BLE001 - any unreadable checkpoint is skipped, never fatal
            warnings.warn(
                f"checkpoint {ckpt} is unreadable ({type(e).__name__}: {e}); trying the one before",
                stacklevel=2,
            )
            continue
        out.append((ckpt, state))
    return out


def load_model_weights(
    model: Any, ckpt_dir: str | Path, load: Callable[[dict[str, Any]], Any] | None = None
) -> None:
    """Load the weights saved in a checkpoint folder into `model` in place (full model or LoRA adapter).

    `load` takes the whole state dict instead of `model.load_state_dict` (a sharded model keeps its shard).
    Raises CheckpointMismatchError, before anything is loaded, when the checkpoint's tensors do not fit."""
    ckpt_dir = Path(ckpt_dir)
    adapter = (ckpt_dir / "adapter_model.safetensors").is_file()
    try:
        if adapter:
            from peft import get_peft_model_state_dict, set_peft_model_state_dict
            from safetensors.torch import load_file

            weights = load_file(str(ckpt_dir / "adapter_model.safetensors"))
        else:
            from transformers import AutoModelForCausalLM

            weights = AutoModelForCausalLM.from_pretrained(
                ckpt_dir, dtype=next(model.parameters()).dtype
            ).state_dict()
    except Exception as e:
        corrupt = corrupt_weights_error(str(ckpt_dir), e)
        if corrupt is None:
            raise
        raise corrupt from None
    # peft loads an adapter by the names both sides have (others are skipped); torch's loaders take all or none.
    own = get_peft_model_state_dict(model) if adapter else model.state_dict()
    mismatch = CheckpointMismatchError.between(
        _shapes(weights), _shapes(own), missing_ok=adapter, unexpected_ok=adapter
    )
    if mismatch is not None:
        raise mismatch
    if adapter:
        set_peft_model_state_dict(model, weights)
    else:
        (load or model.load_state_dict)(weights)


def _shapes(state: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Returns the shape of each tensor of a state dict by name (a sharded tensor's whole shape)."""
    return {k: tuple(v.shape) for k, v in state.items() if isinstance(v, torch.Tensor)}
