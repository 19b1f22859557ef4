"""A training run's checkpoints: which one to resume from (checked against the config), writing one of the
current state, and loading one back into the run's parts (whole or sharded, on any process count)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from cohort.config import TrainConfig, current_keys, to_dict
from cohort.errors import (
    CheckpointMismatchError,
    ConfigError,
    ConfigWarning,
    NonFiniteError,
    RunExistsError,
    TrainingError,
    UnsafeCheckpointError,
    disk_full_named,
    first_line,
)
from cohort.models import fix_adapter_base_path
from cohort.reference import Reference
from cohort.report import quiet_hf_progress
from cohort.runtime import distributed as dist
from cohort.runtime import seeds
from cohort.runtime.checkpoint_files import (
    find_resume_dir,
    list_checkpoints,
    load_model_weights,
    load_state_file,
    load_trainer_state,
    readable_checkpoints,
    save_checkpoint,
)
from cohort.runtime.rundir import config_changes, logged_rows, logged_steps
from cohort.runtime.sharding import (
    SHARDED_DIR,
    full_state_dict,
    load_full_weights,
    load_plain_optimizer,
    load_sharded,
    local,
    save_sharded,
)
from cohort.train.state import StateRegistry

Candidate = tuple[Path, dict[str, Any]]
"""A checkpoint folder and its trainer_state.pt contents."""


def find_checkpoints(cfg: TrainConfig, run_dir: Path, *, trl_form: bool = False) -> list[Candidate]:
    """Returns the checkpoints to resume from, newest first ([] to start afresh), after checking the run
    directory and the config.

    Refuses (RunExistsError) to start over a run directory that already holds a run unless resume is set,
    and (ConfigError) to resume with a config that differs from the checkpoint's in anything but the keys
    that may change between attempts (see RESUMABLE_CHANGES), unless allow_config_change is set.
    """
    if not dist.is_main() and not cfg.resume:
        return []
    if not cfg.resume:
        earlier = logged_steps(run_dir)
        found = list_checkpoints(run_dir)
        if logged_rows(run_dir) or found:
            how = (
                "call trainer.train(resume_from_checkpoint=True) to continue it, or choose another output_dir"
                if trl_form
                else "pass resume=auto to continue it (TRL's form: trainer.train(resume_from_checkpoint=True)), "
                "or choose another out_dir"
            )
            raise RunExistsError(
                f"out_dir={str(run_dir)!r} already holds a run ({earlier} logged steps, "
                f"{len(found)} checkpoints): {how}"
            )
        return []
    candidates = (
        readable_checkpoints(run_dir)
        if cfg.resume == "auto"
        else [(p, load_trainer_state(p)) for p in [find_resume_dir(cfg.resume, run_dir)] if p]
    )
    if not candidates:
        if logged_rows(run_dir):
            print(
                f"resume=auto: {run_dir} has logs but no checkpoint; starting from step 0 (the earlier "
                "attempt's logs are kept as *.jsonl.before-restart)",
                flush=True,
            )
            for name in ("metrics", "samples", "evals", "health"):
                path = run_dir / f"{name}.jsonl"
                if path.is_file():
                    path.replace(path.with_suffix(".jsonl.before-restart"))
        return []
    done = int(candidates[0][1]["step"])
    if done > cfg.steps:
        raise ConfigError(
            f"resume: checkpoint {candidates[0][0]} is at step {done}, past steps={cfg.steps}; steps is the "
            f"total number of steps, not the number to add: set steps > {done} to train further"
        )
    saved = candidates[0][1].get("extra", {}).get("config")
    if saved is not None and not cfg.allow_config_change:
        changed = config_changes(current_keys(saved), to_dict(cfg))  # an older cohort's keys, renamed
        if changed:
            listing = "; ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in changed[:8])
            workers = (
                " (rollout.workers: restart the workers at the same addresses the run used)"
                if any(k == "rollout.workers" for k, _, _ in changed)
                else ""
            )
            raise ConfigError(
                f"resume: the config differs from the one checkpoint {candidates[0][0]} was trained with "
                f"({listing}{'; ...' if len(changed) > 8 else ''}); restore those values{workers}, or set "
                "allow_config_change=true to continue with the new ones"
            )
    before = (saved or {}).get("steps")
    schedule = cfg.optim.schedule
    if isinstance(before, int) and before != cfg.steps and schedule != "constant" and dist.is_main():
        warnings.warn(
            f"resume: steps changed from {before} to {cfg.steps} under optim.schedule={schedule}: the rate now "
            f"decays over {cfg.steps} steps where the first {done} decayed over {before}, so it jumps at the resume "
            f"and the run is not the one {cfg.steps} steps from the start would have been",
            ConfigWarning,
            stacklevel=2,
        )
    return candidates


def data_fingerprint(rows: Sequence[dict[str, Any]] | None) -> dict[str, Any] | None:
    """Returns the training rows' count and SHA-256 (of their JSON, keys sorted; None without rows)."""
    if rows is None:
        return None
    digest = hashlib.sha256()
    for row in rows:
        digest.update(json.dumps(row, sort_keys=True, default=str).encode())
        digest.update(b"\n")
    return {"rows": len(rows), "sha256": digest.hexdigest()}


