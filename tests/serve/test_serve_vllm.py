"""The vLLM rollout worker (`cohort serve --engine vllm`, cohort.serve.vllm_backend) on a machine without vLLM.

vLLM is not installed here, and none of these tests runs it. They check cohort's side of the seam: the error
when vLLM is missing, the config and flag errors, and what cohort hands to vLLM and makes of its answers,
against tests/serve/vllm_standin/vllm, a STAND-IN package that records calls and mirrors the signatures of
vLLM 0.27.0 to 0.34.0 (its docstring cites the files). A test passing here says cohort calls that API as read;
it says nothing of vLLM's behaviour on a GPU (docs/vllm.md)."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from _serve_helpers import run_config, serving

from cohort import cli
from cohort.config import ConfigError
from cohort.models import load_model, load_tokenizer, stop_token_ids
from cohort.rollout import SamplingParams
from cohort.serve import protocol, weights
from cohort.serve.backend import BuiltinBackend
from cohort.serve.client import RemoteGeneration
from cohort.serve.worker import Worker

STANDIN = str(Path(__file__).resolve().parent / "vllm_standin")
"""The folder whose `vllm` package is the stand-in (put first on sys.path, or on a worker's PYTHONPATH)."""


@pytest.fixture
def standin(monkeypatch):
    """Returns the stand-in `vllm` module, importable as `vllm` for the test (its call record emptied)."""
    monkeypatch.syspath_prepend(STANDIN)
    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # restored after the test: the backend sets it
    import vllm

    assert vllm.__version__.endswith("cohort-test-standin")  # never the real one
    vllm.CALLS.clear()
    yield vllm
    sys.modules.pop("vllm", None)


@pytest.fixture
def backend(standin, tiny_model_dir):
    """Returns a VLLMBackend of the tiny model on the stand-in, closed after the test."""
    from cohort.serve.vllm_backend import VLLMBackend

    b = VLLMBackend(str(tiny_model_dir), dtype="float32")
    yield b
    b.close()


def _calls(vllm, what):
    return [details for name, details in vllm.CALLS if name == what]


# --- no vLLM ----------------------------------------------------------------------------------------------------


def test_missing_vllm_is_one_line_naming_the_extra(monkeypatch, tiny_model_dir, capsys):
    from cohort.serve.vllm_backend import vllm_module

    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` fails as if it were not installed
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    with pytest.raises(ImportError, match=r"pip install 'cohort\[vllm\]'") as e:
        vllm_module()
    assert "\n" not in str(e.value)
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"  # the environment's choice stands
    assert cli.main(["serve", "--engine", "vllm", "--model", str(tiny_model_dir), "--port", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: `cohort serve --engine vllm` needs vLLM") and "\n" not in err


def test_the_engine_core_runs_in_the_worker_unless_the_environment_says(monkeypatch, standin):
    from cohort.serve.vllm_backend import vllm_module

    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING")
    assert vllm_module() is standin
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--gpu-memory-utilization", "0.5"], r"--gpu-memory-utilization configures vLLM: add --engine vllm"),
        (["--enforce-eager"], r"--enforce-eager configures vLLM"),
        (["--engine", "vllm", "--device", "cuda"], r"--device is for --engine builtin"),
        (
            ["--engine", "vllm", "--attn-implementation", "eager"],
            r"--attn-implementation is for --engine builtin",
        ),
        (["--engine", "vllm", "--gpu-memory-utilization", "0"], r"must be in \(0, 1\]"),
        (["--engine", "vllm", "--seed", "-1"], r"--seed -1 must be in 0 \.\. 4294967295 \(2\*\*32 - 1\)"),
        (["--engine", "vllm", "--seed", str(2**32)], r"--seed 4294967296 must be in 0 \.\. 4294967295"),
    ],
)
def test_serve_flags(tiny_model_dir, capsys, argv, match):
    import re

    assert cli.main(["serve", "--model", str(tiny_model_dir), "--port", "0", *argv]) == 2
    err = capsys.readouterr().err
    assert re.search(match, err) and err.count("\n") == 1, err


# --- config -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "over, match",
    [
        (
            {},
            r"rollout.engine=vllm samples in rollout workers, and rollout.workers is unset: start `cohort serve ",
        ),
        ({"rollout.workers": 2}, r"rollout.workers=2: a trainer does not start vLLM workers itself"),
        (
            {"rollout.workers": ["127.0.0.1:5555"], "model.lora.enabled": True},
            r"does not take LoRA adapter pushes.*rollout.engine=builtin",
        ),
        ({"rollout.workers": ["127.0.0.1:5555"], "rollout.top_p": 0.9}, r"top_p=0.9 / top_k=0: vLLM reports"),
        (
            {"rollout.workers": ["127.0.0.1:5555"], "rollout.top_k": 20},
            r"top_k=20: vLLM reports log-probs after",
        ),
        ({"rollout.workers": ["127.0.0.1:5555"], "rollout.temperature": 2.5}, r"temperatures up to 2"),
        (
            {"rollout.workers": ["127.0.0.1:5555"], "rollout.temperature": 0.005},
            r"temperature=0.005: vLLM raises a temperature under 0.01.*rollout.temperature >= 0.01",
        ),
    ],
)
def test_vllm_config_errors(tiny_model_dir, tmp_path, over, match):
    with pytest.raises(ConfigError, match=match):
        run_config(tiny_model_dir, tmp_path, **{"rollout.engine": "vllm", **over}).validate()


