"""A cohort run directory passed where a model folder is expected: every command's error names the model folder
inside it (its final model, else its newest checkpoint holding one), before anything loads."""

from __future__ import annotations

import pytest

from cohort.cli import main
from cohort.models import run_dir_hint


def _run_dir(root, *, final: bool = True, checkpoints: tuple[int, ...] = (2, 10)):
    """Returns a folder laid out as a `cohort train` run: logs, config, checkpoints, final/ (empty model files)."""
    run = root / "run"
    run.mkdir()
    for name in ("metrics.jsonl", "config.yaml"):
        (run / name).write_text("")
    for step in checkpoints:
        (run / "checkpoints" / f"step-{step}").mkdir(parents=True)
        (run / "checkpoints" / f"step-{step}" / "config.json").write_text("{}")
    if final:
        (run / "final").mkdir()
        (run / "final" / "config.json").write_text("{}")
    return run


COMMANDS = {
    "eval": ["eval", "--task", "addition", "--n", "2"],
    "sample": ["sample", "--task", "addition", "--n", "2", "--out", "{tmp}/kept.jsonl"],
    "generate": ["generate", "--prompt", "1+1="],
    "sft": ["sft", "--task", "addition", "--n", "2", "--out", "{tmp}/sft"],
    "rm": ["rm", "--data", "{tmp}/pairs.jsonl", "--out", "{tmp}/rm"],
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_run_directory_as_the_model_names_its_final_model(command, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    _run_dir(tmp_path)
    (tmp_path / "pairs.jsonl").write_text('{"prompt": "1+1=", "chosen": "2", "rejected": "3"}\n')
    argv = [a.format(tmp=tmp_path) for a in COMMANDS[command]]
    assert main([*argv, "--model", "run"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "folder 'run' exists but holds no tokenizer_config.json" in err, err
    assert err.endswith("; run is a cohort run directory: its trained model is run/final"), err
    assert not (tmp_path / "rm").exists()  # refused before the run directory was made


def test_a_run_without_its_final_model_names_its_newest_checkpoint(tmp_path):
    run = _run_dir(tmp_path, final=False, checkpoints=(2, 10, 9))
    (run / "checkpoints" / "step-11").mkdir()  # no model inside: not one to pass
    hint = run_dir_hint(run)
    assert f"{run} is a cohort run directory without its final model" in hint
    assert f"pass its newest checkpoint, {run / 'checkpoints' / 'step-10'}, or run its command again" in hint
    (run / "metrics.jsonl").unlink()  # config.yaml alone is no run directory's mark (checkpoints/ is)
    assert "newest checkpoint" in run_dir_hint(run)


def test_a_run_without_any_model_says_to_finish_it(tmp_path):
    run = _run_dir(tmp_path, final=False, checkpoints=())
    assert run_dir_hint(run).endswith(
        f"without a trained model (no {run}/final, no checkpoint holding one): run its command again (with "
        f"resume=auto for `cohort train`) to finish it and write {run}/final"
    )


def test_other_folders_get_no_hint(tmp_path, tiny_model_dir):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "rows.jsonl").write_text("")
    assert (
        run_dir_hint(tmp_path / "data") == run_dir_hint(tiny_model_dir) == run_dir_hint(tmp_path / "x") == ""
    )
