"""distributed.load=rank0 (the default under fsdp): process 0 reads the checkpoint, the others build the model on
the meta device and receive their shards. The loaded model must be the checkpoint's to the bit (tied weights,
the reference copy, and the rotary inv_freq buffers, which are outside the state dict and would be garbage on a
meta-built process), and a run must be the one every process reading the checkpoint makes (a new LoRA adapter's
random init included). A checkpoint only process 0 reads and fails on is an error on every process."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
from _rank_workers import error_case, load_case

from cohort.config import TrainConfig
from cohort.errors import ConfigError
from cohort.models import build_tiny_model, load_model


@pytest.fixture(autouse=True)
def _processes_on_the_cpu(monkeypatch):
    """The spawned gloo processes see no GPU (one GPU cannot host two ranks)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


def _spawn(fn, tmp_path, *args) -> None:
    tmp_path.mkdir(parents=True, exist_ok=True)
    mp.spawn(fn, args=(2, str(tmp_path / "store"), str(tmp_path), *args), nprocs=2, join=True)


def _equal(a: dict, b: dict) -> list[str]:
    """Returns the names whose tensors differ (or are missing from one side)."""
    return sorted(k for k in a.keys() | b.keys() if k not in a or k not in b or not torch.equal(a[k], b[k]))


@pytest.mark.slow
def test_rank0_loading_is_the_checkpoint_and_the_run_every_process_reading_it_makes(tmp_path):
    untied = build_tiny_model(tmp_path / "untied", hidden_size=32, num_layers=2, num_heads=4, seed=3)
    tied = build_tiny_model(
        tmp_path / "tied", hidden_size=32, num_layers=2, num_heads=4, seed=4, tie_word_embeddings=True
    )
    cases = {
        "every": ["distributed.load=every", "algo.beta=0.04"],
        "rank0": ["algo.beta=0.04"],  # auto: rank0 under fsdp; beta > 0: a sharded reference copy too
        "lora_every": ["distributed.load=every", "model.lora.enabled=true", "model.lora.r=4"],
        "lora_rank0": ["distributed.load=rank0", "model.lora.enabled=true", "model.lora.r=4"],
    }
    _spawn(load_case, tmp_path / "u", str(untied), cases)
    _spawn(load_case, tmp_path / "t", str(tied), {"tied_rank0": ["distributed.load=rank0"]})
    seen = {name: torch.load(tmp_path / "u" / f"{name}-0.pt") for name in cases}
    seen["tied_rank0"] = torch.load(tmp_path / "t" / "tied_rank0-0.pt")
    assert [seen[n]["loaded"] for n in seen] == ["every", "rank0", "every", "rank0", "rank0"]
    for name, path in (("rank0", untied), ("tied_rank0", tied)):
        model = load_model(path)
        assert not _equal(seen[name]["weights"], model.state_dict()), name
        assert seen[name]["buffers"].keys() == dict(model.named_buffers()).keys()
        assert any("inv_freq" in k for k in seen[name]["buffers"])
        assert not _equal(seen[name]["buffers"], dict(model.named_buffers())), name
    # the reference copy: the checkpoint's weights too, and still them after the policy's step
    assert not _equal(seen["rank0"]["reference"], load_model(untied).state_dict())
    for a, b in (("every", "rank0"), ("lora_every", "lora_rank0")):
        assert not _equal(seen[a]["weights"], seen[b]["weights"]), (a, b)
        assert seen[a]["loss"] == seen[b]["loss"]
        assert not _equal(seen[a]["after"], seen[b]["after"]), (a, b)
        assert _equal(seen[b]["weights"], seen[b]["after"]), f"{b}: the step moved nothing"
    assert any("lora_A" in k for k in seen["lora_rank0"]["weights"])
    # process 1 built its model on the meta device: its buffers (inv_freq) came from process 0
    for name, folder in (("rank0", "u"), ("tied_rank0", "t")):
        other = torch.load(tmp_path / folder / f"{name}-1.pt")
        assert other["loaded"] == "rank0" and not other["weights"]  # the whole weights live on process 0 only
        assert not _equal(other["buffers"], seen[name]["buffers"]), name


@pytest.mark.slow
def test_a_checkpoint_process_0_cannot_read_is_an_error_on_every_process(tmp_path):
    folder = build_tiny_model(tmp_path / "m", hidden_size=32, num_layers=1, num_heads=4)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:200])  # truncated: config.json still builds the model's modules
    _spawn(error_case, tmp_path, str(folder), ["distributed.load=rank0"])
    own, other = (torch.load(tmp_path / f"error-{r}.pt") for r in (0, 1))
    assert own[0] == other[0] == "ValueError", (own, other)
    assert "is corrupt or truncated" in own[1] and "\n" not in own[1]
    assert other[1] == f"training process 0 of 2: {own[1]}"


def test_load_settings_are_checked(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = TrainConfig()
    cfg.model.name_or_path, cfg.data.task = "unused", "addition"
    cfg.distributed.load = "scatter"
    with pytest.raises(
        ConfigError, match=r"distributed.load='scatter' is not valid; choose one of: auto, rank0"
    ):
        cfg.validate()
    monkeypatch.setenv("WORLD_SIZE", "1")
    cfg.distributed.load = "rank0"
    with pytest.warns(UserWarning, match=r"distributed.load='rank0' changes nothing.*launch with torchrun"):
        cfg.validate()


def test_rank0_loading_needs_a_folder_not_a_model_object(tiny_model_dir):
    from cohort.train.build import loading_path

    cfg = TrainConfig()
    assert loading_path(cfg, "fsdp", given=False) == "rank0"
    assert loading_path(cfg, "fsdp", given=True) == "every"  # auto: the object is on every process already
    assert loading_path(cfg, "replicate", given=False) == "every"
    assert loading_path(cfg, "none", given=False) == "every"
    cfg.distributed.load = "rank0"
    assert loading_path(cfg, "replicate", given=False) == "rank0"
    with pytest.raises(ConfigError, match="was given as an object.*set distributed.load=auto"):
        loading_path(cfg, "fsdp", given=True)


def test_a_meta_model_reads_no_weights_and_keeps_the_generation_config(tiny_model_dir):
    model = load_model(tiny_model_dir, device="meta")
    assert all(t.is_meta for t in model.state_dict().values())
    plain = load_model(tiny_model_dir)
    assert [(k, v.shape, v.dtype) for k, v in model.state_dict().items()] == [
        (k, v.shape, v.dtype) for k, v in plain.state_dict().items()
    ]
    assert model.generation_config.eos_token_id == plain.generation_config.eos_token_id
    assert model.config._attn_implementation == plain.config._attn_implementation


def test_an_adapter_folder_on_the_meta_device_has_the_adapters_modules(tiny_model_dir, tmp_path):
    pytest.importorskip("peft")
    from cohort.config import LoraConfig

    adapter = load_model(tiny_model_dir, lora=LoraConfig(enabled=True, r=4))
    adapter.save_pretrained(tmp_path / "adapter")
    plain = load_model(tmp_path / "adapter", trainable_adapter=True)
    meta = load_model(tmp_path / "adapter", device="meta", trainable_adapter=True)
    assert all(t.is_meta for t in meta.state_dict().values())
    shapes = [(k, v.shape) for k, v in plain.state_dict().items()]
    assert [(k, v.shape) for k, v in meta.state_dict().items()] == shapes
    trained = [n for n, p in plain.named_parameters() if p.requires_grad]
    # the adapter's weights only train, as when the folder is read
    assert trained and [n for n, p in meta.named_parameters() if p.requires_grad] == trained