def test_a_vllm_run_corrects_for_the_sampler_and_keeps_a_builtin_engine(tiny_model_dir, tmp_path):
    from cohort.train.build import build_engine

    cfg = run_config(tiny_model_dir, tmp_path, **{"rollout.engine": "vllm", "rollout.workers": ["h:1"]})
    cfg = cfg.validate()
    assert cfg.algo.sampler_correction == "token_tis"  # another implementation's log-probs
    model = load_model(tiny_model_dir)
    engine, _ = build_engine(cfg, model, load_tokenizer(tiny_model_dir))
    assert engine.name == "builtin"  # the trainer's own (the workers sample, evaluation included)
    from cohort.rollout import make_engine

    with pytest.raises(ValueError, match=r"'vllm' runs in rollout workers only \(cohort serve --engine vllm"):
        make_engine("vllm", eos_token_ids=[1], pad_token_id=0)
    with pytest.raises(
        ConfigError, match=r"rollout.engine='vllm2' is not valid; choose one of: builtin, hf, vllm"
    ):
        run_config(tiny_model_dir, tmp_path, **{"rollout.engine": "vllm2"}).validate()


# --- the engine, the identity and the handshake ------------------------------------------------------------------


def test_the_engine_is_built_with_vllms_arguments(standin, tiny_model_dir):
    from cohort.serve.vllm_backend import EXTENSION, VLLMBackend, VLLMOptions

    options = VLLMOptions(seed=3, gpu_memory_utilization=0.5, enable_prefix_caching=False, max_model_len=64)
    b = VLLMBackend(str(tiny_model_dir), dtype="fp32", options=options)
    try:
        (settings,) = _calls(standin, "LLM")
        assert settings == {
            "model": str(tiny_model_dir),
            "dtype": "float32",  # cohort's aliases become vLLM's names
            "worker_extension_cls": EXTENSION,
            "logprobs_mode": "processed_logprobs",
            "seed": 3,
            "gpu_memory_utilization": 0.5,
            "enable_prefix_caching": False,
            "max_model_len": 64,
        }  # the unset options are left to vLLM
        assert b.describe() == f"vllm {standin.__version__}"
    finally:
        b.close()


def test_the_memory_share_is_always_passed(standin, tiny_model_dir):
    """vLLM 0.34 left without a share takes all the memory free after warm-up; a weight push needs some of it."""
    from cohort.serve.vllm_backend import VLLMBackend

    b = VLLMBackend(str(tiny_model_dir))
    try:
        (settings,) = _calls(standin, "LLM")
        assert settings["gpu_memory_utilization"] == 0.92  # vLLM's own default up to 0.33
        assert settings["seed"] == 0 and "max_model_len" not in settings
    finally:
        b.close()


