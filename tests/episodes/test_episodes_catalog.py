"""cohort.episodes.catalog: the built-in tools by name, described by transformers' get_json_schema, and the
multiply tool's errors as the model sees them through the executor."""

from __future__ import annotations

import pytest

from cohort.episodes import ToolCall, execute, make_tool, tool_set
from cohort.episodes.catalog import BUILTIN_TOOLS, MAX_FACTOR, builtin_tool, multiply
from cohort.errors import ConfigError
from cohort.sandbox import tool as sandbox_tool


def test_multiply_is_exact_on_large_and_negative_numbers():
    assert multiply(4821, 37) == 178377
    assert multiply(-12, 11) == -132
    assert multiply(MAX_FACTOR - 1, MAX_FACTOR - 1) == (MAX_FACTOR - 1) ** 2  # Python ints: no overflow


def test_multiply_schema_comes_from_its_type_hints_and_docstring():
    schema = make_tool(multiply).schema["function"]
    assert schema["name"] == "multiply"
    assert schema["description"]
    assert schema["parameters"]["required"] == ["a", "b"]
    assert {k: v["type"] for k, v in schema["parameters"]["properties"].items()} == {
        "a": "integer",
        "b": "integer",
    }
    assert all(v["description"] for v in schema["parameters"]["properties"].values())


@pytest.mark.parametrize(
    "a, b, needle",
    [
        (1.5, 2, "a=1.5 is a float"),
        (3, "12", "b='12' is a str"),
        (True, 2, "a=True is a bool"),  # bool is an int subclass, but not a number the model wrote
        (None, 2, "a=None is a NoneType"),
        (MAX_FACTOR, 2, "a has 13 digits"),
        (2, -(10**20), "b has 21 digits"),
    ],
)
def test_multiply_rejects_what_is_not_a_factor(a, b, needle):
    with pytest.raises(ValueError, match=r"^multiply takes") as info:
        multiply(a, b)
    assert needle in str(info.value)


def test_a_bad_call_returns_the_error_text_to_the_model():
    tools = tool_set([multiply])
    calls = [
        ToolCall(name="multiply", arguments={"a": 4821, "b": 37}, raw=""),
        ToolCall(name="multiply", arguments={"a": 10**15, "b": 2}, raw=""),
    ]
    good, bad = execute(calls, tools, timeout=5.0)
    assert (good.content, good.failed) == ("178377", False)
    assert bad.failed and "at most 12 digits" in bad.content


def test_builtin_tools_by_name():
    assert sorted(BUILTIN_TOOLS) == ["multiply", "python"]
    assert builtin_tool("multiply") is multiply
    assert builtin_tool("python") is sandbox_tool.python  # the sandbox's own function, no wrapper
    names = [make_tool(builtin_tool(name)).name for name in BUILTIN_TOOLS]
    assert names == list(BUILTIN_TOOLS)  # the name a model calls is the catalogue's key


@pytest.mark.parametrize("name", ["multiplication", "", ["multiply"]])
def test_an_unknown_builtin_tool_lists_the_names(name):
    with pytest.raises(ConfigError, match=r"unknown built-in tool .*\['multiply', 'python'\]"):
        builtin_tool(name)
