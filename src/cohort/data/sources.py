"""Load prompt datasets (JSONL / JSON files, `datasets` folders or Hub names) as lists of row dicts, and validate them.

A row is ``{prompt_column: str | list[{"role", "content"}], other columns...}``. Every column other than
the prompt reaches the reward functions as a keyword argument (TRL's convention), so all rows must
have the same columns and none may be named like the reward functions' own arguments.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "RESERVED_COLUMNS",
    "DataError",
    "Rows",
    "load_json",
    "load_jsonl",
    "load_rows",
    "row_place",
    "validate_rows",
]

RESERVED_COLUMNS = frozenset({"prompts", "completions", "completion_ids"})
"""Column names that would clash with the arguments every reward function receives."""

_DATASETS_FILE_BUILDERS = {".csv": "csv", ".parquet": "parquet", ".arrow": "arrow"}


TRAINING_NEED = "a training run needs at least one prompt"
"""What the error for a dataset with no rows says by default: what a training set's rows are for."""


class DataError(ValueError):
    """A dataset that cannot be used: missing, malformed, empty or with the wrong columns."""


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
"""Roles a chat message may have (those of the chat templates of common instruct models)."""


class Rows(list):
    """Rows read from a JSONL file, each knowing its line there (1-based; blank lines are skipped), so a check
    that refuses a row later names the line to fix (`row_place`)."""

    def __init__(self, rows: Iterable[dict[str, Any]], source: str, lines: Sequence[int]) -> None:
        super().__init__(rows)
        self.source, self.lines = source, list(lines)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):  # the first N rows (eval_limit) keep their lines
            return Rows(list.__getitem__(self, index), self.source, self.lines[index])
        return list.__getitem__(self, index)


def row_place(rows: Sequence[Any], i: int) -> str:
    """Returns how messages name row `i` of `rows`: "line N of FILE" for rows read from a JSONL file, else
    "row i" (its index in the list)."""
    if isinstance(rows, Rows) and len(rows.lines) == len(rows):
        return f"line {rows.lines[i]} of {rows.source}"
    return f"row {i}"


def load_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Returns the rows of a JSONL file (one JSON object per line; blank lines skipped)."""
    path = Path(path)
    if not path.is_file():
        hint = "it is a folder; pass a .jsonl file" if path.is_dir() else "check the path"
        raise DataError(f"dataset file {str(path)!r} not found ({hint})")
    rows: list[dict[str, Any]] = []
    lines: list[int] = []
    first_keys: list[str] | None = None
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DataError(
                    f"{path}:{lineno}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at column {exc.start + 1}); "
                    "save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8) or fix that line"
                ) from None
            if lineno == 1:
                line = line.lstrip("\ufeff")  # a byte-order mark some editors write
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(
                    f"{path}:{lineno}: malformed JSON ({exc.msg} at column {exc.colno}); each line must be "
                    f"one JSON object. The line starts with {line[:80]!r}"
                ) from exc
            if not isinstance(row, dict):
                raise DataError(
                    f'{path}:{lineno}: expected a JSON object like {{"prompt": ...}}, got {type(row).__name__}'
                )
            if first_keys is None:
                first_keys = sorted(row)
            elif sorted(row) != first_keys:
                raise DataError(f"{path}:{lineno}: {_column_mismatch(row, first_keys)}")
            rows.append(row)
            lines.append(lineno)
    return Rows(rows, str(path), lines)


def _utf8_text(path: Path, data: bytes) -> str:
    """Returns ``data`` decoded as UTF-8, or raises a DataError naming the line of the first bad byte."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        lineno = data.count(b"\n", 0, exc.start) + 1
        column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        raise DataError(
            f"{path}:{lineno}: not UTF-8 text (byte 0x{data[exc.start]:02x} at column {column}); "
            "save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8) or fix that line"
        ) from None