def test_the_identity_is_the_builtin_workers(backend, tiny_model_dir, tmp_path):
    model, tokenizer = load_model(tiny_model_dir), load_tokenizer(tiny_model_dir)
    trainer = protocol.identity(model, tokenizer, *stop_token_ids(model, tokenizer))
    theirs = backend.identity()
    assert protocol.mismatch(trainer, theirs, "w") is None
    for key in ("model_type", "layout", "vocab", "stop", "dtype", "cohort", "protocol"):
        assert theirs[key] == trainer[key], key
    assert theirs["engine"] == "vllm" and theirs["generator_state"] is False
    assert theirs["attn_implementation"] == "vllm"  # not compared: vLLM's kernels are its own
    builtin = BuiltinBackend(model, tokenizer, torch.device("cpu"))
    builtin.hello({"engine": "builtin"})
    mine = builtin.identity()
    assert mine["engine"] == "builtin" and mine.get("generator_state", True)


def test_a_worker_of_another_model_is_still_caught(standin, tiny_model_dir, tmp_path):
    from cohort.models import build_tiny_model
    from cohort.serve.vllm_backend import VLLMBackend

    other = build_tiny_model(tmp_path / "other", hidden_size=16, num_layers=1, num_heads=2)
    b = VLLMBackend(str(other), dtype="float32")
    try:
        model, tokenizer = load_model(tiny_model_dir), load_tokenizer(tiny_model_dir)
        trainer = protocol.identity(model, tokenizer, *stop_token_ids(model, tokenizer))
        assert "tensors differ" in protocol.mismatch(trainer, b.identity(), "w")
    finally:
        b.close()


def test_each_worker_refuses_a_trainer_of_the_other_engine(backend, tiny_model_dir):
    with pytest.raises(
        ValueError, match=r"samples with vLLM .* trainer with rollout.engine=builtin: set rollout"
    ):
        Worker(backend).handle({"op": "hello", "engine": "builtin"}, [])
    with pytest.raises(ValueError, match=r"does not take LoRA adapter pushes"):
        Worker(backend).handle({"op": "hello", "engine": "vllm", "lora": {"r": 4}}, [])
    builtin = Worker(
        BuiltinBackend(load_model(tiny_model_dir), load_tokenizer(tiny_model_dir), torch.device("cpu"))
    )
    with pytest.raises(
        ValueError, match=r"cohort's engines \(builtin, hf\) and the trainer with rollout.engine=vllm"
    ):
        builtin.handle({"op": "hello", "engine": "vllm"}, [])
    worker = Worker(backend)
    with pytest.raises(RuntimeError, match="before hello"):
        worker.handle({"op": "generate", "version": None}, [])
    reply, _ = worker.handle(
        {"op": "hello", "engine": "vllm", "cohort": protocol.__version__, "protocol": 1}, []
    )
    header, _ = protocol.unpack(reply)
    assert header["ok"] and header["identity"]["engine"] == "vllm"


def test_the_trainer_sends_a_vllm_worker_seeds_not_its_generator_state(tiny_model_dir):
    model = load_model(tiny_model_dir)

    def ticket(identity):
        client = SimpleNamespace(lost=None, identity=identity, channel=None, close=lambda: None)
        source = RemoteGeneration([client], model, timeout=1.0, bucket_bytes=1)
        params = SamplingParams(max_completion_length=4)
        generator = torch.Generator().manual_seed(0)
        before = generator.get_state()
        t = source.requests([[1, 2]], 2, params, generator, exact=True)  # built, not sent
        return t.requests[0], not torch.equal(before, generator.get_state())

    (header, blobs), advanced = ticket({"device": "cpu", "engine": "builtin"})
    assert header["seed"] is None and blobs and not advanced  # the state travels; the worker advances it
    (header, blobs), advanced = ticket({"device": "cpu", "engine": "vllm", "generator_state": False})
    assert (
        isinstance(header["seed"], int) and not blobs and advanced
    )  # a seed drawn from the trainer's stream


# --- sampling ---------------------------------------------------------------------------------------------------------


def _recomputed(model_dir, prompt, completion, temperature):
    """Returns the log-probs of a completion's tokens under log_softmax(logits / temperature), as the trainer
    computes them (cohort's convention), from a fresh forward of the transformers model."""
    model = load_model(model_dir)
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


