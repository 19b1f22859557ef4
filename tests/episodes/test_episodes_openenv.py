"""cohort.episodes.openenv: a real openenv-core server (an Environment of the test's own, served by uvicorn on
127.0.0.1) driven through OpenEnvEnvironment; the clear errors for an address where nothing listens, a server
that is not OpenEnv's, one that answers garbage or not at all, a full server, and a missing package; and that
no thread or session outlives the environments."""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import http.server
import importlib.util
import json
import re
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from cohort.episodes.environments import (
    EnvironmentProtocolError,
    EnvStep,
    check_environment_factory,
    is_text_environment,
)
from cohort.episodes.openenv import (
    _LOOP,
    INSTALL_HINT,
    EnvironmentServerError,
    OpenEnvEnvironment,
    message_action,
    observation_text,
)
from cohort.errors import ConfigError

# find_spec only: importing openenv-core takes seconds (it imports gradio), paid by the tests that use it
DOCS = Path(__file__).resolve().parents[2] / "docs" / "environments.md"

HAVE_OPENENV = importlib.util.find_spec("openenv") is not None
needs_openenv = pytest.mark.skipif(not HAVE_OPENENV, reason="openenv-core is not installed: " + INSTALL_HINT)


def _no_loop_thread_left() -> bool:
    """Returns whether the shared event loop of the adapter is stopped and its thread gone."""
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        if not _LOOP.running and not any(t.name == "cohort-openenv-loop" for t in threading.enumerate()):
            return True
        time.sleep(0.02)
    return False


@pytest.fixture(autouse=True)
def _environments_leave_no_loop():
    yield
    assert _no_loop_thread_left(), "an OpenEnvEnvironment was left open: the shared loop thread still runs"


def _listening_socket() -> socket.socket:
    """Returns a socket bound to a free port of 127.0.0.1 (bound here, so no other process can take the port)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


def _closed_port() -> int:
    """Returns a port of 127.0.0.1 where nothing listens."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# -- the server: a counting game written for this test with openenv-core's own server classes ------------------


def _counting_app(max_concurrent_envs: int):
    """Returns an openenv-core FastAPI app serving Counting: count up from the reset's `start`, three turns."""
    from openenv.core.env_server.http_server import create_fastapi_app
    from openenv.core.env_server.interfaces import Environment
    from openenv.core.env_server.types import Action, Observation, State

    class Say(Action):
        message: str

    class Heard(Observation):
        text: str = ""
        turn: int = 0

    class Counting(Environment):
        SUPPORTS_CONCURRENT_SESSIONS = True

        def __init__(self) -> None:
            super().__init__()
            self._state = State()
            self.next = 0

        def reset(self, seed=None, episode_id=None, start: int = 1, **kwargs) -> Heard:
            self._state = State(episode_id=episode_id)
            self.next = start
            return Heard(text=f"Count up from {start}, one number per reply.")

        def step(self, action: Say, timeout_s=None, **kwargs) -> Heard:  # type: ignore[override]
            if action.message == "boom":
                raise ValueError("the counting board caught fire")
            self._state.step_count += 1
            right = action.message.strip() == str(self.next)
            self.next += 1
            return Heard(
                text="right" if right else f"wrong, it was {self.next - 1}",
                turn=self._state.step_count,
                reward=1.0 if right else 0.0,
                done=self._state.step_count >= 3,
            )

        @property
        def state(self) -> State:
            return self._state

    return create_fastapi_app(Counting, Say, Heard, max_concurrent_envs=max_concurrent_envs), Say


