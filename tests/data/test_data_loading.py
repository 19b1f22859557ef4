"""JSONL / `datasets` loading and row validation, including every error case."""

from __future__ import annotations

import json

import pytest

from cohort.data import DataError, load_rows, validate_rows


def write_jsonl(path, lines):
    path.write_text(
        "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines), encoding="utf-8"
    )
    return path


def test_jsonl_rows_keep_every_column(tmp_path):
    chat = [{"role": "user", "content": "2+2?"}]
    path = write_jsonl(
        tmp_path / "d.jsonl",
        [{"prompt": chat[:1], "answer": "2", "level": 1}, "", {"prompt": chat, "answer": 4, "level": 2}],
    )
    rows = load_rows(path)
    assert rows == [
        {"prompt": chat[:1], "answer": "2", "level": 1},
        {"prompt": chat, "answer": 4, "level": 2},
    ]
    assert load_rows(str(path)) == rows


def test_custom_prompt_column(tmp_path):
    path = write_jsonl(tmp_path / "q.jsonl", [{"question": "1+1=", "answer": "2"}])
    assert load_rows(path, prompt_column="question") == [{"question": "1+1=", "answer": "2"}]
    with pytest.raises(
        DataError, match=r"no prompt column 'prompt'; columns found: \['answer', 'question'\]"
    ):
        load_rows(path)


def test_missing_file(tmp_path):
    with pytest.raises(DataError, match="not found"):
        load_rows(tmp_path / "nope.jsonl")
    with pytest.raises(DataError, match="not found"):
        load_rows("data/nope.jsonl")


def test_malformed_line_names_line_number(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "a"}, "", '{"prompt": "b",}'])
    with pytest.raises(DataError, match=r"bad\.jsonl:3: malformed JSON"):
        load_rows(path)
    path = write_jsonl(tmp_path / "list.jsonl", [{"prompt": "a"}, '["prompt"]'])
    with pytest.raises(DataError, match=r"list\.jsonl:2: expected a JSON object.*got list"):
        load_rows(path)


def test_empty_dataset(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n\n", encoding="utf-8")
    with pytest.raises(DataError, match="empty"):
        load_rows(path)
    with pytest.raises(DataError, match="empty"):
        validate_rows([], "prompt")


def test_inconsistent_columns(tmp_path):
    path = write_jsonl(
        tmp_path / "mixed.jsonl", [{"prompt": "a", "answer": "1"}, {"prompt": "b", "solution": "2"}]
    )
    with pytest.raises(
        DataError, match=r"mixed\.jsonl:2: inconsistent columns.*missing \['answer'\], extra \['solution'\]"
    ):
        load_rows(path)
    with pytest.raises(DataError, match="row 1: inconsistent columns"):
        validate_rows([{"prompt": "a", "answer": "1"}, {"prompt": "b"}], "prompt")


def test_validate_rows_checks_types_reserved_and_required():
    with pytest.raises(DataError, match="row 0 has an empty prompt"):
        validate_rows([{"prompt": ""}])
    with pytest.raises(DataError, match="row 1: prompt column 'prompt' must be a string or a list"):
        validate_rows([{"prompt": "a"}, {"prompt": 7}])
    with pytest.raises(DataError, match=r"must be a string or a list"):
        validate_rows([{"prompt": [{"text": "no role"}]}])
    with pytest.raises(DataError, match=r"\['completions'\], which clash"):
        validate_rows([{"prompt": "a", "completions": "x"}])
    with pytest.raises(DataError, match=r"lacks required column\(s\) \['answer'\]"):
        validate_rows([{"prompt": "a"}], required=["answer"])
    with pytest.raises(DataError, match="row 0 is a str"):
        validate_rows(["prompt"])
    rows = [{"prompt": "a", "answer": "1"}]
    assert validate_rows(rows, required=["answer"], where="x") == rows


def test_datasets_folder_and_splits(tmp_path):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_list([{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"}])
    ds.save_to_disk(str(tmp_path / "single"))
    assert load_rows(tmp_path / "single") == ds.to_list()
    datasets.DatasetDict({"train": ds, "test": ds.select([1])}).save_to_disk(str(tmp_path / "dict"))
    assert load_rows(tmp_path / "dict", split="test") == [{"prompt": "2+2=", "answer": "4"}]
    with pytest.raises(DataError, match=r"no split 'validation'; its splits are \['test', 'train'\]"):
        load_rows(tmp_path / "dict", split="validation")
    ds.to_csv(str(tmp_path / "d.csv"))
    assert load_rows(tmp_path / "d.csv") == [{"prompt": "1+1=", "answer": 2}, {"prompt": "2+2=", "answer": 4}]
