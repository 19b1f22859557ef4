"""Tools a policy can call during an episode: plain and async functions, or an environment's public methods.

Each tool's JSON schema comes from transformers' own `get_json_schema` (type hints and a Google-style
docstring), the helper `apply_chat_template(tools=[fn])` calls itself, so the schema cohort renders into
a prompt is the one TRL's `GRPOTrainer(tools=[fn])` renders. Everything that makes a function unusable as
a tool is a `ConfigError` raised here, before any model loads, naming the tool and the fix.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from transformers.utils import get_json_schema
from transformers.utils.chat_template_utils import DocstringParsingException, TypeHintParsingException

from cohort.errors import ConfigError

ENVIRONMENT_RESERVED = ("reset", "get_reward")
"""Public methods of a TRL-style environment that are part of its contract, never tools."""

_DOCSTRING_EXAMPLE = '''    def multiply(a: int, b: int) -> int:
        """Multiplies two integers.

        Args:
            a: The first factor.
            b: The second factor.
        """'''


@dataclass(frozen=True)
class Tool:
    """One tool: its name, its JSON schema as chat templates take it, the function, and whether it is async."""

    name: str
    schema: dict[str, Any]
    """`{"type": "function", "function": {"name", "description", "parameters", ...}}` from get_json_schema."""
    callable: Callable[..., Any]
    is_async: bool

    @property
    def parameters(self) -> dict[str, Any]:
        """Returns the JSON schema of the tool's arguments (`{"type": "object", "properties": ..., "required": ...}`)."""
        return self.schema["function"]["parameters"]


class ToolSet(Mapping[str, Tool]):
    """The tools of an episode by name, in the order they were given (the order their schemas are rendered)."""

    def __init__(self, tools: Iterable[Tool] = ()) -> None:
        self._tools: dict[str, Tool] = {}
        for tool in tools:
            if tool.name in self._tools:
                raise ConfigError(_duplicate_message(self._tools[tool.name], tool))
            self._tools[tool.name] = tool

    def __getitem__(self, name: str) -> Tool:
        return self._tools[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tools)

    def __len__(self) -> int:
        return len(self._tools)

    def __repr__(self) -> str:
        return f"ToolSet({list(self._tools)})"

    @property
    def schemas(self) -> list[dict[str, Any]]:
        """Returns every tool's JSON schema, the list `apply_chat_template(tools=...)` takes."""
        return [tool.schema for tool in self._tools.values()]

    @property
    def functions(self) -> list[Callable[..., Any]]:
        """Returns every tool's function, in order."""
        return [tool.callable for tool in self._tools.values()]


def _label(function: Any) -> str:
    """Returns how an error names a tool: `Class.method` for a method, the function's name otherwise."""
    qualname = getattr(function, "__qualname__", None) or getattr(function, "__name__", None)
    return str(qualname) if qualname else repr(function)


def _duplicate_message(first: Tool, second: Tool) -> str:
    """Returns the error for two tools under one name."""
    return (
        f"two tools are named {first.name!r} ({_label(first.callable)} and {_label(second.callable)}): the model "
        f"calls a tool by its name, so every name must be unique; rename one of the functions (a tool's name is "
        f"its function's __name__)"
    )


def _check_signature(function: Callable[..., Any], label: str) -> None:
    """Raises ConfigError when a model could not call `function` with named JSON arguments."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError) as exc:
        raise ConfigError(
            f"tool {label}: its signature cannot be read ({exc}); wrap it in a plain def"
        ) from exc
    for parameter in signature.parameters.values():
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            star = "*" if parameter.kind is parameter.VAR_POSITIONAL else "**"
            raise ConfigError(
                f"tool {label}: parameter {star}{parameter.name} cannot be described by a JSON schema (a model passes "
                f"named arguments only); list each argument explicitly with a type hint"
            )
        if parameter.kind is parameter.POSITIONAL_ONLY:
            raise ConfigError(
                f"tool {label}: parameter {parameter.name!r} is positional-only, but a model passes arguments by "
                f"name; remove the '/' from the signature"
            )


def make_tool(function: Callable[..., Any] | Tool) -> Tool:
    """Returns the Tool for a plain or async function or a bound method, its schema from transformers' get_json_schema."""
    if isinstance(function, Tool):
        return function
    if not callable(function):
        raise ConfigError(
            f"tools must be functions, got {type(function).__name__} {function!r}; pass the function itself "
            f"(tools=[multiply], not tools=[multiply()] or a name)"
        )
    label = _label(function)
    if not (inspect.isfunction(function) or inspect.ismethod(function)):
        raise ConfigError(
            f"tool {label} is a {type(function).__name__}, not a function or method: its schema is read from a "
            f"function's type hints and docstring; wrap it in a def with typed, documented arguments"
        )
    if function.__name__ == "<lambda>":
        raise ConfigError(
            f"tool {label} is a lambda: a tool is called by its name; define it with def, type hints and a "
            f"docstring, for example\n{_DOCSTRING_EXAMPLE}"
        )
    _check_signature(function, label)
    try:
        schema = get_json_schema(function)
    except TypeHintParsingException as exc:
        raise ConfigError(
            f"tool {label} cannot be described to the model: {exc}. Give every argument a type hint (int, float, "
            f"str, bool, list[...], dict[...], Literal[...], Optional[...]), for example\n{_DOCSTRING_EXAMPLE}"
        ) from exc
    except DocstringParsingException as exc:
        raise ConfigError(
            f"tool {label} cannot be described to the model: {exc}. A tool needs a Google-style docstring with a "
            f"description and an 'Args:' line for every argument, for example\n{_DOCSTRING_EXAMPLE}"
        ) from exc
    is_async = inspect.iscoroutinefunction(function)
    return Tool(name=schema["function"]["name"], schema=schema, callable=function, is_async=is_async)


def tool_set(functions: Iterable[Callable[..., Any] | Tool] | None) -> ToolSet:
    """Returns the ToolSet of TRL's `tools=[fn, async_fn, ...]`: one Tool per function, names unique."""
    if functions is None:
        return ToolSet()
    if callable(functions) or isinstance(functions, (str, bytes, Mapping)):
        raise ConfigError(
            f"tools must be a list of functions, got {type(functions).__name__}; pass tools=[multiply, search]"
        )
    return ToolSet(make_tool(function) for function in functions)


def environment_tools(environment: Any) -> ToolSet:
    """Returns the tools of a TRL-style environment: its public methods except reset and get_reward.

    As TRL's `environment_factory` contract: the methods are listed on the class (so properties are not
    evaluated), in name order, and bound to `environment`; names starting with "_" are private.
    """
    cls = type(environment)
    if not callable(getattr(environment, "reset", None)):
        raise ConfigError(
            f"environment {cls.__qualname__} has no reset method: an environment_factory must return an object "
            f"with reset(**row) -> str | None (called before each rollout; a string it returns is appended to the "
            f"prompt) and its tools as public methods"
        )
    methods = [
        getattr(environment, name)
        for name, _ in inspect.getmembers(cls, predicate=inspect.isfunction)
        if not name.startswith("_") and name not in ENVIRONMENT_RESERVED
    ]
    try:
        return tool_set(methods)
    except ConfigError as exc:
        raise ConfigError(f"environment {cls.__qualname__}: {exc}") from exc