@contextlib.contextmanager
def _serving(app) -> Iterator[str]:
    """Serves an openenv-core app with uvicorn on a free port of 127.0.0.1 in a thread; yields its base URL and stops
    the server (its thread joined) on exit."""
    import uvicorn

    sock = _listening_socket()
    # critical: openenv-core 0.3.0's server logs a WebSocketDisconnect traceback when a client's close races its own
    server = uvicorn.Server(uvicorn.Config(app, log_level="critical", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="test-openenv-server")
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    try:
        assert server.started, "the openenv-core server did not start"
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
        assert not thread.is_alive(), "the uvicorn server thread did not stop"


@pytest.fixture(scope="module")
def counting_server() -> Iterator[tuple[str, type]]:
    """Yields the base URL of a real openenv-core server of Counting (2 sessions at most) and its Action type."""
    app, say = _counting_app(max_concurrent_envs=2)
    with _serving(app) as url:
        yield url, say


@needs_openenv
@pytest.mark.slow
def test_episodes_run_on_a_real_openenv_server(counting_server):
    url, _ = counting_server
    with OpenEnvEnvironment(url, timeout=10) as env:
        assert is_text_environment(env)
        for start in (1, 5, 40):  # the row's start reaches the server's reset(start=...)
            assert env.reset(start=start, prompt=[{"role": "user", "content": "count"}]) == (
                f"Count up from {start}, one number per reply."
            )
            steps = [env.step(f"I say {start}"), env.step(str(start + 1)), env.step(str(start + 5))]
            # two text fields (text, turn is an int): the single text field is the observation's text
            assert steps == [
                EnvStep("wrong, it was " + str(start), 0.0, False),
                EnvStep("right", 1.0, False),
                EnvStep(f"wrong, it was {start + 2}", 0.0, True),
            ]
            with pytest.raises(RuntimeError, match=r"no episode under way .*call reset\(\) first"):
                env.step("1")
        assert env.reset() == "Count up from 1, one number per reply."  # an empty row: the server's default
    check_environment_factory(functools.partial(OpenEnvEnvironment, url, timeout=10))


@needs_openenv
@pytest.mark.slow
def test_hooks_build_the_action_and_read_the_observation(counting_server):
    url, say = counting_server
    seen = []

    def reads(observation):
        seen.append(observation)
        return f"{observation['text']} (turn {observation['turn']})"

    with OpenEnvEnvironment(
        url,
        action_from_text=lambda text: say(message=text.strip().split()[-1]),  # the env's own pydantic Action
        observation_text=reads,
        reset_arguments=lambda row: {"start": row["level"] * 10},
    ) as env:
        assert env.reset(level=2, prompt="ignored") == "Count up from 20, one number per reply. (turn 0)"
        assert env.step("my answer: 20") == EnvStep("right (turn 1)", 1.0, False)
    assert seen[0] == {"text": "Count up from 20, one number per reply.", "turn": 0}


@needs_openenv
@pytest.mark.slow
def test_sessions_are_freed_and_a_full_server_is_named(counting_server):
    url, _ = counting_server
    for _ in range(2):  # the server takes 2 sessions: closed ones must be freed for the next two
        with OpenEnvEnvironment(url) as a, OpenEnvEnvironment(url) as b:
            with concurrent.futures.ThreadPoolExecutor(2) as pool:  # two episodes at once on the shared loop
                firsts = list(
                    pool.map(lambda env_start: env_start[0].reset(start=env_start[1]), [(a, 3), (b, 7)])
                )
            assert firsts == [
                "Count up from 3, one number per reply.",
                "Count up from 7, one number per reply.",
            ]
            assert (a.step("3").reward, b.step("7").reward) == (1.0, 1.0)
            with OpenEnvEnvironment(url) as third:
                with pytest.raises(
                    EnvironmentServerError, match=r"refused a session .*max_concurrent_envs=N"
                ):
                    third.reset()


@needs_openenv
@pytest.mark.slow
def test_server_side_failures_are_named_and_the_next_reset_starts_afresh(counting_server):
    url, _ = counting_server
    with OpenEnvEnvironment(url, timeout=10) as env:
        env.reset()
        with pytest.raises(
            EnvironmentServerError, match=r"failed on step .*caught fire.*see the server's log"
        ):
            env.step("boom")
        with pytest.raises(RuntimeError, match="last call failed"):
            env.step("1")
        assert env.reset(start=2).startswith("Count up from 2")
        assert env.step("2").reward == 1.0
    with OpenEnvEnvironment(url, action_from_text=lambda text: {"words": text}) as env:
        env.reset()
        with pytest.raises(EnvironmentServerError, match=r"VALIDATION_ERROR.*check that action_from_text"):
            env.step("1")


@needs_openenv
@pytest.mark.slow
def test_a_row_that_is_not_json_is_named(counting_server):
    url, _ = counting_server
    with OpenEnvEnvironment(url) as env:
        with pytest.raises(
            EnvironmentProtocolError, match=r"row's 'board' \(set\) cannot be sent .*reset_arguments"
        ):
            env.reset(board={1, 2})
        assert env.reset(start=4).startswith("Count up from 4")
    with OpenEnvEnvironment(url, observation_text=lambda observation: observation) as env:
        with pytest.raises(EnvironmentProtocolError, match=r"observation_text returned dict .*must return"):
            env.reset()


@needs_openenv
@pytest.mark.slow
def test_the_documented_server_and_client_run_as_documented():
    text = DOCS.read_text()
    server_code = re.search(r"```python\n(# my_env/server\.py\n.*?)```", text, re.S)
    client_code = re.search(r"### Pointing cohort at it\n\n```python\n(.*?)```", text, re.S)
    assert server_code and client_code, "docs/environments.md lost its OpenEnv example"
    namespace: dict = {}
    exec(compile(server_code.group(1), str(DOCS), "exec"), namespace)
    with _serving(namespace["app"]) as url:
        documented = client_code.group(1).replace("http://127.0.0.1:8000", url)
        setup = documented.split("env.reset()")[0]
        calls = re.findall(r"^(env\.(?:reset|step)\(.*?\))\s+# (.*)$", documented, re.M)
        assert len(calls) == 2
        scope: dict = {}
        exec(compile(setup, str(DOCS), "exec"), scope)
        try:
            for call, shown in calls:  # each call returns what its comment shows
                assert repr(eval(call, scope)) == shown
        finally:
            scope["env"].close()


# -- addresses that do not answer as OpenEnv does --------------------------------------------------------------


@needs_openenv
def test_an_address_where_nothing_listens_is_named_with_the_fix():
    pytest.importorskip("openenv.core.generic_client")  # seconds of imports, not to be timed below
    url = f"http://127.0.0.1:{_closed_port()}"
    started = time.monotonic()
    with pytest.raises(EnvironmentServerError) as info:
        OpenEnvEnvironment(url, connect_timeout=5)
    assert time.monotonic() - started < 5
    message = str(info.value)
    assert f"cannot reach an OpenEnv server at ws://{url[7:]}/ws" in message
    assert "start the environment's server first" in message and "base_url" in message
    with pytest.raises(ConfigError, match=r"raised on construction: EnvironmentServerError: cannot reach"):
        check_environment_factory(lambda: OpenEnvEnvironment(url, connect_timeout=5))


@needs_openenv
def test_a_web_server_that_is_not_openenv_is_named():
    class NotFound(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_error(404)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    thread = threading.Thread(target=server.serve_forever, name="test-plain-http")
    thread.start()
    try:
        with pytest.raises(
            EnvironmentServerError, match=r"cannot reach an OpenEnv server at ws://127\.0\.0\.1:\d+/ws"
        ):
            OpenEnvEnvironment(f"http://127.0.0.1:{server.server_address[1]}", connect_timeout=5)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def _websocket_server(answer: Callable[[str], str | None], *, hang_up: bool = False):
    """Returns a started websockets server on 127.0.0.1 that sends `answer(message)` for each message (nothing for
    None), or closes the connection at the first message when `hang_up`, and its thread."""
    from websockets.sync.server import serve

    def handler(connection):
        try:
            for message in connection:
                if hang_up:
                    connection.close()
                    return
                reply = answer(message)
                if reply is not None:
                    connection.send(reply)
        except Exception:  # the client went away
            pass

    server = serve(handler, "127.0.0.1", 0)
    thread = threading.Thread(target=server.serve_forever, name="test-garbage-ws")
    thread.start()
    return server, thread


@needs_openenv
@pytest.mark.parametrize(
    ("answer", "cause"),
    [
        ("this is not json", "JSONDecodeError"),
        (
            json.dumps({"type": "observation", "data": {"hello": 1}}),
            "expected an object with an 'observation'",
        ),
        (
            json.dumps({"type": "observation", "data": {"observation": {}, "reward": "lots"}}),
            "a number or null",
        ),
        (json.dumps({"type": "observation", "data": {"observation": {}, "done": "yes"}}), "true or false"),
    ],
)
def test_a_server_that_answers_garbage_is_named(answer, cause):
    server, thread = _websocket_server(lambda message: answer)
    url = f"http://127.0.0.1:{server.socket.getsockname()[1]}"
    try:
        with OpenEnvEnvironment(url, timeout=5) as env:
            with pytest.raises(EnvironmentServerError) as info:
                env.reset()
        message = str(info.value)
        assert (
            f"the server at ws://{url[7:]}/ws answered reset with something that is not OpenEnv's protocol"
            in message
        )
        assert cause in message and "check that base_url is an OpenEnv environment server" in message
    finally:
        server.shutdown()
        thread.join(timeout=5)


@needs_openenv
def test_a_server_that_never_answers_times_out():
    server, thread = _websocket_server(lambda message: None)
    url = f"http://127.0.0.1:{server.socket.getsockname()[1]}"
    try:
        with OpenEnvEnvironment(url, timeout=0.5, connect_timeout=5) as env:
            started = time.monotonic()
            with pytest.raises(EnvironmentServerError, match=r"did not answer reset within 0\.5 s; .*raise"):
                env.reset()
            assert time.monotonic() - started < 5
    finally:
        server.shutdown()
        thread.join(timeout=5)


@needs_openenv
def test_a_server_that_closes_the_session_is_named():
    server, thread = _websocket_server(lambda message: None, hang_up=True)
    url = f"http://127.0.0.1:{server.socket.getsockname()[1]}"
    try:
        with OpenEnvEnvironment(url, timeout=5) as env:
            with pytest.raises(
                EnvironmentServerError, match=r"closed the session during reset .*check the server's log"
            ):
                env.reset()
    finally:
        server.shutdown()
        thread.join(timeout=5)


# -- arguments, defaults, the missing package ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"base_url": ""}, "base URL as a string"),
        ({"base_url": None}, "base URL as a string"),
        (
            {"base_url": "http://127.0.0.1:1", "timeout": 0},
            "timeout must be a positive, finite number of seconds, got 0",
        ),
        (
            {"base_url": "http://127.0.0.1:1", "connect_timeout": -1},
            "connect_timeout must be a positive",
        ),
        ({"base_url": "http://127.0.0.1:1", "timeout": True}, "timeout must be a positive"),
        ({"base_url": "http://127.0.0.1:1", "timeout": float("inf")}, "timeout must be a positive, finite"),
    ],
)
def test_bad_arguments_are_config_errors_before_any_import(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        OpenEnvEnvironment(**kwargs)


@needs_openenv
def test_a_typed_client_needs_action_from_text():
    from openenv.core.env_client import EnvClient

    class TypedClient(EnvClient):
        pass

    with pytest.raises(ConfigError, match=r"client_class=.*TypedClient takes .* pass action_from_text="):
        OpenEnvEnvironment("http://127.0.0.1:1", client_class=TypedClient)


def test_a_missing_openenv_core_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "openenv.core.generic_client", None)  # import of it raises ImportError
    with pytest.raises(ImportError, match=r"needs the openenv-core package.*pip install 'cohort\[openenv\]'"):
        OpenEnvEnvironment("http://127.0.0.1:1")