class RunCheckpoints:
    """Writes and loads the checkpoints of one run: the policy (whole or as each process's shard), optimizer,
    schedule, reference, and every registered stateful part."""

    def __init__(
        self,
        run_dir: Path,
        cfg: TrainConfig,
        *,
        model: torch.nn.Module,
        tokenizer: Any,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        generator: torch.Generator,
        reference: Reference | None,
        parts: StateRegistry,
        sharded: bool,
        device: torch.device,
        restart_streams: Callable[[int], None],
        data: dict[str, Any] | None = None,
    ):
        """restart_streams(seed): re-seeds this process's sampling streams (a resume on another process count).
        data: the training rows' count and fingerprint (`data_fingerprint`), kept so a resume on other data is
        told."""
        self.data = data
        self.run_dir, self.cfg, self.model, self.tokenizer = run_dir, cfg, model, tokenizer
        self.optimizer, self.scheduler, self.generator = optimizer, scheduler, generator
        self.reference, self.parts, self.sharded, self.device = reference, parts, sharded, device
        self.restart_streams = restart_streams

    def save(self, step: int) -> Path:
        """Return the folder of a checkpoint of the current state at `step`."""
        extra = {**self.parts.state_dict(), "config": to_dict(self.cfg)}
        if self.data is not None:
            extra["data"] = self.data
        files = self.parts.files()
        # A reference that has followed the policy is state: without it a resumed run would anchor to the
        # initial model. Its weights go with the policy's (whole, or in the shards).
        ref = self.reference
        ref_copy = ref.copy if ref is not None and ref.syncs else None
        if ref is not None and ref.syncs and not self.sharded:
            files["reference.pt"] = ref.state_dict()
        if self.sharded:  # the reference's weights (once it moved) go into the shards with the policy's
            extra["world_size"] = dist.world_size()
            extra["reference_syncs"] = ref.syncs if ref is not None else 0
        with quiet_hf_progress():  # no "Writing model shards" bar
            return save_checkpoint(
                self.run_dir,
                step,
                model=self.model,
                tokenizer=self.tokenizer,
                optimizer=self.optimizer,
                scheduler=self.scheduler,
                generator=self.generator,
                extra=extra,
                keep=self.cfg.keep_checkpoints,
                files=files,
                write_sharded=(
                    (lambda tmp: save_sharded(tmp, self.model, self.optimizer, ref_copy))
                    if self.sharded
                    else None
                ),
                rank_state=self.rank_state() if self.sharded else None,
            )

    def _check_data(self, ckpt: Path, saved: dict[str, Any] | None) -> None:
        """Raises ConfigError when checkpoint `ckpt` was trained on other rows than the run has now: the prompt
        order it continues indexes those rows, so the resume would not be the run it continues."""
        if saved is None or self.data is None or saved == self.data or self.cfg.allow_config_change:
            return
        raise ConfigError(
            f"resume: the training data differs from the data checkpoint {ckpt} was trained on ({saved['rows']} "
            f"rows then, {self.data['rows']} now; fingerprint {saved['sha256'][:12]} then, "
            f"{self.data['sha256'][:12]} now): the prompt order it continues indexes those rows. Restore the "
            "data (data.path, data.task and its settings), or set allow_config_change=true to continue on these"
        )

    def rank_state(self) -> dict[str, Any]:
        """Returns this process's own parts (sampling generator, prompt order, curriculum) for its rank-R.pt."""
        return {"world_size": dist.world_size(), **self.parts.state_dict(per_process=True)}

    def load(self, candidates: list[Candidate]) -> int:
        """Returns the step of the newest candidate that loads, after loading it into the run's parts (a torn or
        corrupt one is skipped with a warning; a checkpoint of another model raises CheckpointMismatchError)."""
        for ckpt, state in candidates:
            extra = state.get("extra", {})
            self._check_data(ckpt, extra.get("data"))
            sharded_ckpt = (ckpt / SHARDED_DIR).is_dir()
            try:
                if sharded_ckpt or self.sharded:
                    self._load_weights_across(ckpt, state)
                else:
                    with quiet_hf_progress():
                        load_model_weights(self.model, ckpt)
                    if self.reference is not None and (ckpt / "reference.pt").is_file():
                        saved = load_state_file(ckpt / "reference.pt", map_location=self.device)
                        self.reference.load_state_dict(saved)
                own_files = {
                    n: load_state_file(ckpt / n) for n in self.parts.file_names() if (ckpt / n).is_file()
                }
            except UnsafeCheckpointError:
                raise
            except CheckpointMismatchError as e:
                raise CheckpointMismatchError(
                    f"checkpoint {ckpt} holds a different model than {self.cfg.model.name_or_path!r} ({e}); "
                    "resume with the model it was trained from, or start a new out_dir"
                ) from None
            except (RuntimeError, OSError, ValueError, EOFError) as e:
                warnings.warn(
                    f"checkpoint {ckpt} cannot be loaded ({first_line(e)}); trying the one before",
                    stacklevel=3,
                )
                continue
            check_finite_weights(self.model, f"checkpoint {ckpt}")
            if not sharded_ckpt:  # a sharded checkpoint's optimizer came with its shards
                if self.sharded:
                    load_plain_optimizer(self.model, self.optimizer, state["optimizer"])
                else:
                    self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
            # The main process's sampling stream sits at the top of trainer_state.pt (where older cohorts read it).
            self.parts.load_state_dict({**extra, "rng": state["rng"]})
            self.parts.load_files(own_files.get)
            self._load_rank_state(ckpt, extra, int(state["step"]))
            return int(state["step"])
        raise TrainingError(
            f"no checkpoint in {self.run_dir / 'checkpoints'} can be loaded; start a new out_dir, or pass resume= "
            "a checkpoint folder that loads"
        )

    def _load_weights_across(self, ckpt: Path, state: dict[str, Any]) -> None:
        """Loads a checkpoint's weights when either it or this run is sharded (any process counts on either side)."""
        extra = state.get("extra", {})
        copy = self.reference.copy if self.reference is not None else None
        if (ckpt / SHARDED_DIR).is_dir():
            syncs = int(extra.get("reference_syncs", 0))
            if syncs and copy is None:
                raise ValueError("the checkpoint's reference is a full model copy, but this run has none")
            load_sharded(ckpt, self.model, self.optimizer, copy if syncs else None)
            if self.reference is not None:
                self.reference.syncs = syncs
            return
        # A one-process checkpoint resumed by a sharded run: whole tensors, each process keeps its shard.
        if (ckpt / "adapter_model.safetensors").is_file():
            raise ValueError(
                f"checkpoint {ckpt} is a one-process LoRA checkpoint; resume it on one process (sharded runs resume "
                "LoRA from their own sharded checkpoints)"
            )
        with quiet_hf_progress():
            load_model_weights(self.model, ckpt, load=lambda weights: load_full_weights(self.model, weights))
        if self.reference is not None and (ckpt / "reference.pt").is_file():
            ref = load_state_file(ckpt / "reference.pt")
            if "weights" in ref and copy is not None:
                load_full_weights(copy, ref["weights"])
            self.reference.syncs = int(ref.get("syncs", 1))

    def _load_rank_state(self, ckpt: Path, extra: dict[str, Any], step: int) -> None:
        """Restores this process's sampling streams: exactly on the checkpoint's process count, else re-seeded."""
        if dist.world_size() == 1 and extra.get("world_size", 1) == 1:
            return  # trainer_state.pt held them
        own = ckpt / f"rank-{dist.rank()}.pt"
        if extra.get("world_size") == dist.world_size() and own.is_file():
            self.parts.load_state_dict(load_state_file(own), per_process=True)
            return
        # Another process count: the weights, optimizer, schedule and step resume exactly; the processes'
        # sampling streams cannot (their number changed), so each starts a stream of its own from the step.
        self.restart_streams(seeds.sampling_after_resume(self.cfg.seed, step, dist.rank()))
        if dist.is_main():
            print(
                f"resume: checkpoint {ckpt} was written by {extra.get('world_size', 1)} processes and this run has "
                f"{dist.world_size()}: weights, optimizer, schedule and step continue exactly; each process's "
                "sampling stream restarts from a seed of the step",
                flush=True,
            )


