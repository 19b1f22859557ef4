"""How weight pushes travel (rollout.weight_transport): which transport each worker gets, the refusals, and the
NCCL path itself (polled transfers, the abort of a late one, pushes in buckets built where the channel receives,
a builtin worker receiving into its device) with gloo standing in for NCCL (_nccl_standin.py): this machine has
no GPU, so nothing here runs NCCL; docs/serving.md says so."""

from __future__ import annotations

import json
import os
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch
from _nccl_standin import nccl_as_gloo
from _serve_helpers import run_config, serving

from cohort.config import ConfigError
from cohort.serve import weights
from cohort.trainer import GRPOTrainer

GPU = torch.device("cuda:0")
WORKER_GPU = {"transports": ["gloo", "nccl"], "gpus": ["GPU-b"], "device": "cuda"}


def _on_gpus(monkeypatch, trainer_uuid="GPU-a"):
    """Makes this CPU machine look like one whose trainer holds its weights on a GPU with NCCL."""
    monkeypatch.setattr(weights, "receivable", lambda device: ["gloo", "nccl"])
    monkeypatch.setattr(weights, "gpu_uuid", lambda device: trainer_uuid)


def test_gloo_is_chosen_off_the_gpu_and_nccl_is_refused_there():
    cpu = torch.device("cpu")
    assert weights.choose_transport("auto", cpu, WORKER_GPU, "w:1") == "gloo"
    assert weights.choose_transport("gloo", cpu, WORKER_GPU, "w:1") == "gloo"
    with pytest.raises(ValueError, match=r"weight_transport=nccl, but the trainer's weights are on cpu: set"):
        weights.choose_transport("nccl", cpu, WORKER_GPU, "w:1")
    with pytest.raises(ValueError, match=r"'udp' is not one of auto, gloo, nccl"):
        weights.choose_transport("udp", cpu, WORKER_GPU, "w:1")


def test_a_torch_without_nccl_is_named(monkeypatch):
    monkeypatch.setattr(weights, "receivable", lambda device: ["gloo"])
    assert weights.choose_transport("auto", GPU, WORKER_GPU, "w:1") == "gloo"
    with pytest.raises(ValueError, match=r"this torch has no NCCL"):
        weights.choose_transport("nccl", GPU, WORKER_GPU, "w:1")


@pytest.mark.parametrize(
    "worker, why",
    [
        (
            {"transports": ["gloo"], "device": "cpu"},
            r"the worker at w:1 cannot receive over NCCL \(its device: cpu\)",
        ),
        ({}, r"cannot receive over NCCL"),  # a worker of an older cohort names no transports: gloo
        (
            {"transports": ["gloo", "nccl"], "gpus": ["GPU-a"], "device": "cuda"},
            r"the worker at w:1 runs on the trainer's own GPU \(GPU-a\), and NCCL cannot pair two processes",
        ),
    ],
)
def test_auto_falls_back_to_gloo_where_nccl_cannot_work(monkeypatch, worker, why):
    _on_gpus(monkeypatch)
    assert weights.choose_transport("auto", GPU, worker, "w:1") == "gloo"
    with pytest.raises(ValueError, match=why):
        weights.choose_transport("nccl", GPU, worker, "w:1")


def test_auto_takes_nccl_between_distinct_gpus(monkeypatch):
    _on_gpus(monkeypatch)
    assert weights.choose_transport("auto", GPU, WORKER_GPU, "w:1") == "nccl"
    assert weights.choose_transport("nccl", GPU, WORKER_GPU, "w:1") == "nccl"
    assert weights.choose_transport("gloo", GPU, WORKER_GPU, "w:1") == "gloo"


