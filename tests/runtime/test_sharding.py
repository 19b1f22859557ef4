"""distributed.* settings: what runs with how many processes, refused before any work with the fix named.

The multi-process behaviour itself is tested under gloo in test_distributed_exact.py (the update) and
test_distributed.py (torchrun: training, sharded checkpoints, resume on another process count)."""

from __future__ import annotations

import warnings

import pytest
import torch

from cohort.config import TrainConfig
from cohort.errors import ConfigError
from cohort.runtime import sharding
from cohort.runtime.sharding import decoder_layers, resolve_strategy


def _cfg(**changes) -> TrainConfig:
    cfg = TrainConfig()
    cfg.model.name_or_path = "unused"
    cfg.data.task = "addition"
    for key, value in changes.items():
        section, name = key.split("__")
        setattr(getattr(cfg, section), name, value)
    return cfg


def test_strategy_resolution():
    assert resolve_strategy("auto", 1) == "none"
    assert resolve_strategy("replicate", 1) == "none"  # one process: nothing to replicate to
    assert resolve_strategy("auto", 2) == "replicate"
    assert resolve_strategy("fsdp", 4) == "fsdp"
    with pytest.raises(ConfigError, match="torchrun --nproc_per_node"):
        resolve_strategy("fsdp", 1)
    with pytest.raises(ConfigError, match="not one of"):
        resolve_strategy("ddp", 2)


def test_sharding_with_one_process_is_refused_before_the_model_loads(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ConfigError, match="distributed.strategy=fsdp .* one process"):
        _cfg(distributed__strategy="fsdp").validate()


def test_nccl_without_gpus_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ConfigError, match="nccl needs CUDA GPUs.*backend=gloo"):
        _cfg(distributed__backend="nccl").validate()


def test_global_batch_must_split_into_processes_of_whole_groups(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(
        ConfigError, match=r"global_batch_size=16 does not split into 3 processes.*multiple of 12"
    ):
        _cfg(distributed__global_batch_size=16, rollout__group_size=4).validate()
    cfg = _cfg(distributed__global_batch_size=24, rollout__group_size=4).validate()
    assert cfg.rollout.batch_size == 8  # each process's share
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = _cfg(distributed__global_batch_size=24, rollout__group_size=4).validate()
    assert cfg.rollout.batch_size == 12


@pytest.mark.parametrize(
    "changes,match",
    [
        (
            {"rollout__sampler_dtype": "bfloat16"},
            "rollout.sampler_dtype cannot run under distributed.strategy=fsdp",
        ),
        ({"iterative__every": 5}, "iterative.every=0 under torchrun"),
        ({"distributed__backend": "mpi"}, "distributed.backend"),
        ({"distributed__mixed_precision": "fp8"}, "distributed.mixed_precision"),
    ],
)
def test_settings_a_sharded_run_cannot_take(monkeypatch, changes, match):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=match):
        _cfg(distributed__strategy="fsdp", **changes).validate()


def test_lora_reference_that_follows_the_policy_is_refused_under_sharding(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = _cfg(algo__ref_update_every=10)
    cfg.model.lora.enabled = True
    with pytest.raises(ConfigError, match="second adapter"):
        cfg.validate()


def test_mixed_precision_needs_fsdp(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ConfigError, match="FSDP's policy and this run has one process"):
        _cfg(distributed__mixed_precision="bf16").validate()


def test_decoder_layers_are_the_models_blocks(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    layers = decoder_layers(model)
    assert layers and all(type(m).__name__ in model._no_split_modules for m in layers)
    assert len(layers) == model.config.num_hidden_layers


def test_the_decoder_and_head_are_units_only_when_untied(tmp_path):
    from transformers import AutoModelForCausalLM

    from cohort.models import build_tiny_model
    from cohort.runtime.sharding import split_units

    untied = AutoModelForCausalLM.from_pretrained(
        build_tiny_model(tmp_path / "u", hidden_size=16, num_layers=1)
    )
    tied = AutoModelForCausalLM.from_pretrained(
        build_tiny_model(tmp_path / "t", hidden_size=16, num_layers=1, tie_word_embeddings=True)
    )
    decoder, head = split_units(untied)
    assert decoder is untied.model and head is untied.lm_head
    assert split_units(tied) is None  # one parameter cannot belong to two FSDP units


class _Unit(torch.nn.Module):
    """Records the FSDP calls gathered() makes on a unit."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def set_reshard_after_forward(self, value: bool, recurse: bool) -> None:
        self.calls.append(f"reshard_after_forward={value}")

    def unshard(self) -> None:
        self.calls.append("unshard")

    def reshard(self) -> None:
        self.calls.append("reshard")


def test_nested_gathered_blocks_leave_the_model_to_the_outermost(monkeypatch):
    model = _Unit()
    monkeypatch.setattr(sharding, "fsdp_modules", lambda m: [m])
    with sharding.gathered(model):
        with sharding.gathered(model, None):  # a sampling round inside a step's gathered block
            assert model.calls == ["reshard_after_forward=False", "unshard"]
        assert model.calls == ["reshard_after_forward=False", "unshard"]
    # resharded once, by the outer block; a root is not resharded after its forward
    assert model.calls[2:] == ["reshard", "reshard_after_forward=False"]
    assert vars(model).keys() == _Unit().__dict__.keys()  # nothing was set on the model
    with sharding.gathered(model):  # gathered again once the outer block ended
        assert model.calls[-1] == "unshard"


def test_sharded_weights_of_another_model_are_refused_before_anything_is_loaded(tmp_path):
    from _tiny import tiny_model

    from cohort.errors import CheckpointMismatchError

    def parts(seed: int, hidden_size: int = 48):
        model = tiny_model(seed=seed, hidden_size=hidden_size)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        sharding._materialise(optimizer)
        return model, optimizer

    with warnings.catch_warnings():  # one process writing a DCP checkpoint, which torch remarks on
        warnings.simplefilter("ignore")
        sharding.save_sharded(tmp_path, *parts(1))
    other, optimizer = parts(2, hidden_size=32)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(CheckpointMismatchError, match=r"^model\.model\.embed_tokens\.weight is \[\d+, 48\]"):
        sharding.load_sharded(tmp_path, other, optimizer)
    assert all(torch.equal(before[k], v) for k, v in other.state_dict().items())
    same, optimizer = parts(2)
    sharding.load_sharded(tmp_path, same, optimizer)
    assert torch.equal(same.lm_head.weight, tiny_model(seed=1).lm_head.weight)
