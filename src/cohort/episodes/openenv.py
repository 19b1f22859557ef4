"""An OpenEnv environment server as a TextEnvironment: `OpenEnvEnvironment(base_url)` talks to a server that
openenv-core's `create_app` / `create_fastapi_app` serves, through openenv-core's own client.

Each instance holds one WebSocket session of the server (one server-side environment), so one instance per
rollout is one environment per rollout; the server must allow as many concurrent sessions as rollouts run
at once (`max_concurrent_envs`, and `SUPPORTS_CONCURRENT_SESSIONS = True` on its Environment). The clients
of every open instance share one event loop thread, which stops when the last instance closes.

openenv-core is an optional dependency (`pip install 'cohort[openenv]'`), imported only when an instance is
made. Every call has a deadline: a server that is not there, does not answer, refuses, or answers with
something that is not OpenEnv's protocol is an EnvironmentServerError naming the URL and the fix, never a hang.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import math
import threading
import time
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, TypeVar

from cohort.episodes.environments import EnvironmentProtocolError, EnvStep, TextEnvironment, env_step
from cohort.errors import ConfigError, first_line

__all__ = [
    "INSTALL_HINT",
    "TEXT_FIELDS",
    "EnvironmentServerError",
    "OpenEnvEnvironment",
    "message_action",
    "observation_text",
]

INSTALL_HINT = "pip install 'cohort[openenv]'"

TEXT_FIELDS = ("text", "message", "observation", "prompt", "content", "output", "echoed_message")
"""The observation fields `observation_text` reads, in this order, when an observation has several text fields."""

_BACKSTOP_S = 5.0
"""Extra seconds the calling thread waits past a call's own deadline before giving up on the event loop itself."""

T = TypeVar("T")


class EnvironmentServerError(RuntimeError):
    """An OpenEnv server could not be reached, did not answer in time, refused a request, or answered with
    something that is not OpenEnv's protocol; the message names the URL and the fix."""


class _ProtocolViolation(ValueError):
    """A server's answer lacks what every OpenEnv answer has (an observation object, a reward, a done flag)."""


def _openenv_client() -> tuple[type[Any], Callable[[str], str]]:
    """Returns openenv-core's GenericEnvClient and its http-to-ws URL conversion; ImportError naming the extra."""
    try:
        from openenv.core.generic_client import GenericEnvClient
        from openenv.core.utils import convert_to_ws_url
    except ImportError as exc:
        raise ImportError(
            f"OpenEnvEnvironment needs the openenv-core package, which is not importable ({first_line(exc)}): "
            f"{INSTALL_HINT}"
        ) from exc
    return GenericEnvClient, convert_to_ws_url


def message_action(text: str) -> dict[str, Any]:
    """Returns the action `{"message": text}`, the field OpenEnv's text environments (echo, TextArena) take."""
    return {"message": text}


def _fields(observation: Any) -> dict[str, Any]:
    """Returns an observation's fields: a dict as it is, a pydantic Observation without reward, done, metadata."""
    if isinstance(observation, Mapping):
        return dict(observation)
    if hasattr(observation, "model_dump"):
        return dict(observation.model_dump(exclude={"reward", "done", "metadata"}))
    raise EnvironmentProtocolError(
        f"observation_text cannot read an observation of type {type(observation).__name__}; pass "
        f"observation_text=lambda observation: ... returning its text"
    )


def observation_text(observation: Any) -> str:
    """Returns an observation's text: itself when a str; its only text field; else the first of TEXT_FIELDS it
    has; else its fields as JSON (sorted keys)."""
    if isinstance(observation, str):
        return observation
    fields = _fields(observation)
    texts = {name: value for name, value in fields.items() if isinstance(value, str)}
    if len(texts) == 1:
        return next(iter(texts.values()))
    for name in TEXT_FIELDS:
        if name in texts:
            return texts[name]
    return json.dumps(fields, sort_keys=True, default=str, ensure_ascii=False)


def _check_payload(payload: Any) -> None:
    """Raises _ProtocolViolation unless `payload` is an OpenEnv answer: {"observation": {...}, "reward", "done"}."""
    if not isinstance(payload, Mapping) or not isinstance(payload.get("observation"), Mapping):
        raise _ProtocolViolation(f"expected an object with an 'observation' object, got {payload!r:.200}")
    reward = payload.get("reward")
    if reward is not None and (isinstance(reward, str) or not isinstance(reward, (int, float))):
        raise _ProtocolViolation(f"expected a number or null as 'reward', got {reward!r:.80}")
    if not isinstance(payload.get("done", False), bool):
        raise _ProtocolViolation(f"expected true or false as 'done', got {payload.get('done')!r:.80}")


