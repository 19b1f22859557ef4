"""cohort.episodes.tools: TRL's tools=[fn, async_fn] and environment_factory contracts, schemas from transformers'
get_json_schema, and a clear ConfigError for every function that cannot be a tool."""

from __future__ import annotations

from typing import Literal

import pytest
from transformers.utils import get_json_schema

from cohort.episodes import Tool, ToolSet, environment_tools, make_tool, tool_set
from cohort.errors import ConfigError


def multiply(a: int, b: int) -> int:
    """Multiplies two integers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return a * b


async def search(query: str, limit: int = 3, mode: Literal["web", "news"] = "web") -> list[str]:
    """Searches the web.

    Args:
        query: What to look for.
        limit: How many results to return.
        mode: Where to search.
    """
    return [query] * limit


def test_functions_and_async_functions_become_tools_with_transformers_schemas():
    tools = tool_set([multiply, search])
    assert isinstance(tools, ToolSet)
    assert list(tools) == ["multiply", "search"] and len(tools) == 2
    assert tools["multiply"].schema == get_json_schema(multiply)  # the very schema chat templates render
    assert tools["search"].schema == get_json_schema(search)
    assert tools.schemas == [get_json_schema(multiply), get_json_schema(search)]
    assert tools.functions == [multiply, search]
    assert not tools["multiply"].is_async and tools["search"].is_async
    assert tools["multiply"].callable is multiply
    parameters = tools["search"].parameters
    assert parameters["required"] == ["query"]
    assert parameters["properties"]["mode"]["enum"] == ["web", "news"]
    assert tools["multiply"].schema["function"]["description"] == "Multiplies two integers."


def test_tool_records_and_empty_sets():
    tool = make_tool(multiply)
    assert isinstance(tool, Tool) and make_tool(tool) is tool
    assert list(tool_set([tool, search])) == ["multiply", "search"]
    assert len(tool_set(None)) == 0 and len(tool_set([])) == 0
    assert "multiply" in repr(tool_set([multiply]))


def no_hints(a, b):
    """Adds.

    Args:
        a: One.
        b: Two.
    """
    return a + b


def no_docstring(a: int) -> int:
    return a


def undocumented_argument(a: int, b: int) -> int:
    """Adds, but documents only a.

    Args:
        a: One.
    """
    return a + b


def star_args(*values: int) -> int:
    """Sums.

    Args:
        values: The values.
    """
    return sum(values)


def star_kwargs(a: int, **options: str) -> int:
    """Takes options.

    Args:
        a: One.
        options: More.
    """
    return a


def positional_only(a: int, /) -> int:
    """Returns a.

    Args:
        a: One.
    """
    return a


class Callable_:
    """A callable object."""

    def __call__(self, a: int) -> int:
        return a


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (no_hints, r"tool no_hints .*missing a type hint.*Give every argument a type hint"),
        (no_docstring, r"tool no_docstring .*has no docstring.*Google-style docstring.*Args:"),
        (
            undocumented_argument,
            r"tool undocumented_argument .*no description for the argument 'b'.*'Args:' line",
        ),
        (star_args, r"tool star_args: parameter \*values .*list each argument"),
        (star_kwargs, r"tool star_kwargs: parameter \*\*options"),
        (positional_only, r"tool positional_only: parameter 'a' is positional-only.*remove the '/'"),
        (lambda a: a, r"is a lambda.*define it with def"),
        (Callable_(), r"is a Callable_, not a function or method.*wrap it in a def"),
        (42, r"tools must be functions, got int 42"),
        ("multiply", r"tools must be functions, got str"),
    ],
    ids=[
        "no-hints",
        "no-docstring",
        "undocumented",
        "star-args",
        "star-kwargs",
        "positional-only",
        "lambda",
        "callable-object",
        "int",
        "name",
    ],
)
def test_a_function_that_cannot_be_a_tool_is_a_clear_error(bad, message):
    with pytest.raises(ConfigError, match=message):
        tool_set([multiply, bad])


def test_the_original_transformers_exception_is_kept_as_the_cause():
    with pytest.raises(ConfigError) as caught:
        make_tool(no_docstring)
    assert type(caught.value.__cause__).__name__ == "DocstringParsingException"


def test_duplicate_names_are_refused_naming_both():
    def other_module_multiply(a: int, b: int) -> int:
        """Multiplies too.

        Args:
            a: One.
            b: Two.
        """
        return a * b

    other_module_multiply.__name__ = "multiply"
    with pytest.raises(
        ConfigError, match=r"two tools are named 'multiply' \(multiply and .*other_module_multiply\).*rename"
    ):
        tool_set([multiply, other_module_multiply])


@pytest.mark.parametrize("bad", [multiply, "multiply", {"multiply": multiply}])
def test_tools_must_be_a_list(bad):
    with pytest.raises(ConfigError, match="tools must be a list of functions"):
        tool_set(bad)


class Calculator:
    """A TRL-style environment: reset, get_reward, and its public methods as tools."""

    def __init__(self) -> None:
        self.total = 0

    def reset(self, **row) -> str | None:
        self.total = 0
        return None

    def get_reward(self) -> float:
        return float(self.total)

    def add(self, value: int) -> int:
        """Adds to the running total.

        Args:
            value: The amount to add.
        """
        self.total += value
        return self.total

    async def lookup(self, key: str) -> str:
        """Looks a constant up.

        Args:
            key: The constant's name.
        """
        return key

    @staticmethod
    def describe(topic: str) -> str:
        """Describes a topic.

        Args:
            topic: The topic.
        """
        return topic

    @property
    def exploding(self) -> int:
        raise AssertionError("a property is never evaluated while listing tools")

    def _helper(self) -> None:
        raise AssertionError("private")

    def __len__(self) -> int:
        return 0


def test_an_environments_public_methods_are_its_tools_bound_to_the_instance():
    env = Calculator()
    tools = environment_tools(env)
    assert list(tools) == ["add", "describe", "lookup"]  # name order, as TRL lists them
    assert tools["lookup"].is_async and not tools["add"].is_async
    tools["add"].callable(value=5)
    assert env.total == 5  # bound to this instance
    assert "self" not in tools["add"].parameters["properties"]


def test_an_environment_without_reset_or_with_a_bad_method():
    class NoReset:
        def add(self, value: int) -> int:
            """Adds.

            Args:
                value: The amount.
            """
            return value

    with pytest.raises(ConfigError, match=r"environment .*NoReset has no reset method.*reset\(\*\*row\)"):
        environment_tools(NoReset())

    class Undocumented(Calculator):
        def step(self, action: str) -> str:
            return action

    with pytest.raises(
        ConfigError, match=r"environment .*Undocumented: tool .*Undocumented.step .*has no docstring"
    ):
        environment_tools(Undocumented())