def test_generate_maps_the_request_and_the_outputs(standin, backend, tiny_model_dir):
    from cohort.serve.vllm_backend import SEED_BOUND, prompt_seeds

    prompts = [[5, 6, 7], [8, 9]]
    params = SamplingParams(max_completion_length=5, temperature=0.7)
    batch, state = backend.generate(prompts, 3, params, seed=1234, state=None)
    assert state is None
    (call,) = _calls(standin, "generate")
    assert call["prompts"] == prompts and call["use_tqdm"] is False
    seeds = prompt_seeds(1234, 2)
    assert seeds == prompt_seeds(1234, 2) and len(set(seeds)) == 2 and all(0 <= s < SEED_BOUND for s in seeds)
    for sp, seed in zip(call["params"], seeds):
        assert sp["n"] == 3 and sp["max_tokens"] == 5 and sp["seed"] == seed
        assert sp["temperature"] == 0.7 and sp["top_p"] == 1.0 and sp["top_k"] == 0
        assert sp["stop_token_ids"] == backend.eos and sp["logprobs"] == 0 and sp["detokenize"] is False
    assert batch.group_size == 3 and batch.prompt_ids == prompts and len(batch.completion_ids) == 6
    for row, (ids, lp, cut) in enumerate(zip(batch.completion_ids, batch.sampling_logprobs, batch.truncated)):
        ends = bool(ids) and ids[-1] in backend.eos
        assert bool(cut) == (not ends) and (ends or len(ids) == 5)
        assert lp.dtype == torch.float32 and lp.shape == (len(ids),)
        expected = _recomputed(tiny_model_dir, prompts[row // 3], ids, 0.7)
        assert torch.allclose(lp, expected, atol=1e-5), (lp, expected)  # the trainer's convention, aligned
    again, _ = backend.generate(prompts, 3, params, seed=1234, state=None)
    assert again.completion_ids == batch.completion_ids  # the same seed, the same request
    backend.generate(prompts, 3, params, seed=99, state=None)
    assert [p["seed"] for p in _calls(standin, "generate")[-1]["params"]] == prompt_seeds(99, 2) != seeds
    backend.generate(prompts, 3, params, seed=None, state=None)
    assert [p["seed"] for p in _calls(standin, "generate")[-1]["params"]] == [None, None]


def test_greedy_asks_vllm_for_one_sample_and_repeats_it(standin, backend, tiny_model_dir):
    batch, _ = backend.generate(
        [[5, 6, 7]], 2, SamplingParams(max_completion_length=4, greedy=True), seed=1, state=None
    )
    (sp,) = _calls(standin, "generate")[-1]["params"]
    assert sp["n"] == 1 and sp["temperature"] == 0.0  # vLLM refuses n > 1 when greedy
    assert batch.completion_ids[0] == batch.completion_ids[1]
    expected = _recomputed(tiny_model_dir, [5, 6, 7], batch.completion_ids[0], 1.0)
    assert torch.allclose(batch.sampling_logprobs[0], expected, atol=1e-5)  # raw logits when greedy


@pytest.mark.parametrize(
    "params, state, match",
    [
        (SamplingParams(max_completion_length=4, top_p=0.9), None, r"top_p=0.9 / top_k=0: vLLM reports"),
        (SamplingParams(max_completion_length=4, top_k=5), None, r"top_k=5: vLLM reports"),
        (SamplingParams(max_completion_length=4, temperature=2.5), None, r"at most 2"),
        (SamplingParams(max_completion_length=4, temperature=0.005), None, r"would sample at 0.01 instead"),
        (SamplingParams(max_completion_length=4), torch.zeros(16, dtype=torch.uint8), r"seeds, not from the"),
    ],
)
def test_requests_a_vllm_worker_refuses(standin, backend, params, state, match):
    with pytest.raises(ValueError, match=match):
        backend.generate([[5, 6]], 2, params, seed=1, state=state)
    assert not _calls(standin, "generate")  # refused before vLLM is asked


def test_the_temperature_bounds_a_vllm_worker_takes(tiny_model_dir, tmp_path):
    from cohort.serve.vllm_backend import MAX_TEMPERATURE, MIN_TEMPERATURE, check_params

    for temperature in (MIN_TEMPERATURE, 1.0, MAX_TEMPERATURE):  # the ends are vLLM's own, taken as they are
        check_params(SamplingParams(max_completion_length=4, temperature=temperature))
        run_config(
            tiny_model_dir,
            tmp_path,
            **{
                "rollout.engine": "vllm",
                "rollout.workers": ["127.0.0.1:5555"],
                "rollout.temperature": temperature,
            },
        ).validate()


def test_finish_reasons_become_truncation_and_odd_outputs_are_errors(standin):
    from cohort.serve.vllm_backend import read_outputs

    lp = standin.Logprob

    def completion(index, ids, reason, logprobs=True):
        values = [{t: lp(-0.5 - i)} for i, t in enumerate(ids)] if logprobs else None
        return standin.CompletionOutput(
            index, "", ids, None, values, reason, ids[-1] if reason == "stop" else None
        )

    params = SamplingParams(max_completion_length=3)
    # vLLM keeps the EOS among the token ids (it drops it from the text only); outputs may come in any index order
    out = standin.RequestOutput(
        "0", None, [1], None, [completion(1, [4, 2], "stop"), completion(0, [3, 3, 3], "length")], True
    )
    batch = read_outputs([out], [[1]], 2, params, eos=[2])
    assert batch.completion_ids == [[3, 3, 3], [4, 2]] and batch.truncated.tolist() == [True, False]
    assert batch.sampling_logprobs[1].tolist() == [-0.5, -1.5]
    bad = [
        ([completion(0, [3, 4], "stop"), completion(1, [2], "stop")], r"finish_reason='stop'.*last token 4"),
        ([completion(0, [3], "abort"), completion(1, [2], "stop")], r"finish_reason='abort'"),
        ([completion(0, [3], "length", logprobs=False), completion(1, [2], "stop")], r"returned 0 log-probs"),
        ([completion(0, [2], "stop")], r"returned 1 completions of prompt 0, not 2"),
    ]
    for samples, match in bad:
        with pytest.raises(RuntimeError, match=match):
            read_outputs(
                [standin.RequestOutput("0", None, [1], None, samples, True)], [[1]], 2, params, eos=[2]
            )
    with pytest.raises(RuntimeError, match="returned 0 outputs for 1 prompts"):
        read_outputs([], [[1]], 2, params, eos=[2])


# --- weight pushes --------------------------------------------------------------------------------------------------


def test_a_push_is_handed_to_load_weights_by_name(standin, backend, tiny_model_dir):
    model = load_model(tiny_model_dir)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))  # weights the worker does not hold yet
    named = weights.push_tensors(model, full=True)
    # one tensor in another dtype: a push lays each dtype in a buffer of its own
    named[2] = (named[2][0], named[2][1].to(torch.bfloat16))
    spec, sent = weights.flatten(named)
    received = backend.receive_buffers(spec)
    files = [path for path, _, _ in backend._files]
    assert backend.shm_dir is not None  # this machine has /dev/shm, with room for the tiny model
    assert all(path.startswith(backend.shm_dir) and os.path.exists(path) for path in files)
    for r, s in zip(received, sent):
        r.copy_(s)  # what gloo's broadcast writes into them
    backend.load(spec, received, final=False)
    probe, rpc = _calls(standin, "collective_rpc")
    assert probe["method"] == "cohort_probe"  # on start: what each vLLM worker can receive a push on
    # only names and numbers cross vLLM's RPC (the stand-in refuses anything else)
    assert rpc["method"] == "cohort_load_weights"
    (loaded,) = _calls(standin, "load_weights")
    shapes = {n: list(t.shape) for n, t in model.state_dict().items()}
    assert [name for name, _, _ in loaded] == [name for name, _, _ in spec]
    assert all(shape == shapes[name] for name, shape, _ in loaded)
    assert sorted({dtype for _, _, dtype in loaded}) == ["bfloat16", "float32"]
    assert not _calls(standin, "reset_prefix_cache")  # not before the push's last bucket
    assert not any(os.path.exists(path) for path in files)
    expected = {n: t.float() for n, t in named}
    held = backend.llm.hf.state_dict()
    assert all(torch.equal(held[n], expected[n]) for n in expected)
    # the last bucket: the prefix cache (KV entries of the old weights) is reset
    spec, sent = weights.flatten(weights.push_tensors(model, full=False)[:1])
    received = backend.receive_buffers(spec)
    for r, s in zip(received, sent):
        r.copy_(s)
    backend.load(spec, received, final=True)
    assert len(_calls(standin, "reset_prefix_cache")) == 1