_CHECKED: dict[type[Any], type[Any]] = {}


def _checked(client_class: type[Any]) -> type[Any]:
    """Returns a subclass of an openenv-core client class that refuses answers outside OpenEnv's protocol (the
    client itself would read a missing observation as an empty one and go on); one per client class."""
    if client_class not in _CHECKED:

        def parse_result(self: Any, payload: dict[str, Any]) -> Any:
            _check_payload(payload)
            return client_class._parse_result(self, payload)

        _CHECKED[client_class] = type(
            f"Checked{client_class.__name__}", (client_class,), {"_parse_result": parse_result}
        )
    return _CHECKED[client_class]


class _SharedLoop:
    """One event loop thread for the clients of every open OpenEnvEnvironment; started by the first acquire and
    stopped by the last release, so nothing outlives the environments."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._users = 0

    def acquire(self) -> asyncio.AbstractEventLoop:
        """Returns the running shared loop, counting one more user."""
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                self._thread = threading.Thread(
                    target=loop.run_forever, name="cohort-openenv-loop", daemon=True
                )
                self._thread.start()
                self._loop = loop
            self._users += 1
            return self._loop

    def release(self) -> None:
        """Counts one user less; the last one stops the loop and joins its thread."""
        with self._lock:
            self._users -= 1
            if self._users > 0 or self._loop is None:
                return
            loop, thread = self._loop, self._thread
            self._loop = self._thread = None
        loop.call_soon_threadsafe(loop.stop)
        if thread is not None:
            thread.join(timeout=_BACKSTOP_S)
            if thread.is_alive():  # a call stuck past every deadline: leave the daemon thread its loop
                return
        loop.close()

    @property
    def running(self) -> bool:
        """Returns whether the loop thread is started (for tests: it must stop with the last environment)."""
        return self._loop is not None


_LOOP = _SharedLoop()


def _positive(value: Any, name: str) -> float:
    """Returns `value` as a float of seconds; ConfigError unless it is a positive number."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not (value > 0 and math.isfinite(value))
    ):
        raise ConfigError(
            f"OpenEnvEnvironment's {name} must be a positive, finite number of seconds, got {value!r}"
        )
    return float(value)