def check_finite_weights(model: torch.nn.Module, what: str) -> None:
    """Raises NonFiniteError when a parameter of `model` holds NaN or inf."""
    # Each process checks its own shard of a sharded model.
    bad = [
        (n, int((~torch.isfinite(local(p))).sum()))
        for n, p in model.named_parameters()
        if not torch.isfinite(local(p)).all()
    ]
    if bad:
        raise NonFiniteError(
            f"{what} has non-finite weights: {sum(c for _, c in bad)} NaN/inf values in {len(bad)} tensors (first: "
            f"{bad[0][0]}); training it would only produce garbage. Load a healthy model or checkpoint"
        )


def save_final_model(model: torch.nn.Module, tokenizer: Any, out: Path, *, sharded: bool) -> Path:
    """Returns `out` after writing the model (save_pretrained, safetensors) and its tokenizer there; a sharded
    model is gathered from every process's shard (a collective) and written by the main process."""
    full = full_state_dict(model) if sharded else None
    if dist.is_main() or not sharded:
        out.mkdir(parents=True, exist_ok=True)
        fix = "free some space there and run again with resume=auto: the run's last checkpoint is intact"
        with disk_full_named(out, "the final model", fix), quiet_hf_progress():
            options = {"state_dict": full} if full is not None else {}
            model.save_pretrained(out, safe_serialization=True, **options)  # type: ignore[operator]
            fix_adapter_base_path(out)  # a LoRA adapter's base resolves from anywhere
            tokenizer.save_pretrained(out)
    if sharded:
        dist.barrier()
    return out


