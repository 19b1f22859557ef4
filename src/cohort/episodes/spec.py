"""What a multi-turn run rolls out, settled before any model loads: its tools, its environment factories and the
rewards environments own.

`build_episode_spec` reads `episodes.*` of the config and TRL's `tools=` / `environment_factory=` keywords,
imports and checks every tool (schema from type hints and docstring) and every factory (called once: one
that raises or makes an object without `reset` is refused here), and keeps one instance of each environment
to read its tools and whether it owns a reward.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from cohort.choices import is_function_spec
from cohort.config import EpisodeConfig
from cohort.episodes.catalog import builtin_tool
from cohort.episodes.environments import check_environment_factory, is_text_environment
from cohort.episodes.tools import Tool, ToolSet, environment_tools, make_tool
from cohort.errors import ConfigError
from cohort.rewards.scoring import StepRewards
from cohort.runtime.plugins import load_function

ROUTING_COLUMN = "environment"
"""The dataset column naming each row's environment when several factories are given (TRL's)."""


@dataclass
class EnvironmentSpec:
    """One environment factory: its kind, its tools (methods of a TRL-style environment) and a first instance."""

    name: str | None
    """Its routing name (None for the one factory of a run)."""
    factory: Callable[[], Any]
    kind: Literal["tools", "text"]
    """tools: TRL's contract (reset, public methods as tools, optional get_reward); text: a TextEnvironment."""
    cls: type
    tools: ToolSet
    """The first instance's tools (bound to it); `tools_of` binds them to another instance."""
    first: Any
    """The instance built at start-up (the first of its pool)."""

    @property
    def owns_reward(self) -> bool:
        """Returns whether the environment scores its episodes (get_reward, or a TextEnvironment's step rewards)."""
        return self.kind == "text" or callable(getattr(self.first, "get_reward", None))

    def tools_of(self, instance: Any) -> dict[str, Tool]:
        """Returns this environment's tools bound to `instance`."""
        return {
            name: dataclasses.replace(tool, callable=getattr(instance, name))
            for name, tool in self.tools.items()
        }


@dataclass
class EpisodeSpec:
    """A multi-turn run's tools, environments and settings."""

    tools: ToolSet
    """Tools every rollout may call (TRL's `tools=` and episodes.tools)."""
    environments: dict[str | None, EnvironmentSpec] = field(default_factory=dict)
    routed: bool = False
    """Several factories: each row names its environment in the `environment` column."""
    max_iterations: int | None = None
    timeout: float = 30.0
    max_chars: int | None = None
    result_format: str = "str"
    tool_parser: str | None = None
    turn_rewards: bool = False

    def environment_for(self, row: Mapping[str, Any]) -> EnvironmentSpec | None:
        """Returns the environment a row's rollouts run in (None when the run has none)."""
        if not self.environments:
            return None
        if not self.routed:
            return self.environments[None]
        name = row.get(ROUTING_COLUMN)
        if name not in self.environments:
            raise ConfigError(
                f"a row names environment {name!r}, which is not among the environments given "
                f"({sorted(str(k) for k in self.environments)}); fix the row's `{ROUTING_COLUMN}` column"
            )
        return self.environments[name]

    def schemas(self, env: EnvironmentSpec | None) -> list[dict[str, Any]]:
        """Returns the tool schemas a rollout in `env` renders: the run's tools, then the environment's."""
        own = list(env.tools.values()) if env is not None else []
        return [tool.schema for tool in [*self.tools.values(), *own]]

    def all_schemas(self) -> list[dict[str, Any]]:
        """Returns the schemas of every tool of the run (for parsers that type arguments)."""
        seen: dict[str, dict[str, Any]] = {t.name: t.schema for t in self.tools.values()}
        for env in self.environments.values():
            seen.update({t.name: t.schema for t in env.tools.values()})
        return list(seen.values())

    def reward_functions(self) -> list[Callable[..., Any]]:
        """Returns one reward function per environment class that owns its reward, named after the class (TRL's
        `get_reward` column, weight 1; rollouts of another class score None)."""
        funcs: list[Callable[..., Any]] = []
        seen: set[type] = set()
        for env in self.environments.values():
            if env.cls in seen or not env.owns_reward:
                continue
            seen.add(env.cls)
            if env.kind == "text":
                funcs.append(_turn_reward(env.cls, self.turn_rewards))
            else:
                funcs.append(_get_reward(env.cls, inspect.iscoroutinefunction(env.first.get_reward)))
        return funcs

    def close(self) -> None:
        """Closes the start-up instances that define close()."""
        for env in self.environments.values():
            close = getattr(env.first, "close", None)
            if callable(close):
                close()


def check_routing(spec: EpisodeSpec, rows: list[dict], where: str) -> None:
    """Raises ConfigError naming the first row without a known `environment` when several factories route rows."""
    for i, row in enumerate(rows):
        name = row.get(ROUTING_COLUMN)
        if name not in spec.environments:
            what = "has no" if ROUTING_COLUMN not in row else f"names {name!r} in its"
            raise ConfigError(
                f"{where}: row {i} {what} `{ROUTING_COLUMN}` column, which routes each row to one of the "
                f"environments {sorted(str(k) for k in spec.environments)}; add the column to every row"
            )