def test_message_action_is_the_text_environments_field():
    assert message_action("guess 5") == {"message": "guess 5"}


class _Model:
    """Stands in for a pydantic Observation: observation_text reads its fields through model_dump."""

    def model_dump(self, exclude=()):
        fields = {"board": "x.o", "score": 3, "reward": 1.0, "done": False, "metadata": {}}
        return {k: v for k, v in fields.items() if k not in exclude}


@pytest.mark.parametrize(
    ("observation", "text"),
    [
        ("plain", "plain"),
        ({"echoed_message": "hi", "message_length": 2}, "hi"),  # the only text field
        ({"prompt": "p", "text": "t", "other": "o"}, "t"),  # several: the first of TEXT_FIELDS
        ({"message": "m", "prompt": "p"}, "m"),
        ({"board": [1, 2], "score": 3}, '{"board": [1, 2], "score": 3}'),  # no text field: JSON
        ({"a": "x", "b": "y"}, '{"a": "x", "b": "y"}'),
        (_Model(), "x.o"),
    ],
)
def test_observation_text_defaults(observation, text):
    assert observation_text(observation) == text


def test_observation_text_refuses_what_it_cannot_read():
    with pytest.raises(EnvironmentProtocolError, match=r"type int; pass observation_text="):
        observation_text(3)


@needs_openenv
@pytest.mark.slow
def test_a_full_server_right_after_a_timed_out_call_names_that_call(counting_server):
    """A step that timed out keeps running on the server, holding its session: the reset that follows at once is
    refused as a full server, which is not what to fix (it said to raise max_concurrent_envs)."""
    import asyncio

    url, _ = counting_server
    with OpenEnvEnvironment(url, timeout=2, connect_timeout=5) as env:
        full = RuntimeError("Server error: CAPACITY_REACHED (1/1 sessions)")
        assert "max_concurrent_envs=N" in str(env._server_error("reset", full))
        assert "did not answer step within 2 s" in str(env._server_error("step", asyncio.TimeoutError()))
        after = str(env._server_error("reset", full))
        assert "after a call of this environment timed out" in after and "max_concurrent_envs" not in after