def trl_resume_target(where: bool | str | os.PathLike, run_dir: Path, updates_per_step: int = 1) -> str:
    """Returns the `resume` setting TRL's train(resume_from_checkpoint=where) means: "auto" for True (the
    newest checkpoint of run_dir), else the checkpoint folder. TRL's name checkpoint-N counts optimizer steps
    (its global_step), of which each cohort step makes `updates_per_step`: it is cohort's step-(N / that)."""
    if where is True:
        if not list_checkpoints(run_dir):
            raise ConfigError(
                f"resume_from_checkpoint=True: no checkpoint in {run_dir / 'checkpoints'} to resume from; "
                "call trainer.train() to start the run"
            )
        return "auto"
    path = Path(str(where))
    trl_name = re.fullmatch(r"checkpoint-(\d+)", path.name)

    def found() -> str:
        names = [
            f"{p.name} (TRL's checkpoint-{int(p.name.split('-')[-1]) * updates_per_step})"
            if p.name.split("-")[-1].isdigit() and updates_per_step > 1
            else p.name
            for p in list_checkpoints(run_dir)
        ]
        return ", ".join(names) or "none"

    if not path.exists() and trl_name:  # TRL's output_dir/checkpoint-N is cohort's checkpoints/step-(N / k)
        step, rest = divmod(int(trl_name.group(1)), updates_per_step)
        if rest:
            raise ConfigError(
                f"resume_from_checkpoint={str(where)!r}: TRL numbers checkpoints by optimizer step, and each "
                f"generation batch here makes {updates_per_step}, so a checkpoint's number is a multiple of "
                f"{updates_per_step}; the checkpoints of {run_dir} are: {found()}"
            )
        path = path.parent / "checkpoints" / f"step-{step}"
    if not (path / "trainer_state.pt").is_file():
        raise ConfigError(
            f"resume_from_checkpoint={str(where)!r} is not a cohort checkpoint (no trainer_state.pt); "
            f"the checkpoints of {run_dir} are: {found()} (in {run_dir / 'checkpoints'}), or pass True"
        )
    return str(path)
