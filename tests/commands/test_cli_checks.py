"""What the sft / eval / sample / merge / report / train command lines refuse, and how they say it: an output
folder over the input model, prompts past the model's context, data with no rows, a folder of a run given where
the run (or its model) is expected."""

from __future__ import annotations

import json

import pytest

from cohort.cli import main


def test_sft_will_not_write_over_its_input_model(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "base").mkdir(parents=True)
    (tmp_path / "runs" / "base" / "config.json").write_text("{}")  # refused before it is read
    for out in ("runs/base", "runs"):
        argv = ["sft", "--model", "runs/base", "--task", "addition", "--n", "2", "--out", out]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert (
            f"--out {out} would write the fine-tuned model over the model folder runs/base it is read from"
            in err
        )
    assert sorted(p.name for p in (tmp_path / "runs" / "base").iterdir()) == ["config.json"]


def test_eval_names_the_row_whose_prompt_fills_the_context(tiny_model_dir, tmp_path, capsys):
    data = tmp_path / "rows.jsonl"  # the tiny model's context: 256 positions, one token a character
    rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "1+" * 200 + "1=", "answer": "201"}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["eval", "--model", str(tiny_model_dir), "--data", str(data)]) == 2
    err = capsys.readouterr().err
    assert (
        "row 1 of the data is a prompt of 402 tokens, which fills the model's context of 256 tokens" in err
    ), err
    assert "or pass --n 1 to keep the rows before it" in err


@pytest.mark.parametrize(
    ("command", "need"),
    [
        (["sft", "--out", "{tmp}/sft"], "SFT needs at least one prompt/completion pair to train on"),
        (["eval"], "`cohort eval` needs at least one prompt to evaluate on"),
        (["sample", "--out", "{tmp}/kept.jsonl"], "`cohort sample` needs at least one prompt to sample from"),
    ],
)
def test_empty_data_says_what_it_was_for(command, need, tmp_path, capsys):
    (tmp_path / "empty.jsonl").write_text("")
    argv = [a.format(tmp=tmp_path) for a in command]
    assert main([*argv, "--model", "m", "--data", str(tmp_path / "empty.jsonl")]) == 2
    err = capsys.readouterr().err
    assert f"is empty: it has no rows; {need}" in err and "training run" not in err, err


def test_empty_held_out_data_is_named_as_such(tmp_path, capsys):
    (tmp_path / "rows.jsonl").write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    (tmp_path / "empty.jsonl").write_text("")
    argv = ["train", "model.name_or_path=m", f"data.path={tmp_path / 'rows.jsonl'}"]
    assert main([*argv, f"data.eval_path={tmp_path / 'empty.jsonl'}", f"out_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert "it has no rows; the held-out evaluation needs at least one prompt; unset data.eval_path" in err, (
        err
    )


def test_merge_and_report_name_the_run_folder_or_its_model(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run" / "final").mkdir(parents=True)
    (tmp_path / "run" / "checkpoints" / "step-10").mkdir(parents=True)
    (tmp_path / "run" / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward": 0.5}) + "\n")
    (tmp_path / "run" / "final" / "adapter_config.json").write_text("{}")
    assert main(["merge", "run", "merged"]) == 2
    err = capsys.readouterr().err
    assert (
        "run is not a LoRA adapter folder (it holds no adapter_config.json); run is a cohort run directory: "
        in err
    )
    assert err.rstrip().endswith("its trained model is run/final"), err
    assert main(["report", "run/checkpoints/step-10"]) == 2
    err = capsys.readouterr().err
    assert "it is a folder inside the run directory 'run': pass that" in err, err
