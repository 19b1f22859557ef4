"""Bad rollout-worker settings fail before training with one line naming the fix: staleness below 0 or above 0
without workers (with several training processes: tests/serve/test_serve_torchrun.py), malformed or silent
addresses, a worker serving another model, another cohort version. And what rollout.max_staleness implies: the sampler correction's default."""

from __future__ import annotations

import contextlib
import json
import socket

import pytest
from _serve_helpers import run_config, serving

from cohort.config import ConfigError
from cohort.serve import protocol
from cohort.trainer import GRPOTrainer


@pytest.mark.parametrize(
    "over, match",
    [
        (
            {"rollout.max_staleness": -1},
            r"rollout.max_staleness=-1 must be an int >= 0.*set rollout.max_staleness=0",
        ),
        ({"rollout.max_staleness": 1}, r"only rollout workers do; set rollout.workers"),
        (
            {"rollout.max_staleness": True, "rollout.workers": 1},
            r"rollout.max_staleness=True: expected an integer",
        ),
        ({"rollout.workers": 0}, r"rollout.workers=0: give a number of local workers >= 1"),
        ({"rollout.workers": ["nohost"]}, r"'nohost', which is not host:port"),
        ({"rollout.workers": ["127.0.0.1:5555", "127.0.0.1:5555"]}, r"lists an address twice"),
        (
            {"rollout.worker_timeout": 0},
            r"rollout.worker_timeout=0(\.0)? must be a positive number of seconds",
        ),
    ],
)
def test_bad_worker_settings_are_config_errors(tiny_model_dir, tmp_path, over, match):
    with pytest.raises(ConfigError, match=match):
        run_config(tiny_model_dir, tmp_path, **over).validate()


@pytest.mark.parametrize(
    "over, expected",
    [
        ({}, "none"),
        ({"rollout.workers": 1}, "none"),
        ({"rollout.workers": 1, "rollout.max_staleness": 2}, "token_tis"),
        (
            {"rollout.workers": 1, "rollout.max_staleness": 2, "algo.sampler_correction": "sequence_mis"},
            "sequence_mis",
        ),
        ({"rollout.workers": 1, "rollout.max_staleness": 2, "algo.sampler_correction": "none"}, "none"),
    ],
)
def test_the_sampler_correction_follows_staleness_unless_set(tiny_model_dir, tmp_path, over, expected):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a correction chosen with staleness is not an inert key
        cfg = run_config(tiny_model_dir, tmp_path, **over).validate()
    assert cfg.algo.sampler_correction == expected


def test_workers_parse_from_overrides(tiny_model_dir, tmp_path):
    assert run_config(tiny_model_dir, tmp_path, **{"rollout.workers": "2"}).rollout.workers == 2
    cfg = run_config(tiny_model_dir, tmp_path, **{"rollout.workers": "127.0.0.1:5555,node5:5556"})
    assert cfg.rollout.workers == ["127.0.0.1:5555", "node5:5556"]


def test_an_address_that_does_not_answer(tiny_model_dir, tmp_path):
    with socket.socket() as s:  # a port nothing listens on once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    over = {"rollout.workers": [f"127.0.0.1:{port}"], "rollout.connect_timeout": 1}
    with pytest.raises(
        ConfigError, match=rf"no rollout worker answered at 127.0.0.1:{port} .*cohort serve --model"
    ):
        GRPOTrainer(run_config(tiny_model_dir, tmp_path, **over))