def _single_object(path: Path) -> dict[str, Any] | None:
    """Returns the content of a file that is one (multi-line) JSON object, else None."""
    try:
        value = json.loads(path.read_text(encoding="utf-8-sig"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    return value if isinstance(value, dict) else None


def load_json(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Returns the rows of a .json file: a JSON array of objects, or one JSON object per line (as JSONL).

    The array is read with Python's json module rather than `datasets`, which would fill a column a row
    lacks with None and hide the inconsistent rows that this check (the same as :func:`load_jsonl`'s) names.
    """
    path = Path(path)
    if not path.is_file():
        hint = "it is a folder; pass a .json file" if path.is_dir() else "check the path"
        raise DataError(f"dataset file {str(path)!r} not found ({hint})")
    with path.open("rb") as f:
        head = f.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
    if not head.startswith(b"["):
        try:
            return load_jsonl(path)  # JSON Lines under a .json name (what `datasets`' to_json writes)
        except DataError:
            whole = _single_object(path)
            if whole is None:
                raise
            raise DataError(
                f"{path} holds one JSON object (keys {sorted(whole)[:10]}), not rows; write the rows as a JSON "
                "array of objects, [{...}, {...}], or as one JSON object per line"
            ) from None
    text = _utf8_text(path, path.read_bytes())
    try:
        rows = json.loads(text.lstrip("\ufeff"))
    except json.JSONDecodeError as exc:
        raise DataError(
            f"{path}:{exc.lineno}: malformed JSON ({exc.msg} at column {exc.colno}); the file must be one JSON "
            "array of objects, [{...}, {...}], or hold one JSON object per line"
        ) from exc
    first_keys: list[str] | None = None
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise DataError(
                f'{path}: row {i} of the array: expected a JSON object like {{"prompt": ...}}, '
                f"got {type(row).__name__}: {str(row)[:80]}"
            )
        if first_keys is None:
            first_keys = sorted(row)
        elif sorted(row) != first_keys:
            raise DataError(f"{path}: row {i} of the array: {_column_mismatch(row, first_keys)}")
    return rows


def _column_mismatch(row: dict[str, Any], expected: Sequence[str]) -> str:
    """Returns a sentence saying how a row's columns differ from the first row's."""
    missing = sorted(set(expected) - set(row))
    extra = sorted(set(row) - set(expected))
    return (
        f"inconsistent columns: this row has {sorted(row)} but the first row has {list(expected)} "
        f"(missing {missing}, extra {extra}); every row needs the same columns"
    )


def _looks_like_file(source: str) -> bool:
    """Returns True when ``source`` names a local file or folder rather than a Hub dataset id: a file name,
    a path no Hub id can be, or an ``org/name`` whose ``org`` is a folder here (``data/trian``)."""
    return (
        source.endswith((".jsonl", ".json", *_DATASETS_FILE_BUILDERS))
        or source.startswith((".", "/", "~"))
        or "\\" in source
        or source.count("/") > 1
        or (source.count("/") == 1 and Path(source.split("/", 1)[0]).is_dir())
    )


def _import_datasets(source: str):
    """Returns the ``datasets`` module, or raises a DataError saying how to install it."""
    try:
        import datasets
    except ImportError as exc:
        raise DataError(
            f"loading {source!r} needs the optional dependency `datasets`: pip install 'cohort[data]' "
            "(or convert the data to a JSONL file with one object per line)"
        ) from exc
    return datasets


def _from_datasets(source: str, split: str, subset: str | None = None) -> list[dict[str, Any]]:
    """Returns the rows of a `datasets` folder (save_to_disk or data files), data file or Hub dataset."""
    datasets = _import_datasets(source)
    path = Path(source).expanduser()
    saved = path.is_dir() and ((path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists())
    if subset is not None and (saved or path.is_file()):
        raise DataError(
            f"subset={subset!r} (data.subset) names a configuration of a Hub dataset or of a dataset folder "
            f"with several configurations, but {source!r} is a "
            f"{'folder written by save_to_disk' if saved else 'single data file'}, which has none; "
            "drop the subset"
        )
    where = f"dataset {source!r} ({'' if subset is None else f'subset {subset!r}, '}split {split!r})"
    try:
        if saved:
            ds = datasets.load_from_disk(str(path))
            if isinstance(ds, datasets.DatasetDict):
                if split not in ds:
                    raise DataError(f"dataset {source!r} has no split {split!r}; its splits are {sorted(ds)}")
                ds = ds[split]
        elif path.is_file():
            ds = datasets.load_dataset(
                _DATASETS_FILE_BUILDERS[path.suffix], data_files=str(path), split="train"
            )
        else:
            ds = datasets.load_dataset(str(path) if path.is_dir() else source, name=subset, split=split)
    except DataError:
        raise
    except Exception as exc:  # datasets raises many types; add what we tried, keep the cause
        raise DataError(
            f"could not load {where} with `datasets`: {type(exc).__name__}: {exc}. "
            "Pass a JSONL or JSON file, a folder written by Dataset.save_to_disk, or a Hub dataset name reachable "
            "from this machine (with subset= / data.subset naming its configuration when it has several)"
        ) from exc
    return ds.to_list()


def load_rows(
    source: str | os.PathLike,
    *,
    split: str = "train",
    prompt_column: str = "prompt",
    subset: str | None = None,
    need: str = TRAINING_NEED,
) -> list[dict[str, Any]]:
    """Returns the validated rows of a JSONL / JSON file, a `datasets` folder / file, or a Hub dataset name.

    ``subset`` is the configuration of a dataset that has several (``load_rows("openai/gsm8k",
    subset="main")``, passed to ``datasets.load_dataset`` as its ``name``); plain files have none.
    ``need`` says what the rows are for when there are none (see :func:`validate_rows`).
    """
    name = os.fspath(source)
    if subset is not None and (not isinstance(subset, str) or not subset):
        raise DataError(f"subset={subset!r} must be a non-empty configuration name (or None)")
    path = Path(name).expanduser()
    if path.is_file() and path.suffix not in _DATASETS_FILE_BUILDERS:
        if subset is not None:
            raise DataError(
                f"subset={subset!r} (data.subset) names a configuration of a Hub dataset or dataset folder, "
                f"but {name!r} is a single file, which has none; drop the subset"
            )
        rows = load_json(path) if path.suffix == ".json" else load_jsonl(path)
    elif path.exists():
        rows = _from_datasets(name, split, subset)
    elif _looks_like_file(name):
        raise DataError(
            f"dataset file {name!r} not found; pass an existing .jsonl or .json file, a dataset folder or a Hub name"
        )
    else:
        rows = _from_datasets(name, split, subset)
    return validate_rows(rows, prompt_column, where=repr(name), need=need)


def _is_message_list(prompt: Any) -> bool:
    """Returns True for a conversational prompt: a non-empty list of {"role", "content"} dicts."""
    return (
        isinstance(prompt, list)
        and len(prompt) > 0
        and all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt)
    )


def validate_rows(
    rows: Sequence[dict[str, Any]],
    prompt_column: str = "prompt",
    *,
    required: Iterable[str] = (),
    where: str = "dataset",
    need: str = TRAINING_NEED,
) -> list[dict[str, Any]]:
    """Returns ``rows`` as a list after checking: non-empty, same columns, prompt column present and well typed.

    ``need`` ends the message for no rows, saying what they were for (the held-out prompts, the prompts to
    generate from, ...), as "a training run needs at least one prompt" does for a training set."""
    rows = rows if isinstance(rows, Rows) else list(rows)
    if not rows:
        raise DataError(f"{where} is empty: it has no rows; {need}")
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise DataError(
                f"{where}: {row_place(rows, i)} is a {type(row).__name__}, expected a dict of columns"
            )
    columns = sorted(rows[0])
    if prompt_column not in rows[0]:
        raise DataError(
            f"{where} has no prompt column {prompt_column!r}; columns found: {columns}. "
            "Pass prompt_column=<one of them> (data.prompt_column in the config, --prompt-column on the command line)"
        )
    reserved = sorted(RESERVED_COLUMNS & set(columns))
    if reserved:
        raise DataError(
            f"{where} has column(s) {reserved}, which clash with the arguments every reward function "
            f"receives ({sorted(RESERVED_COLUMNS)}); rename them"
        )
    missing = [c for c in required if c not in rows[0]]
    if missing:
        raise DataError(
            f"{where} lacks required column(s) {missing} (needed by the reward functions); columns found: {columns}"
        )
    first_kind = None  # "text" or "messages": one dataset, one format (rewards get completions in it)
    for i, row in enumerate(rows):
        if sorted(row) != columns:
            raise DataError(f"{where}: {row_place(rows, i)}: {_column_mismatch(row, columns)}")
        prompt = row[prompt_column]
        if isinstance(prompt, str):
            if not prompt.strip():
                what = "an empty prompt" if not prompt else f"a prompt of only whitespace ({prompt!r})"
                raise DataError(f"{where}: {row_place(rows, i)} has {what}; remove the row or fill it in")
            kind = "text"
        elif not _is_message_list(prompt):
            raise DataError(
                f"{where}: {row_place(rows, i)}: prompt column {prompt_column!r} must be a string or a list of "
                f"{{'role': ..., 'content': ...}} messages, got {type(prompt).__name__}: {str(prompt)[:80]}"
            )
        else:
            kind = "messages"
            for m in prompt:
                if m.get("role") not in CHAT_ROLES:
                    raise DataError(
                        f"{where}: {row_place(rows, i)}: unknown chat role {m.get('role')!r}; a message's role must be one of "
                        f"{list(CHAT_ROLES)}"
                    )
        if first_kind is None:
            first_kind = kind
        elif kind != first_kind:
            raise DataError(
                f"{where}: {row_place(rows, i)} has a {'plain-text' if kind == 'text' else 'chat-message'} prompt but "
                f"{row_place(rows, 0)} "
                f"a {'plain-text' if first_kind == 'text' else 'chat-message'} one; reward functions receive "
                "completions in the dataset's one format, so give every row the same kind of prompt"
            )
    return rows