def _get_reward(cls: Any, is_async: bool) -> Callable[..., Any]:
    """Returns the reward function that asks each rollout's environment of class `cls` for its reward."""

    async def gather(environments: list[Any], **kwargs: Any) -> list[Any]:
        return [await e.get_reward() if type(e) is cls else None for e in environments]

    def call(environments: list[Any], **kwargs: Any) -> list[Any]:
        return [e.get_reward() if type(e) is cls else None for e in environments]

    reward: Callable[..., Any] = gather if is_async else call
    reward.__name__ = reward.__qualname__ = cls.__name__
    return reward


def _turn_reward(cls: type, per_turn: bool) -> Callable[..., Any]:
    """Returns the reward function of a TextEnvironment class: the sum of an episode's turn rewards, or, with
    `per_turn`, the turn rewards as process-reward steps ending at each turn's last token."""

    def reward(episodes, **kwargs):
        out: list[Any] = []
        for episode in episodes:
            if type(episode.environment) is not cls:
                out.append(None)
            elif per_turn and episode.turn_rewards:
                ends = episode.turn_ends[: len(episode.turn_rewards)]
                out.append(StepRewards(rewards=list(episode.turn_rewards[: len(ends)]), ends=ends))
            else:
                out.append(float(sum(episode.turn_rewards)))
        return out

    reward.__name__ = reward.__qualname__ = cls.__name__
    return reward


def _tool_from_spec(spec: str) -> Callable[..., Any]:
    """Returns the function an episodes.tools entry names (a built-in name or 'module:function')."""
    if is_function_spec(spec):
        try:
            return load_function(spec, "episodes.tools")
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
    return builtin_tool(spec)


def _factory_from_spec(spec: str, label: str) -> Callable[[], Any]:
    """Returns the factory an episodes.environment(s) entry names ('module:Factory')."""
    if not is_function_spec(spec):
        raise ConfigError(f"{label}={spec!r} must name a factory as 'module:Factory' or 'file.py:Factory'")
    try:
        return load_function(spec, label)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc


def _environment(name: str | None, factory: Any) -> EnvironmentSpec:
    """Returns the spec of one factory, refused with a clear error when it cannot make a usable environment."""
    check_environment_factory(factory)
    first = factory()
    if is_text_environment(first):
        return EnvironmentSpec(name, factory, "text", type(first), ToolSet(), first)
    return EnvironmentSpec(name, factory, "tools", type(first), environment_tools(first), first)


def build_episode_spec(
    cfg: EpisodeConfig, *, tools: Any = None, environment_factory: Any = None
) -> EpisodeSpec | None:
    """Returns the run's EpisodeSpec (None for single-completion runs), every tool and factory checked."""
    functions = [_tool_from_spec(t) for t in cfg.tools]
    if tools is not None:
        if callable(tools) or isinstance(tools, (str, bytes, Mapping)):
            raise ConfigError(
                f"tools must be a list of functions, got {type(tools).__name__}; pass tools=[multiply, search]"
            )
        functions += list(tools)
    factories: dict[str | None, Any] = {}
    if environment_factory is not None:
        if cfg.environment or cfg.environments:
            raise ConfigError(
                "environment_factory= and episodes.environment(s) are both given; pass the factory one way"
            )
        if isinstance(environment_factory, Mapping):
            if not environment_factory:
                raise ConfigError("environment_factory is an empty dict; give at least one name -> factory")
            factories = {str(k): v for k, v in environment_factory.items()}
        else:
            factories = {None: environment_factory}
    elif cfg.environment:
        factories = {None: _factory_from_spec(cfg.environment, "episodes.environment")}
    else:
        factories = {
            k: _factory_from_spec(v, f"episodes.environments.{k}") for k, v in cfg.environments.items()
        }
    if not functions and not factories:
        return None
    standalone = ToolSet(make_tool(f) for f in functions)
    environments = {name: _environment(name, factory) for name, factory in factories.items()}
    for env in environments.values():
        clash = sorted(set(env.tools) & set(standalone))
        if clash:
            raise ConfigError(
                f"environment {env.cls.__qualname__} has tool method(s) {clash} with the same name as tools given "
                "in tools= / episodes.tools; rename one of them (a model cannot tell two tools of one name apart)"
            )
    return EpisodeSpec(
        tools=standalone,
        environments=environments,
        routed=bool(environments) and None not in environments,
        max_iterations=cfg.max_tool_calling_iterations,
        timeout=float(cfg.tool_timeout),
        max_chars=cfg.max_tool_result_chars,
        result_format=cfg.result_format,
        tool_parser=cfg.tool_parser,
        turn_rewards=cfg.turn_rewards,
    )