def test_a_push_too_large_for_shared_memory_lands_in_the_temporary_folder(
    standin, backend, tiny_model_dir, monkeypatch
):
    model = load_model(tiny_model_dir)
    spec, sent = weights.flatten(weights.push_tensors(model, full=True))
    real = os.statvfs

    def full(path):  # /dev/shm reports no room left
        stats = real(path)
        return SimpleNamespace(
            f_bavail=0 if path == backend.shm_dir else stats.f_bavail, f_frsize=stats.f_frsize
        )

    monkeypatch.setattr(os, "statvfs", full)
    received = backend.receive_buffers(spec)
    assert all(path.startswith(backend.disk_dir) for path, _, _ in backend._files)
    for r, s in zip(received, sent):
        r.copy_(s)
    backend.load(spec, received, final=True)
    held = backend.llm.hf.state_dict()
    assert all(torch.equal(held[n], t) for n, t in model.state_dict().items())
    assert not os.listdir(backend.disk_dir)
    backend.close()
    assert not os.path.exists(backend.disk_dir) and not os.path.exists(backend.shm_dir)


def test_a_push_of_a_tensor_the_model_lacks_is_refused_before_vllm_is_asked(standin, backend):
    spec = [["model.nothing.weight", "float32", 4]]
    received = backend.receive_buffers(spec)
    with pytest.raises(KeyError, match=r"'model.nothing.weight' \(4 values\)"):
        backend.load(spec, received, final=True)
    assert [c["method"] for c in _calls(standin, "collective_rpc")] == ["cohort_probe"]  # only the start's
    assert not os.listdir(backend.shm_dir)  # its files are gone all the same


