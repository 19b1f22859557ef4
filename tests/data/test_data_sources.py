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


def test_missing_file(tmp_path, monkeypatch):
    with pytest.raises(DataError, match="not found"):
        load_rows(tmp_path / "nope.jsonl")
    with pytest.raises(DataError, match="not found"):
        load_rows("data/nope.jsonl")
    # a folder typo under an existing folder is a local path, not a Hub name to try to download
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data" / "train").mkdir(parents=True)
    with pytest.raises(DataError, match="'data/trian' not found"):
        load_rows("data/trian")


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


def test_json_array_loads_with_the_jsonl_checks(tmp_path):
    chat = [{"role": "user", "content": "2+2?"}]
    rows = [{"prompt": chat, "answer": "4", "level": 1}, {"prompt": chat * 2, "answer": 2, "level": 2}]
    path = tmp_path / "d.json"
    path.write_text("\ufeff" + json.dumps(rows, indent=2), encoding="utf-8")  # pretty-printed, with a BOM
    assert load_rows(path) == rows
    assert load_rows(str(path)) == rows
    lines = write_jsonl(tmp_path / "lines.json", rows)  # JSON Lines under a .json name also load
    assert load_rows(lines) == rows

    path.write_text(json.dumps([{"prompt": "a", "answer": "1"}, {"prompt": "b", "solution": "2"}]))
    with pytest.raises(
        DataError,
        match=r"d\.json: row 1 of the array: inconsistent columns.*missing \['answer'\], extra \['solution'\]",
    ):
        load_rows(path)
    path.write_text('[{"prompt": "a"},\n "b"]')
    with pytest.raises(DataError, match=r"d\.json: row 1 of the array: expected a JSON object.*got str"):
        load_rows(path)
    path.write_text('[{"prompt": "a"},\n {"prompt": "b",}]')
    with pytest.raises(DataError, match=r"d\.json:2: malformed JSON"):
        load_rows(path)
    path.write_bytes(b'[{"prompt": "a"},\n {"prompt": "caf\xe9"}]')
    with pytest.raises(DataError, match=r"d\.json:2: not UTF-8 text \(byte 0xe9 at column 17\)"):
        load_rows(path)
    path.write_text("[]")
    with pytest.raises(DataError, match="empty"):
        load_rows(path)
    path.write_text('[{"question": "1+1="}]')
    with pytest.raises(DataError, match=r"no prompt column 'prompt'; columns found: \['question'\]"):
        load_rows(path)
    path.write_text(json.dumps({"data": rows}, indent=2))
    with pytest.raises(DataError, match=r"holds one JSON object \(keys \['data'\]\), not rows"):
        load_rows(path)
    with pytest.raises(DataError, match="not found"):
        load_rows(tmp_path / "missing.json")


def test_subset_reaches_datasets_load_dataset(monkeypatch):
    datasets = pytest.importorskip("datasets")
    calls = []

    def fake_load_dataset(path, name=None, split=None, **kwargs):
        calls.append((path, name, split))
        return datasets.Dataset.from_list([{"question": "1+1=", "answer": "#### 2"}])

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    rows = load_rows("openai/gsm8k", subset="main", split="train", prompt_column="question")
    assert rows == [{"question": "1+1=", "answer": "#### 2"}]
    assert calls == [("openai/gsm8k", "main", "train")]
    load_rows("openai/gsm8k", split="test", prompt_column="question")
    assert calls[-1] == ("openai/gsm8k", None, "test")


def test_subset_of_a_local_dataset_with_several_configs(tmp_path):
    """A folder whose README declares two configurations, which `datasets` reads offline."""
    pytest.importorskip("datasets")
    root = tmp_path / "gsm"
    for config, row in (
        ("main", {"prompt": "1+1=", "answer": "2"}),
        ("socratic", {"prompt": "2+2=", "answer": "4"}),
    ):
        (root / config).mkdir(parents=True)
        for split in ("train", "test"):
            write_jsonl(root / config / f"{split}.jsonl", [{**row, "split": split}])
    (root / "README.md").write_text(
        "---\nconfigs:\n"
        + "".join(
            f"- config_name: {c}\n  data_files:\n"
            + "".join(f"  - split: {s}\n    path: {c}/{s}.jsonl\n" for s in ("train", "test"))
            for c in ("main", "socratic")
        )
        + "---\n",
        encoding="utf-8",
    )
    assert load_rows(root, subset="socratic", split="test") == [
        {"prompt": "2+2=", "answer": "4", "split": "test"}
    ]
    assert load_rows(root, subset="main") == [{"prompt": "1+1=", "answer": "2", "split": "train"}]
    with pytest.raises(DataError, match=r"subset 'nope'.*BuilderConfig 'nope' not found"):
        load_rows(root, subset="nope")
    with pytest.raises(DataError, match="Config name is missing"):
        load_rows(root)


def test_subset_is_refused_where_there_are_no_configurations(tmp_path):
    datasets = pytest.importorskip("datasets")
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a"}])
    with pytest.raises(DataError, match=r"subset='main' \(data.subset\).*single file, which has none"):
        load_rows(path, subset="main")
    datasets.Dataset.from_list([{"prompt": "a"}]).save_to_disk(str(tmp_path / "saved"))
    with pytest.raises(DataError, match="folder written by save_to_disk, which has none"):
        load_rows(tmp_path / "saved", subset="main")
    with pytest.raises(DataError, match="must be a non-empty configuration name"):
        load_rows(path, subset="")


def test_an_empty_dataset_says_what_its_rows_were_for(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("", encoding="utf-8")
    with pytest.raises(DataError, match="it has no rows; a training run needs at least one prompt$"):
        load_rows(path)  # a training set, by default
    need = "the held-out evaluation needs at least one prompt"
    with pytest.raises(DataError, match=f"it has no rows; {need}$"):
        load_rows(path, need=need)
    with pytest.raises(DataError, match=f"the held-out data is empty: it has no rows; {need}$"):
        validate_rows([], "prompt", where="the held-out data", need=need)