@contextlib.contextmanager
def _another_server(answer):
    """Yields the host:port of a zmq server that is not `cohort serve`: it answers each request's header frame
    with the one frame answer(header) returns."""
    import threading

    import zmq

    context = zmq.Context()
    server = context.socket(zmq.ROUTER)
    port = server.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def answer_everything():
        while not stop.is_set():
            if server.poll(50):
                peer, header, *_ = server.recv_multipart()
                server.send_multipart([peer, answer(header)])

    thread = threading.Thread(target=answer_everything, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        stop.set()
        thread.join()
        server.close(0)
        context.term()


@pytest.mark.parametrize(
    "answer",
    [b"1\n\n2", b"\xff\xfe", b'"a string"', b'{"ok": true, "id": %d}', b'{"status": "ok", "id": %d}'],
    ids=["not json", "not utf-8", "not an object", "no identity", "not cohort's reply"],
)
def test_an_address_where_another_server_answers(tiny_model_dir, tmp_path, answer):
    """Another program's zmq server on the port: its reply to the greeting is not cohort's protocol."""

    def reply(header: bytes) -> bytes:
        return answer % json.loads(header)["id"] if b"%d" in answer else answer

    with _another_server(reply) as address:
        over = {"rollout.workers": [address], "rollout.connect_timeout": 5}
        with pytest.raises(
            ConfigError,
            match=rf"the server at {address} is not a cohort rollout worker .*point rollout.workers at",
        ):
            GRPOTrainer(run_config(tiny_model_dir, tmp_path, **over))


def test_serve_on_a_taken_port_says_so_before_the_model_loads(tmp_path, capsys):
    from cohort.cli import main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # The model does not exist: the port is checked first, so its error is the one reported.
        assert main(["serve", "--model", str(tmp_path / "no-model"), "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"127.0.0.1:{port} is already in use" in err and "--port 0" in err, err
    assert "Traceback" not in err and "no-model" not in err


@pytest.fixture(scope="module")
def other_model_dir(tmp_path_factory):
    from cohort.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("other") / "m", hidden_size=16, num_layers=1, num_heads=2)


def test_a_worker_of_another_model_or_version_is_refused(tiny_model_dir, other_model_dir, tmp_path):
    with serving(other_model_dir) as (address, _):
        over = {"rollout.workers": [address]}
        with pytest.raises(
            ConfigError, match=rf"worker at {address} serves .*tensors differ.*cohort serve --model"
        ):
            GRPOTrainer(run_config(tiny_model_dir, tmp_path / "model", **over))
    # A worker of another cohort version, as the wire protocol shows it: its identity names its version.
    from cohort import __version__
    from cohort.models import load_model, load_tokenizer, stop_token_ids

    model, tokenizer = load_model(tiny_model_dir), load_tokenizer(tiny_model_dir)
    theirs = {**protocol.identity(model, tokenizer, *stop_token_ids(model, tokenizer)), "cohort": "0.0.1"}

    def older(header: bytes) -> bytes:
        return protocol.pack({"ok": True, "identity": theirs, "id": json.loads(header)["id"]})[0]

    with _another_server(older) as address:
        with pytest.raises(
            ConfigError,
            match=rf"worker at {address} runs cohort 0.0.1 and the trainer cohort {__version__}: install the same",
        ):
            GRPOTrainer(run_config(tiny_model_dir, tmp_path / "version", **{"rollout.workers": [address]}))


def shout(text: str) -> str:
    """Returns the text in capitals.

    Args:
        text: what to shout
    """
    return text.upper()


def test_multi_turn_episodes_ahead_of_their_step_are_refused(tiny_model_dir, tmp_path):
    cfg = run_config(tiny_model_dir, tmp_path, **{"rollout.workers": 1, "rollout.max_staleness": 1})
    with pytest.raises(
        ConfigError, match="multi-turn episodes: a batch of episodes cannot be requested ahead"
    ):
        GRPOTrainer(cfg, tools=[shout])


def test_a_worker_started_with_device_auto_samples_on_this_machines_device(tiny_model_dir, tmp_path):
    import torch

    with serving(tiny_model_dir, "--device", "auto") as (address, _):
        t = GRPOTrainer(run_config(tiny_model_dir, tmp_path / "auto", **{"rollout.workers": [address]}))
        try:
            assert t.remote is not None
            assert t.remote.clients[0].identity["device"] == ("cuda" if torch.cuda.is_available() else "cpu")
        finally:
            t.remote.close()


def test_an_address_where_a_server_of_another_kind_listens_is_named_at_once(tiny_model_dir, tmp_path):
    """An HTTP server on the port says nothing to a connection: it was waited for through all of connect_timeout,
    then reported as no worker at all, with the advice to start one on a port that is taken."""
    import http.server
    import threading
    import time

    from cohort.serve.client import speaks_zeromq

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    address = f"127.0.0.1:{server.server_address[1]}"
    try:
        assert speaks_zeromq(address, 0.5) is False
        over = {"rollout.workers": [address], "rollout.connect_timeout": 60}
        started = time.monotonic()
        with pytest.raises(
            ConfigError,
            match=rf"the server at {address} is not a cohort rollout worker \(it accepts "
            r"connections but does not speak ZeroMQ",
        ):
            GRPOTrainer(run_config(tiny_model_dir, tmp_path, **over))
        assert time.monotonic() - started < 30  # not connect_timeout's 60 s
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
    with socket.socket() as free:  # nothing listens: not decided here (a worker may still be loading)
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    assert speaks_zeromq(f"127.0.0.1:{port}", 0.5) is None
    with _another_server(lambda header: b"") as zmq_address:
        assert speaks_zeromq(zmq_address, 2.0) is True
