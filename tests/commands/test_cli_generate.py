"""`cohort generate` and `cohort chat` on a tiny model: JSONL rows, determinism, one-line errors, a real terminal."""

from __future__ import annotations

import ast
import json
import os
import re
import select
import subprocess
import sys
import time

import pytest

from cohort.cli import main
from cohort.commands.generate import ChatTurn, chat_loop, generate_rows, printable

SHORT = ["--max-new-tokens", "4"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """Returns a tiny model folder (its tokenizer's chat template: "User: ...\\nAssistant: ")."""
    from cohort.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("gen") / "m", hidden_size=32, num_layers=2, num_heads=4)


@pytest.fixture(scope="module")
def plain_dir(tmp_path_factory, model_dir):
    """Returns a folder holding only a tokenizer without a chat template."""
    from cohort.models import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    tokenizer.chat_template = None
    out = tmp_path_factory.mktemp("plain") / "tok"
    tokenizer.save_pretrained(out)
    assert load_tokenizer(out).chat_template is None
    return out


def _generate(capsys, *args):
    """Returns the JSONL rows `cohort generate` printed to standard output."""
    assert main(["generate", *map(str, args)]) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def test_generate_writes_one_row_per_command_line_prompt(model_dir, capsys):
    rows = _generate(capsys, "--model", model_dir, "--prompt", "1+2=", "--prompt", "hi", "--n", 3, *SHORT)
    assert [r["prompt"] for r in rows] == ["1+2=", "hi"]
    for row in rows:
        assert sorted(row) == ["completions", "finish_reasons", "prompt"]
        assert len(row["completions"]) == 3 and all(isinstance(c, str) for c in row["completions"])
        assert len(row["finish_reasons"]) == 3 and set(row["finish_reasons"]) <= {"eos", "length"}


def test_generate_reads_txt_and_jsonl_files_and_writes_out(model_dir, tmp_path, capsys):
    txt = tmp_path / "p.txt"
    txt.write_text("1+2=\n\n  \n3+4=\n", encoding="utf-8")
    out = tmp_path / "o.jsonl"
    assert (
        main(["generate", "--model", str(model_dir), "--prompts", str(txt), "--out", str(out), *SHORT]) == 0
    )
    assert "wrote 2 row(s)" in capsys.readouterr().out
    rows = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert [r["prompt"] for r in rows] == ["1+2=", "3+4="]
    assert all(len(r["completions"]) == 1 for r in rows)

    messages = [{"role": "user", "content": "hello"}]
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text(
        json.dumps({"question": "a", "answer": 1}) + "\n" + json.dumps({"question": "b", "answer": 2}) + "\n"
    )
    rows = _generate(capsys, "--model", model_dir, "--prompts", jsonl, "--prompt-column", "question", *SHORT)
    assert [r["prompt"] for r in rows] == ["a", "b"]
    chat = tmp_path / "c.json"
    chat.write_text(json.dumps([{"prompt": messages}]))
    rows = _generate(capsys, "--model", model_dir, "--prompts", chat, "--n", 2, *SHORT)
    assert rows[0]["prompt"] == messages and len(rows[0]["completions"]) == 2


def test_greedy_is_deterministic_and_a_seed_repeats_sampling(model_dir, capsys):
    greedy = ["--model", model_dir, "--prompt", "1+2=", "--prompt", "x", "--greedy", "--n", 2, *SHORT]
    first = _generate(capsys, *greedy)
    assert _generate(capsys, *greedy, "--seed", 5) == first
    assert all(len(set(r["completions"])) == 1 for r in first)  # argmax: every sample is the same
    sampled = [
        "--model",
        model_dir,
        "--prompt",
        "1+2=",
        "--n",
        4,
        "--temperature",
        1.5,
        "--top-k",
        50,
        *SHORT,
    ]
    assert _generate(capsys, *sampled, "--seed", 3) == _generate(capsys, *sampled, "--seed", 3)


def test_chat_template_on_wraps_a_plain_prompt_as_a_user_message(model_dir, capsys):
    base = ["--model", model_dir, "--greedy", *SHORT]
    wrapped = _generate(capsys, *base, "--prompt", "hi", "--chat-template", "on")
    templated = _generate(capsys, *base, "--prompt", "User: hi\nAssistant: ")
    assert wrapped[0]["completions"] == templated[0]["completions"]


def test_finish_reasons_tell_eos_from_length(model_dir):
    from cohort.models import load_model, load_tokenizer
    from cohort.rollout import SamplingParams, make_engine

    tokenizer, model = load_tokenizer(model_dir), load_model(model_dir)
    params = SamplingParams(max_completion_length=3, greedy=True)
    every_token_ends = make_engine("builtin", eos_token_ids=list(range(len(tokenizer))), pad_token_id=0)
    rows = generate_rows(model, tokenizer, ["a", "b"], params, n=2, engine=every_token_ends)
    assert [r["finish_reasons"] for r in rows] == [["eos", "eos"], ["eos", "eos"]]
    never_ends = make_engine("builtin", eos_token_ids=[len(tokenizer) + 7], pad_token_id=0)
    rows = generate_rows(model, tokenizer, ["a"], params, engine=never_ends)
    assert rows[0]["finish_reasons"] == ["length"]