class OpenEnvEnvironment(TextEnvironment):
    """A TextEnvironment served by an OpenEnv server at `base_url` (http://host:port or ws://host:port).

    reset(**row) sends `reset_arguments(row)` (the row itself by default; the server passes on the keys its
    Environment.reset accepts) and returns `observation_text(observation)`. step(action) sends
    `action_from_text(action)` and returns that observation's text with the server's reward (None counts as
    0.0) and done. `client_class` is the environment's own openenv-core EnvClient subclass when it has one
    (its observations are then its Observation class); the default GenericEnvClient sends dicts or pydantic
    Actions and gives observations as dicts. `timeout` bounds each answer and `connect_timeout` the connection."""

    def __init__(
        self,
        base_url: str,
        *,
        action_from_text: Callable[[str], Any] | None = None,
        observation_text: Callable[[Any], str] | None = None,
        reset_arguments: Callable[[dict[str, Any]], Mapping[str, Any]] | None = None,
        client_class: type[Any] | None = None,
        timeout: float = 60.0,
        connect_timeout: float = 10.0,
    ) -> None:
        if not isinstance(base_url, str) or not base_url.strip():
            raise ConfigError(
                f"OpenEnvEnvironment needs the server's base URL as a string (http://127.0.0.1:8000), got {base_url!r}"
            )
        self.timeout = _positive(timeout, "timeout")
        self.connect_timeout = _positive(connect_timeout, "connect_timeout")
        generic_client, to_ws_url = _openenv_client()
        if client_class is not None and client_class is not generic_client and action_from_text is None:
            raise ConfigError(
                f"OpenEnvEnvironment: client_class={client_class.__qualname__} takes that environment's own Action "
                f"type; pass action_from_text=lambda text: ItsAction(...) building one from the model's turn"
            )
        self.base_url = base_url
        self.ws_url = f"{to_ws_url(base_url)}/ws"
        self.action_from_text = action_from_text or message_action
        self.observation_text = observation_text or _default_observation_text
        self.reset_arguments = reset_arguments or dict
        self._client_class = _checked(client_class or generic_client)
        self._client: Any = None
        self._in_episode = False
        self._timed_out_at = (
            -math.inf
        )  # when a call last timed out (time.monotonic): its session may still be held
        self._loop: asyncio.AbstractEventLoop | None = _LOOP.acquire()
        try:
            self._connect()
        except BaseException:
            self.close()
            raise

    # -- the protocol ------------------------------------------------------------------------------------------

    def reset(self, **row: Any) -> str:
        """Returns the text of the server's first observation of a new episode."""
        arguments = dict(self.reset_arguments(dict(row)))
        _check_json(arguments)
        if self._client is None:  # a failed call dropped the session: start a fresh one
            self._connect()
        result = self._call("reset", lambda: self._client.reset(**arguments))
        self._in_episode = True
        return self._text(result.observation)

    def step(self, action: str) -> EnvStep:
        """Returns the text of the server's answer to `action`, with its reward and done flag."""
        if not self._in_episode or self._client is None:
            raise RuntimeError(
                f"OpenEnvEnvironment({self.base_url}).step() with no episode under way (never reset, the episode "
                f"ended, or the last call failed and dropped the session); call reset() first"
            )
        payload = self.action_from_text(action)
        result = self._call("step", lambda: self._client.step(payload))
        done = bool(result.done)
        if done:
            self._in_episode = False
        return env_step((self._text(result.observation), result.reward, done), env_label=self._label())

    def close(self) -> None:
        """Closes the session (the server frees its environment) and releases the shared event loop."""
        self._in_episode = False
        self._disconnect()
        if self._loop is not None:
            self._loop = None
            _LOOP.release()

    # -- internals ---------------------------------------------------------------------------------------------

    def _label(self) -> str:
        """Returns how errors name this environment."""
        return f"OpenEnvEnvironment({self.base_url})"

    def _text(self, observation: Any) -> str:
        """Returns observation_text(observation), checked to be a str."""
        text = self.observation_text(observation)
        if not isinstance(text, str):
            raise EnvironmentProtocolError(
                f"{self._label()}: observation_text returned {type(text).__name__} {text!r:.120}; it must return the "
                f"observation's text as a str"
            )
        return text

    def _run(self, make: Callable[[], Coroutine[Any, Any, T]], seconds: float) -> T:
        """Returns the result of the coroutine `make()` run on the shared loop within `seconds`."""
        if self._loop is None:
            raise RuntimeError(f"{self._label()} is closed")

        async def bounded() -> T:
            return await asyncio.wait_for(make(), seconds)

        future = asyncio.run_coroutine_threadsafe(bounded(), self._loop)
        try:
            return future.result(timeout=seconds + _BACKSTOP_S)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise

    def _connect(self) -> None:
        """Opens a new session; EnvironmentServerError naming the URL when the server does not take it."""
        client = self._client_class(
            base_url=self.base_url, connect_timeout_s=self.connect_timeout, message_timeout_s=self.timeout
        )
        # openenv-core's client reports every failure to connect as a ConnectionError; ours is its deadline
        try:
            self._run(client.connect, self.connect_timeout)
        except Exception as exc:
            raise EnvironmentServerError(
                f"cannot reach an OpenEnv server at {self.ws_url} ({type(exc).__name__}: {first_line(exc)}); start "
                f"the environment's server first (for example `uvicorn my_env.server:app --host 127.0.0.1 --port "
                f"8000`) and pass its address as base_url"
            ) from exc
        self._client = client

    def _disconnect(self) -> None:
        """Closes the current session, best effort and bounded (the server drops it with the connection anyway)."""
        client, self._client = self._client, None
        if client is None or self._loop is None:
            return
        try:
            self._run(client.close, self.connect_timeout)
        except Exception:  # the connection is gone or the server does not answer: nothing more to close
            pass

    def _call(self, what: str, make: Callable[[], Coroutine[Any, Any, T]]) -> T:
        """Returns the client's answer to `what`; any failure drops the session and raises EnvironmentServerError."""
        try:
            return self._run(make, self.connect_timeout + self.timeout)
        except Exception as exc:
            self._in_episode = False
            words = self._last_words() if _closed(exc) else None
            self._disconnect()
            raise self._server_error(what, exc, words) from exc

    def _last_words(self) -> str | None:
        """Returns the error the server sent before it closed the session, or None (bounded, best effort)."""
        client = self._client
        try:
            return self._run(lambda: _last_words(client), 1.0)
        except Exception:
            return None

    def _server_error(self, what: str, exc: Exception, words: str | None = None) -> EnvironmentServerError:
        """Returns the error for a failed reset or step: what happened at which URL, and the fix."""
        cause = words or f"{type(exc).__name__}: {first_line(exc)}"
        if isinstance(exc, (asyncio.TimeoutError, concurrent.futures.TimeoutError)):
            self._timed_out_at = time.monotonic()
            return EnvironmentServerError(
                f"the OpenEnv server at {self.ws_url} did not answer {what} within {self.timeout:g} s; check that it "
                f"is running and not overloaded, or raise OpenEnvEnvironment's timeout"
            )
        since = time.monotonic() - self._timed_out_at
        if "CAPACITY_REACHED" in cause and since < 2 * self.timeout + self.connect_timeout:
            return EnvironmentServerError(
                f"the OpenEnv server at {self.ws_url} refused a session ({cause}) {since:.1f} s after a call of this "
                "environment timed out: the server is likely still running that call, which holds its session until "
                "it ends; reset() again once it has (or raise OpenEnvEnvironment's timeout above the environment's "
                "slowest step)"
            )
        if "CAPACITY_REACHED" in cause:
            return EnvironmentServerError(
                f"the OpenEnv server at {self.ws_url} refused a session ({cause}): it serves fewer concurrent sessions "
                f"than rollouts run at once; start it with create_app(..., max_concurrent_envs=N) for N at least the "
                f"number of rollouts (its Environment must set SUPPORTS_CONCURRENT_SESSIONS = True), and close() "
                f"environments that are done"
            )
        if words is not None or (isinstance(exc, RuntimeError) and str(exc).startswith("Server error")):
            return EnvironmentServerError(
                f"the OpenEnv server at {self.ws_url} failed on {what} ({cause}); see the server's log, and check that "
                f"action_from_text builds the Action its environment takes"
            )
        if _closed(exc):
            return EnvironmentServerError(
                f"the OpenEnv server at {self.ws_url} closed the session during {what} ({cause}); it may have stopped "
                f"or restarted: check the server's log (the next reset() opens a new session)"
            )
        return EnvironmentServerError(
            f"the server at {self.ws_url} answered {what} with something that is not OpenEnv's protocol ({cause}); "
            f"check that base_url is an OpenEnv environment server (openenv-core's create_app) of a compatible version"
        )


