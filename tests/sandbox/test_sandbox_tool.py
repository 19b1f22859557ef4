"""The `python` tool: its reply (output, cuts said in words, how the program ended), its schema, sessions."""

from __future__ import annotations

import shutil
import types

import pytest

from cohort.sandbox import ExecResult, Limits, Sandbox
from cohort.sandbox.tool import PythonSession, format_result, python

needs_bwrap = pytest.mark.skipif(
    shutil.which("bwrap") is None, reason="bubblewrap is not installed (CI installs it)"
)


def _result(status="ok", stdout="", stderr="", returncode=0, seconds=0.1):
    return ExecResult(status, returncode, stdout, stderr, seconds)


def test_the_reply_lists_output_then_errors_then_the_ending():
    assert format_result(_result(stdout="42")) == "42\n"
    assert format_result(_result()) == "[no output]\n"
    reply = format_result(_result("error", "a\n", "Traceback ...\nValueError: x\n", 1))
    assert reply == "a\nstderr:\nTraceback ...\nValueError: x\n[exit status 1]\n"
    assert format_result(_result("timeout", returncode=-9, seconds=10.0)).endswith(
        "[timed out after 10.0 s: the program was stopped]\n"
    )
    assert format_result(_result("killed", returncode=-11)) == "[killed by signal 11]\n"
    assert "[ran out of memory]" in format_result(_result("memory", returncode=1))


def test_long_output_is_cut_and_the_cut_is_said():
    reply = format_result(_result(stdout="x" * 50, stderr="e" * 30), max_chars=40)
    assert reply.startswith("x" * 40 + "\n[stdout truncated: 10 more characters not shown]\n")
    assert reply.endswith("[stderr truncated: 30 more characters not shown]\n")
    assert "output truncated" in format_result(_result("output_limit", stdout="y", returncode=-9))


def test_the_tool_has_the_schema_trl_reads():
    from transformers.utils import get_json_schema

    schema = get_json_schema(python)["function"]
    assert schema["name"] == "python"
    assert schema["parameters"]["properties"]["code"]["type"] == "string"
    assert schema["parameters"]["required"] == ["code"]
    assert "do not persist" in schema["description"]
    # A session's bound method is what a user passes (tools=[session.python]); bound here without starting one.
    session_schema = get_json_schema(types.MethodType(PythonSession.python, object()))["function"]
    assert (
        session_schema["name"] == "python"
        and "persist from one call to the next" in session_schema["description"]
    )


@needs_bwrap
def test_each_call_is_a_fresh_interpreter():
    assert python("x = 5\nprint(x * 2)") == "10\n"
    assert "NameError" in python("print(x)")
    long = python("print('z' * 10000)")
    assert long.startswith("z" * 4000) and "[stdout truncated: 6001 more characters not shown]" in long


@needs_bwrap
def test_a_session_keeps_state_until_it_is_lost():
    box = Sandbox(limits=Limits(timeout=1.0))
    with PythonSession(box, max_chars=100) as session:
        assert session.python("import math\nr = 2") == "[no output]\n"
        assert session.python("print(round(math.pi * r * r, 2))") == "12.57\n"
        assert session.python("open('/tmp/notes', 'w').write('kept')\nprint('ok')") == "ok\n"
        assert session.python("print(open('/tmp/notes').read())") == "kept\n"
        lost = session.python("import time\ntime.sleep(3)")
        assert "timed out" in lost and "the session ended: its variables are lost" in lost
        assert "NameError" in session.python("print(r)")
