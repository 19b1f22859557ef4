"""Checkpoint files are data: every .pt loads with weights_only=True, and a crafted file is refused, never run."""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from test_trainer import _cfg

from cohort.errors import TrainingError, UnsafeCheckpointError
from cohort.runtime.checkpoint_files import (
    list_checkpoints,
    load_state_file,
    load_trainer_state,
    readable_checkpoints,
    rng_state,
    set_rng_state,
)
from cohort.runtime.sharding import read_dcp_metadata
from cohort.trainer import GRPOTrainer


class _Payload:
    """What an attacker pickles: unpickling it calls os.system, which would create the marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_rng_state_round_trips_through_a_weights_only_load(tmp_path):
    gen = torch.Generator().manual_seed(3)
    random.seed(1), np.random.seed(2), torch.manual_seed(4)
    torch.save(rng_state(gen), tmp_path / "rng.pt")
    expected = (random.random(), np.random.rand(), torch.rand(1).item(), torch.rand(1, generator=gen).item())
    set_rng_state(load_state_file(tmp_path / "rng.pt"), gen)
    assert (
        random.random(),
        np.random.rand(),
        torch.rand(1).item(),
        torch.rand(1, generator=gen).item(),
    ) == expected


def test_a_generator_state_from_another_device_type_reseeds_the_stream_with_a_warning():
    """A CUDA generator's state (seed and offset, 16 bytes) cannot load into a CPU generator (5,056 bytes), nor
    the reverse: a CUDA run resumed on a CPU re-seeds its sampling stream from the saved state, the same way on
    every resume of that checkpoint, instead of failing."""
    cuda_like = torch.tensor([7, 0, 0, 0, 0, 0, 0, 0, 32, 0, 0, 0, 0, 0, 0, 0], dtype=torch.uint8)
    state = {**rng_state(), "generator": cuda_like}
    draws = []
    for _ in range(2):
        gen = torch.Generator().manual_seed(0)
        with pytest.warns(
            UserWarning, match=r"saved on another kind of device \(16 bytes of state, this cpu"
        ):
            set_rng_state(state, gen)
        draws.append(torch.rand(3, generator=gen))
    assert torch.equal(draws[0], draws[1])  # reproducible across resumes
    assert not torch.equal(
        draws[0], torch.rand(3, generator=torch.Generator().manual_seed(0))
    )  # not the start


def test_cuda_states_restore_only_onto_the_gpus_this_process_sees(monkeypatch):
    """A torchrun job saved on 8 GPUs and resumed on 4 (or another CUDA_VISIBLE_DEVICES) holds more CUDA states
    than there are GPUs: set_rng_state_all failed on the first missing one."""
    restored: list = []
    state = {**rng_state(), "cuda": [torch.full((16,), k, dtype=torch.uint8) for k in (10, 11, 12, 13)]}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s, i: restored.append((int(s[0]), i)))
    set_rng_state(state)
    assert restored == [(10, 0), (11, 1)]
    restored.clear()
    set_rng_state({**state, "cuda": state["cuda"][:1]})  # fewer saved than visible: what there is
    assert restored == [(10, 0)]


def test_an_older_checkpoints_numpy_state_still_loads(tmp_path):
    np.random.seed(5)
    torch.save({"numpy": np.random.get_state()}, tmp_path / "old.pt")  # as cohort wrote it before
    expected = np.random.rand()
    state = {**rng_state(), "numpy": load_state_file(tmp_path / "old.pt")["numpy"]}
    set_rng_state(state)
    assert np.random.rand() == expected


def test_a_pickled_object_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "pwned"
    torch.save({"step": 1, "extra": _Payload(marker)}, tmp_path / "trainer_state.pt")
    with pytest.raises(
        UnsafeCheckpointError, match=r"trainer_state.pt holds pickled Python objects \(posix.system"
    ):
        load_trainer_state(tmp_path)
    assert not marker.exists()


def test_a_crafted_checkpoint_stops_resume_with_one_clear_error(tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    GRPOTrainer(_cfg(tiny_model_dir, run, steps=2, save_every=1)).train()
    newest = list_checkpoints(run)[-1]
    state = load_trainer_state(newest)
    marker = tmp_path / "pwned"
    state["extra"]["sampler"] = _Payload(marker)
    torch.save(state, newest / "trainer_state.pt")
    # Not a torn file to skip quietly: resume stops, names the file and says what to do.
    with pytest.raises(UnsafeCheckpointError, match="refusing to load it.*remove this checkpoint folder"):
        readable_checkpoints(run)
    with pytest.raises(TrainingError, match="step-2/trainer_state.pt holds pickled Python objects"):
        GRPOTrainer(_cfg(tiny_model_dir, run, steps=3, resume="auto"))
    assert not marker.exists()
    # Every file of an honest checkpoint loads as data.
    honest = list_checkpoints(run)[0]
    assert all(isinstance(load_state_file(f), dict) for f in honest.glob("*.pt"))


def test_a_crafted_dcp_metadata_file_is_refused_and_never_runs(tmp_path):
    import pickle

    import torch.distributed.checkpoint as dcp

    model = torch.nn.Linear(3, 2)
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(tmp_path / "good"))
    meta = read_dcp_metadata(tmp_path / "good" / ".metadata")
    assert "model.weight" in meta.state_dict_metadata
    shutil.copytree(tmp_path / "good", tmp_path / "bad")
    marker = tmp_path / "pwned"
    (tmp_path / "bad" / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(UnsafeCheckpointError, match=r"\.metadata pickles .*system"):
        read_dcp_metadata(tmp_path / "bad" / ".metadata")
    assert not marker.exists()


def test_weights_of_another_model_are_refused_before_anything_is_loaded(tmp_path):
    from _tiny import tiny_model

    from cohort.errors import CheckpointMismatchError
    from cohort.runtime.checkpoint_files import load_model_weights

    tiny_model(seed=1).save_pretrained(tmp_path / "a")
    other = tiny_model(seed=2, hidden_size=32)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(
        CheckpointMismatchError, match=r"embed_tokens\.weight is \[\d+, 48\] in the checkpoint"
    ):
        load_model_weights(other, tmp_path / "a")
    assert all(torch.equal(before[k], v) for k, v in other.state_dict().items())
    same = tiny_model(seed=2)
    load_model_weights(same, tmp_path / "a")
    assert torch.equal(same.lm_head.weight, tiny_model(seed=1).lm_head.weight)


def test_an_adapter_loads_by_the_names_both_sides_have_and_refuses_other_shapes(tmp_path):
    peft = pytest.importorskip("peft")
    from _tiny import tiny_model

    from cohort.errors import CheckpointMismatchError
    from cohort.runtime.checkpoint_files import load_model_weights

    def lora(hidden_size: int, targets: list[str]):
        config = peft.LoraConfig(r=4, target_modules=targets, init_lora_weights=False)
        return peft.get_peft_model(tiny_model(seed=1, hidden_size=hidden_size), config)

    lora(48, ["q_proj", "v_proj"]).save_pretrained(tmp_path / "a")
    with pytest.raises(CheckpointMismatchError, match=r"lora_A\.weight is \[4, 48\] in the checkpoint"):
        load_model_weights(lora(32, ["q_proj", "v_proj"]), tmp_path / "a")
    load_model_weights(lora(48, ["q_proj", "k_proj"]), tmp_path / "a")  # peft skips names one side lacks