def test_over_nccl_the_vllm_workers_join_the_trainers_group_and_receive_the_push(
    standin, tiny_model_dir, monkeypatch
):
    """rollout.weight_transport picks NCCL (gloo stands in, _nccl_standin.py): the vLLM worker joins the
    trainer's group itself as rank 1 + its vLLM rank, receives into its device and loads by name; the cohort
    worker's process holds no buffer and writes no file."""
    from _nccl_standin import nccl_as_gloo

    from cohort.serve.vllm_backend import VLLMBackend

    built: list = []
    nccl_as_gloo(monkeypatch, built)
    b = VLLMBackend(str(tiny_model_dir), dtype="float32")
    try:
        ids = b.identity()
        assert ids["transports"] == ["gloo", "nccl"] and ids["receivers"] == 1 and ids["gpus"] == []
        model = load_model(tiny_model_dir)
        torch.manual_seed(1)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01 * torch.randn_like(p))
        named = weights.push_tensors(model, full=True)
        named[2] = (named[2][0], named[2][1].to(torch.bfloat16))  # two dtypes: two buffers, in spec order
        spec, sent = weights.flatten(named)
        store = weights.host_store("127.0.0.1", 10)
        header = {"store_host": "127.0.0.1", "store_port": store.port, "prefix": "v/", "timeout": 10.0}
        header.update(transport="nccl", size=2)
        failed: list = []

        def worker():
            try:
                b.receive(b.open_channel(header), spec, final=True)
            except Exception as e:  # surfaced below
                failed.append(e)

        thread = threading.Thread(target=worker)
        thread.start()
        trainer = weights.Channel(store, "v/", 0, "127.0.0.1", 10.0, transport="nccl", size=2)
        trainer.wait(trainer.broadcast(sent))
        thread.join(30)
        assert not failed, failed
        assert sorted(built) == [(0, 2), (1, 2)]
        rpcs = _calls(standin, "collective_rpc")
        assert [c["method"] for c in rpcs] == ["cohort_probe", "cohort_open_channel", "cohort_receive"]
        assert rpcs[1]["args"][3] == 2  # the group's size: the trainer and the one vLLM worker
        (loaded,) = _calls(standin, "load_weights")
        assert [name for name, _, _ in loaded] == [name for name, _, _ in spec]
        held = b.llm.hf.state_dict()
        assert all(torch.equal(held[n], t.float()) for n, t in named)
        assert len(_calls(standin, "reset_prefix_cache")) == 1
        assert not b._files and not os.listdir(b.shm_dir)
    finally:
        b.close()