@pytest.mark.parametrize(
    "over, match",
    [
        (
            {"rollout.weight_transport": "udp"},
            r"rollout.weight_transport='udp' is not one of auto, gloo, nccl",
        ),
        (
            {"rollout.weight_transport": "nccl", "model.device": "cpu"},
            r"weight_transport=nccl sends the weights from the trainer's GPU, and model.device=cpu: set",
        ),
        (
            {"rollout.weight_transport": "nccl", "model.device": "auto"},
            r"and no CUDA GPU is visible",
        ),
    ],
)
def test_bad_transports_are_config_errors(tiny_model_dir, tmp_path, over, match, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the refusals of a machine with no GPU
    with pytest.raises(ConfigError, match=match):
        run_config(tiny_model_dir, tmp_path, **{"rollout.workers": 1, **over}).validate()


def test_a_transport_without_workers_warns(tiny_model_dir, tmp_path):
    with pytest.warns(Warning, match=r"rollout.weight_transport.*no rollout workers to push to"):
        run_config(tiny_model_dir, tmp_path, **{"rollout.weight_transport": "gloo"}).validate()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run_config(
            tiny_model_dir, tmp_path, **{"rollout.workers": 1, "rollout.weight_transport": "gloo"}
        ).validate()


def _pair(prefix: str, timeout: float, receive: bool, got: dict):
    """Returns the trainer's end (rank 0) of an "NCCL" channel whose worker end runs in a thread (receiving one
    push of a float32 and a bfloat16 buffer into `got`, or never joining the transfer)."""
    store = weights.host_store("127.0.0.1", 10)

    def worker():
        end = weights.Channel(
            weights.join_store("127.0.0.1", store.port, 10), prefix, 1, "127.0.0.1", timeout, transport="nccl"
        )
        if receive:
            buffers = weights.empty_buffers([["a", "float32", 5], ["b", "bfloat16", 3]])
            end.wait(end.broadcast(buffers))
            got["buffers"] = buffers
        else:
            time.sleep(timeout + 3)  # holds the group open without joining the broadcast

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    end = weights.Channel(store, prefix, 0, "127.0.0.1", timeout, transport="nccl")
    return end, thread


def test_an_nccl_channel_polls_its_transfers(monkeypatch):
    nccl_as_gloo(monkeypatch)
    got: dict = {}
    end, thread = _pair("ok/", 10.0, True, got)
    sent = [torch.arange(5.0), torch.full((3,), 1.5, dtype=torch.bfloat16)]
    end.wait(end.broadcast(sent))
    thread.join(10)
    assert all(torch.equal(a, b) for a, b in zip(got["buffers"], sent))


def test_a_late_nccl_transfer_is_aborted_at_the_worker_timeout(monkeypatch):
    nccl_as_gloo(monkeypatch)
    end, thread = _pair("late/", 1.5, False, {})
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"an NCCL weight transfer did not finish in 1.5 s \(aborted\)"):
        end.wait(end.broadcast([torch.ones(4)]))
    assert time.monotonic() - t0 < 5  # the poll's deadline, not NCCL's watchdog (4 timeouts: 6 s)
    end.close()  # after an abort too
    thread.join(10)  # the worker's end is released within the test, not at the interpreter's exit