def test_an_adapter_folder_works_as_the_model(model_dir, tmp_path, capsys):
    pytest.importorskip("peft")
    from cohort.config import LoraConfig
    from cohort.models import load_model

    model = load_model(model_dir, lora=LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    model.save_pretrained(tmp_path / "adapter")
    rows = _generate(capsys, "--model", tmp_path / "adapter", "--prompt", "1+2=", "--greedy", *SHORT)
    plain = _generate(capsys, "--model", model_dir, "--prompt", "1+2=", "--greedy", *SHORT)
    assert rows == plain  # a fresh LoRA adapter (B = 0) leaves the model unchanged


@pytest.mark.parametrize(
    "args, fragment",
    [
        ([], "no prompt given"),
        (["--prompt", "a", "--prompts", "p.txt"], "not both"),
        (["--prompt", ""], "empty"),
        (["--prompt", "a", "--temperature", "0"], "--greedy"),
        (["--prompt", "a", "--temperature", "-1"], "--temperature"),
        (["--prompt", "a", "--temperature", "nan", "--greedy"], "--temperature"),
        (["--prompt", "a", "--top-p", "1.5"], "--top-p"),
        (["--prompt", "a", "--top-k", "-2"], "--top-k"),
        (["--prompts", "missing.txt"], "not found"),
        (["--prompts", "missing.jsonl"], "not found"),
        (["--prompts", "{bad_column}"], "prompt column"),
        (["--prompts", "{blank}"], "no prompt"),
    ],
)
def test_generate_errors_are_one_line_with_exit_code_2(model_dir, tmp_path, capsys, args, fragment):
    (tmp_path / "bad.jsonl").write_text('{"question": "a"}\n')
    (tmp_path / "blank.txt").write_text("\n \n")
    files = {"bad_column": tmp_path / "bad.jsonl", "blank": tmp_path / "blank.txt"}
    args = [a.format(**files) if a.startswith("{") else a for a in args]
    args = [str(tmp_path / a) if a.startswith("missing") else a for a in args]
    assert main(["generate", "--model", str(model_dir), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and fragment in err, err


def test_a_tokenizer_without_chat_template_is_refused_clearly(plain_dir, capsys):
    assert main(["chat", "--model", str(plain_dir)]) == 2
    err = capsys.readouterr().err.strip()
    assert "no chat template" in err and "cohort generate" in err and "\n" not in err, err
    assert main(["generate", "--model", str(plain_dir), "--prompt", "a", "--chat-template", "on"]) == 2
    err = capsys.readouterr().err.strip()
    assert "no chat template" in err and "\n" not in err, err


class _StubSession:
    """Stands in for ChatSession: the first reply is interrupted by Ctrl-C, later ones echo the history size."""

    def __init__(self) -> None:
        self.messages: list[str] = []
        self.calls = 0

    def reset(self) -> None:
        self.messages = []

    def reply(self, text: str) -> ChatTurn:
        self.calls += 1
        if self.calls == 1:
            raise KeyboardInterrupt
        self.messages += [text, "ok"]
        return ChatTurn(reply=f"#{len(self.messages)}\x1b", finish_reason="length", prompt=text, dropped=0)


def test_chat_loop_survives_ctrl_c_during_a_reply_and_resets():
    lines = iter(["first", "  ", "second", "/reset", "third"])
    written: list[str] = []

    def read(prompt: str) -> str:
        assert prompt == "you> "
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    session = _StubSession()
    assert chat_loop(session, read=read, write=written.append) == 0
    replies = [w for w in written if w.startswith("model> ")]
    assert replies == ["model> #2\\x1b", "model> #2\\x1b"]  # the interrupted turn left no history
    assert any("interrupted" in w for w in written) and "(history cleared)" in written
    assert any("max-new-tokens" in w for w in written)


def test_chat_loop_survives_a_line_that_is_not_utf8():
    events: list = [b"\xff\xfe hi".decode, "interrupted by the stub", "hello"]
    written: list[str] = []

    def read(prompt: str) -> str:
        if not events:
            raise EOFError
        event = events.pop(0)
        return event() if callable(event) else event  # decoding b"\xff..." raises as input() does

    assert chat_loop(_StubSession(), read=read, write=written.append) == 0
    assert any(w.startswith("error: that line is not UTF-8 text") for w in written), written
    assert any(w.startswith("model> ") for w in written)  # the next line still got a reply


def _replies(k: int):
    """Returns a test of the terminal output: k replies were printed and the next "you> " prompt followed."""
    return lambda text: text.count("model> ") >= k and "you> " in text.rsplit("model> ", 1)[1]


def _read_until(fd: int, buffer: bytearray, predicate, timeout: float = 120.0) -> str:
    """Returns the terminal output so far once ``predicate`` holds for it (fails after ``timeout`` seconds)."""
    deadline = time.monotonic() + timeout
    while not predicate(buffer.decode("utf-8", "replace")):
        left = deadline - time.monotonic()
        assert left > 0, f"timed out; terminal output so far:\n{buffer.decode('utf-8', 'replace')[-3000:]}"
        ready, _, _ = select.select([fd], [], [], min(left, 1.0))
        if ready:
            try:
                chunk = os.read(fd, 4096)
            except OSError:  # EIO: the child closed the terminal
                chunk = b""
            if not chunk:
                assert predicate(buffer.decode("utf-8", "replace")), buffer.decode("utf-8", "replace")[-3000:]
                break
            buffer.extend(chunk)
    return buffer.decode("utf-8", "replace")


@pytest.mark.slow
def test_chat_in_a_pseudo_terminal_keeps_the_history(model_dir):
    from cohort.models import load_tokenizer

    eos = load_tokenizer(model_dir).eos_token
    master, slave = os.openpty()
    env = {**os.environ, "TERM": "dumb", "PYTHONIOENCODING": "utf-8", "HF_HUB_OFFLINE": "1"}
    env["TOKENIZERS_PARALLELISM"] = "false"
    cmd = [sys.executable, "-m", "cohort.cli", "chat", "--model", str(model_dir), "--greedy", "--show-prompt"]
    proc = subprocess.Popen(
        [*cmd, "--max-new-tokens", "6"], stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True
    )
    os.close(slave)
    out = bytearray()
    try:
        _read_until(master, out, lambda text: "you> " in text)
        os.write(master, b"hello\n")
        _read_until(master, out, _replies(1))
        os.write(master, b"again\n")
        _read_until(master, out, _replies(2))
        os.write(master, b"/reset\n")
        _read_until(master, out, lambda text: "history cleared" in text)
        os.write(master, b"third\n")
        text = _read_until(master, out, _replies(3))
        os.write(master, b"/exit\n")
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)

    prompts = [ast.literal_eval(p) for p in re.findall(r"prompt> (.*?)\r\n", text)]
    first, second, third = prompts
    assert first == "User: hello\nAssistant: "
    head, tail = "User: hello\nAssistant: ", eos + "\nUser: again\nAssistant: "
    assert second.startswith(head) and second.endswith(tail)  # the second prompt holds the first exchange
    reply = second[len(head) : -len(tail)]
    shown = text.split("model> ")[1]
    assert shown.startswith(printable(reply).replace("\n", "\r\n") + "\r\n")  # the reply printed first
    assert third == "User: third\nAssistant: "  # /reset emptied the history


def test_chat_session_leaves_old_exchanges_out_to_fit_the_context(model_dir):
    from cohort.commands.generate import ChatSession
    from cohort.models import load_model, load_tokenizer
    from cohort.rollout import SamplingParams

    tokenizer, model = load_tokenizer(model_dir), load_model(model_dir)
    session = ChatSession(
        model, tokenizer, SamplingParams(max_completion_length=4, greedy=True), system="be brief"
    )
    session.context_limit = 60
    turns = [session.reply(f"message number {i}") for i in range(4)]
    assert turns[0].dropped == 0 and turns[-1].dropped > 0
    assert turns[-1].prompt.startswith("System: be brief\n") and "message number 0" not in turns[-1].prompt
    assert len(session.messages) == 8  # the history itself is kept whole
    with pytest.raises(ValueError, match="no room for a reply"):
        session.reply("x" * 80)
    assert len(session.messages) == 8


def test_chat_refuses_a_line_that_is_not_text_and_goes_on(model_dir):
    """Bytes that are not UTF-8 reach Python as lone surrogates (stdin's surrogateescape), a NUL byte is not
    text: each such line gets a message, and the next line its reply."""
    from cohort.commands.generate import ChatSession
    from cohort.models import load_model, load_tokenizer
    from cohort.rollout import SamplingParams

    tokenizer, model = load_tokenizer(model_dir), load_model(model_dir)
    session = ChatSession(model, tokenizer, SamplingParams(max_completion_length=2, greedy=True))
    with pytest.raises(ValueError, match=r"not UTF-8 text \(byte 0xff at character 1\)"):
        session.reply(b"\xff\xfe hi".decode("utf-8", "surrogateescape"))
    with pytest.raises(ValueError, match=r"a NUL byte at character 3"):
        session.reply("ab\x00cd")
    assert session.messages == []  # nothing refused reached the history
    lines = iter([b"\xff hi".decode("utf-8", "surrogateescape"), "ab\x00cd", "x" * 20_000, "hello"])
    written: list[str] = []

    def read(prompt: str) -> str:
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    assert chat_loop(session, read=read, write=written.append) == 0
    errors = [w for w in written if w.startswith("error: ")]
    assert len(errors) == 3 and "type it again" in errors[0] and "no room for a reply" in errors[2], errors
    assert sum(w.startswith("model> ") for w in written) == 1  # the last line got its reply


def test_an_empty_prompts_file_says_it_held_the_prompts_to_generate_from(tmp_path, capsys):
    (tmp_path / "empty.jsonl").write_text("")
    assert main(["generate", "--model", "m", "--prompts", str(tmp_path / "empty.jsonl")]) == 2
    err = capsys.readouterr().err
    assert "is empty: it has no rows; `cohort generate` needs at least one prompt to generate from" in err, (
        err
    )
    assert "training run" not in err