# --- through a `cohort serve --engine vllm` process -------------------------------------------------------------------


def _rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_run_through_a_vllm_worker_process(tiny_model_dir, tmp_path, monkeypatch):
    """Two training steps whose completions come from `cohort serve --engine vllm` over the stand-in: the hello,
    the identity check, the gloo channel, the pushes through shared memory and the extension, the requests."""
    from cohort.trainer import GRPOTrainer

    monkeypatch.syspath_prepend(STANDIN)  # on the worker's PYTHONPATH (serving passes sys.path on)
    log = tmp_path / "vllm-calls.jsonl"
    monkeypatch.setenv("COHORT_VLLM_STANDIN_LOG", str(log))
    with serving(tiny_model_dir, "--engine", "vllm", "--seed", "7") as (address, _):
        with pytest.raises(
            ConfigError, match=rf"worker at {address} refused the trainer: this worker samples with vLLM"
        ):
            GRPOTrainer(run_config(tiny_model_dir, tmp_path / "builtin", **{"rollout.workers": [address]}))
        # A CPU trainer on any machine: the stand-in's GPU workers receive over gloo (a GPU trainer would push
        # over NCCL, which the stand-in does not have).
        over = {"rollout.engine": "vllm", "rollout.workers": [address], "steps": 2, "model.device": "cpu"}
        trainer = GRPOTrainer(run_config(tiny_model_dir, tmp_path / "vllm", **over))
        assert trainer.remote is not None
        try:
            trainer.train()
            trainer.remote.push_weights()  # the last step's update too
        finally:
            trainer.remote.close()
    rows = _rows(tmp_path / "vllm")
    assert len(rows) == 2 and rows[-1]["serve/workers"] == 1.0
    assert all(
        0 <= r["sampler/logprob_gap"] < 1e-4 for r in rows
    )  # the stand-in's log-probs are the trainer's
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    (settings,) = [c["details"] for c in calls if c["what"] == "LLM"]
    assert settings["seed"] == 7 and settings["logprobs_mode"] == "processed_logprobs"
    generated = [c["details"] for c in calls if c["what"] == "generate"]
    assert len(generated) == 2
    assert all(p["n"] == 4 and isinstance(p["seed"], int) for g in generated for p in g["params"])
    loads = [c["details"] for c in calls if c["what"] == "load_weights"]
    assert [n for n, _, _ in loads[0]] == list(trainer.model.state_dict())  # the first push: everything
    resets = [c["details"] for c in calls if c["what"] == "reset_prefix_cache"]
    # one per push (on connect, before step 2, the one above); the worker holds the trainer's weights
    assert len(resets) == 3 and resets[-1]["weights"] == _standin_module().digest(trainer.model)


def _standin_module():
    """Returns the stand-in loaded under another name (this process's `vllm` stays unimported)."""
    spec = importlib.util.spec_from_file_location(
        "cohort_test_vllm_standin", Path(STANDIN) / "vllm" / "__init__.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module


def test_a_builtin_worker_refuses_a_vllm_trainer(tiny_model_dir, tmp_path):
    from cohort.trainer import GRPOTrainer

    with serving(tiny_model_dir) as (address, _):
        over = {"rollout.engine": "vllm", "rollout.workers": [address]}
        with pytest.raises(
            ConfigError,
            match=r"refused the trainer: this worker samples with cohort's engines .*"
            r"start the worker with `cohort serve --engine vllm`",
        ):
            GRPOTrainer(run_config(tiny_model_dir, tmp_path, **over))