def _rows(out: Path):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_run_over_the_nccl_path_equals_the_in_process_run(tiny_model_dir, tmp_path, monkeypatch):
    """A worker started with the stand-in: the channel is "NCCL" at both ends, each push goes in buckets (0.02 MiB
    here: several per push) built where the channel receives, landing bucket by bucket, and the run is still the
    in-process run to the bit (staleness 0, one worker)."""
    built: list = []
    nccl_as_gloo(monkeypatch, built)
    over = {"steps": 2, "model.device": "cpu"}  # a CPU trainer on any machine: the stand-in's "NCCL" is gloo
    bucket = {"rollout.push_bucket_mib": 0.02}
    plain = GRPOTrainer(run_config(tiny_model_dir, tmp_path / "plain", **over))
    plain.train()
    standin = str(Path(__file__).resolve().parent / "_nccl_standin.py")
    with serving(tiny_model_dir, entry=(standin,)) as (address, _):
        cfg = run_config(
            tiny_model_dir,
            tmp_path / "remote",
            **over,
            **bucket,
            **{"rollout.workers": [address], "rollout.weight_transport": "nccl"},
        )
        with pytest.raises(
            ConfigError, match=r"weight_transport=nccl sends the weights from the trainer's GPU"
        ):
            cfg.validate()  # this CPU trainer is refused nccl by name; auto takes the stand-in's "NCCL"
        cfg = run_config(
            tiny_model_dir, tmp_path / "remote", **over, **bucket, **{"rollout.workers": [address]}
        )
        remote = GRPOTrainer(cfg)
        try:
            (client,) = remote.remote.clients
            assert client.channel.transport == "nccl" and client.identity["transports"] == ["gloo", "nccl"]
            assert built == [(0, 2)]
            pushes = []
            send = remote.remote.send_weights

            def counting(spec, buffers, **kw):
                pushes.append(
                    (len(spec), sum(b.numel() * b.element_size() for b in buffers), kw.get("final"))
                )
                return send(spec, buffers, **kw)

            monkeypatch.setattr(remote.remote, "send_weights", counting)
            remote.train()
        finally:
            remote.remote.close()
    assert len(pushes) > 4 and [final for *_, final in pushes].count(True) == 2  # two pushes, in buckets
    largest = max(t.numel() * t.element_size() for t in plain.model.state_dict().values())
    assert all(size <= max(0.02 * 2**20, largest) for _, size, _ in pushes)  # a bucket, or one larger tensor
    a, b = _rows(tmp_path / "plain"), _rows(tmp_path / "remote")
    for ra, rb in zip(a, b):
        differ = [k for k in ra if not k.startswith("time") and k != "step_time" and ra[k] != rb[k]]
        assert not differ, {k: (ra[k], rb[k]) for k in differ}
    wa, wb = plain.model.state_dict(), remote.model.state_dict()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_an_nccl_channel_is_made_with_the_watchdog_leaving_errors_to_it(monkeypatch):
    """NCCL's watchdog thread would re-raise a dead peer's error on its own thread and end the trainer: the
    channel's group is made with TORCH_NCCL_ASYNC_ERROR_HANDLING=0 (read in the constructor), the variable restored
    after."""
    seen: list = []

    class Options:
        def __init__(self):
            self._timeout = None

    class FakeNCCL:
        def __init__(self, store, rank, size, options):
            seen.append((os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING"), rank, size, options._timeout))

    FakeNCCL.Options = Options
    monkeypatch.setattr(weights.tdist, "ProcessGroupNCCL", FakeNCCL, raising=False)
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    weights._nccl(None, 0, 2, "127.0.0.1", 5.0)
    assert seen[0][:3] == ("0", 0, 2) and seen[0][3].total_seconds() > 5.0
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"  # as the user set it
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING")
    weights._nccl(None, 1, 2, "127.0.0.1", 5.0)
    assert seen[1][0] == "0" and "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in os.environ


def test_a_failed_nccl_transfer_aborts_its_channel_and_says_why():
    aborted: list = []

    class Work:
        def is_completed(self):
            return True  # NCCL marks a work that failed as completed, with its error

        def wait(self):
            raise RuntimeError("NCCL error: remote process exited or there was a network error")

    channel = weights.Channel.__new__(weights.Channel)
    channel.timeout, channel.transport = 5.0, "nccl"
    channel.group = type("Group", (), {"abort": lambda self: aborted.append(1)})()
    with pytest.raises(
        RuntimeError, match=r"an NCCL weight transfer failed \(NCCL error: remote process exited"
    ):
        channel.wait([Work()])
    assert aborted == [1]


def test_a_lost_workers_nccl_channel_is_aborted_not_shut_down():
    """A shutdown waits for the peer to finalise with it; a lost worker never will."""
    calls: list = []
    channel = weights.Channel.__new__(weights.Channel)
    channel.transport = "nccl"
    channel.group = type(
        "Group",
        (),
        {"abort": lambda self: calls.append("abort"), "shutdown": lambda self: calls.append("shutdown")},
    )()
    channel.close()
    channel.close(lost=True)
    assert calls == ["shutdown", "abort"]