def _closed(exc: BaseException) -> bool:
    """Returns whether `exc` is websockets' ConnectionClosed (read by name: websockets is openenv-core's, imported lazily)."""
    return any(cls.__name__ == "ConnectionClosed" for cls in type(exc).__mro__)


async def _last_words(client: Any) -> str | None:
    """Returns the error message a server sent just before closing a session (how a full OpenEnv server refuses
    one), still buffered in the client's connection after a send failed; None when there is none."""
    connection = getattr(client, "_ws", None)  # openenv-core's EnvClient keeps its websocket there
    if connection is None:
        return None
    try:
        answer = json.loads(await asyncio.wait_for(connection.recv(), 0.5))
    except Exception:
        return None
    data = answer.get("data") if isinstance(answer, dict) and answer.get("type") == "error" else None
    if not isinstance(data, dict):
        return None
    return f"{data.get('message', 'no message')} (code: {data.get('code', 'UNKNOWN')})"


def _default_observation_text(observation: Any) -> str:
    """Returns observation_text(observation) (OpenEnvEnvironment.__init__'s parameter of that name hides the function)."""
    return observation_text(observation)


def _check_json(arguments: Mapping[str, Any]) -> None:
    """Raises EnvironmentProtocolError naming the first reset argument that cannot be sent as JSON."""
    for key, value in arguments.items():
        try:
            json.dumps(value)
        except (TypeError, ValueError) as exc:
            raise EnvironmentProtocolError(
                f"OpenEnvEnvironment.reset: the row's {key!r} ({type(value).__name__}) cannot be sent to the server as "
                f"JSON ({first_line(exc)}); pass reset_arguments=lambda row: {{...}} with the JSON values its reset "
                f"takes"
            ) from exc
