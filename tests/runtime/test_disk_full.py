"""A full disk under every writer cohort has: one error naming the folder, the space left and the fix (no
traceback from the command line), and nothing written before lost. The disk is made full by the libraries'
own entry points (torch.save, open, Path.write_text) raising what a full disk raises, and shutil.disk_usage
reporting what a full disk reports."""

from __future__ import annotations

import builtins
import errno
import shutil
from collections import namedtuple
from pathlib import Path

import pytest
import torch
from test_trainer import _cfg

from cohort.errors import DiskFullError, is_disk_full
from cohort.trainer import GRPOTrainer

TORCH_SHORT_WRITE = (
    "[enforce fail at inline_container.cc:672] . unexpected pos 1088 vs 986"  # torch.save on a full disk
)
_Usage = namedtuple("_Usage", "total used free")


def _disk(monkeypatch, free: int) -> None:
    """Makes shutil.disk_usage report `free` bytes free everywhere."""
    monkeypatch.setattr(shutil, "disk_usage", lambda path: _Usage(2**30, 2**30 - free, free))


def _no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_torchs_short_write_is_a_full_disk_only_when_the_disk_is_nearly_full(tmp_path, monkeypatch):
    _disk(monkeypatch, 10_000)
    assert is_disk_full(RuntimeError(TORCH_SHORT_WRITE), tmp_path)
    assert is_disk_full(OSError(errno.ENOSPC, "x")) and is_disk_full(OSError(errno.EDQUOT, "x"))
    _disk(monkeypatch, 50 * 2**30)
    assert not is_disk_full(RuntimeError(TORCH_SHORT_WRITE), tmp_path)
    assert not is_disk_full(RuntimeError("something else"), tmp_path)


def test_a_checkpoint_on_a_full_disk_names_the_folder_and_keeps_the_earlier_ones(
    tiny_model_dir, tmp_path, monkeypatch, capsys
):
    from cohort.cli import main

    run = tmp_path / "run"
    args = [f"{k}={v}" for k, v in {"steps": 2, "save_every": 1, "out_dir": run}.items()]
    cfg_file = tmp_path / "cfg.yaml"
    import yaml

    from cohort.config import to_dict

    cfg_file.write_text(yaml.safe_dump(to_dict(_cfg(tiny_model_dir, run, steps=2, save_every=1))))
    real_save = torch.save

    def save(obj, f, *a, **kw):
        if "step-2" in str(f):  # the second checkpoint finds the disk full, as torch reports it
            raise RuntimeError(TORCH_SHORT_WRITE)
        return real_save(obj, f, *a, **kw)

    monkeypatch.setattr(torch, "save", save)
    _disk(monkeypatch, 4096)
    code = main(["train", str(cfg_file), *args])
    err = capsys.readouterr().err
    assert code != 0 and "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    assert "no space left on device while writing the checkpoint of step 2" in lines[0]
    assert str(run / "checkpoints") in lines[0] and "resume=auto" in lines[0]
    assert (run / "checkpoints" / "step-1" / "trainer_state.pt").is_file()  # the earlier one intact
    assert not (run / "checkpoints" / ".tmp-step-2").exists()


def test_the_run_logs_on_a_full_disk_name_the_file_and_keep_the_rows(tmp_path, monkeypatch):
    from cohort.report.sinks import MetricsLogger, write_summary

    logger = MetricsLogger(tmp_path)
    logger.log({"step": 1, "loss": 0.5})
    real_open = builtins.open

    class FullFile:
        """A log file whose writes find the disk full."""

        def __init__(self, f):
            self.f = f

        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

        def __getattr__(self, name):
            return getattr(self.f, name)

    monkeypatch.setattr(builtins, "open", lambda *a, **kw: FullFile(real_open(*a, **kw)))
    full = MetricsLogger(tmp_path)
    with pytest.raises(
        DiskFullError, match=rf"no space left on the disk holding {tmp_path} .*metrics.jsonl.*resume"
    ):
        full.log({"step": 2, "loss": 0.4})
    monkeypatch.setattr(builtins, "open", real_open)
    assert (tmp_path / "metrics.jsonl").read_text().splitlines() == ['{"step": 1, "loss": 0.5}']
    write_summary(tmp_path, {"steps": 1})
    monkeypatch.setattr(Path, "write_text", _no_space)
    with pytest.raises(DiskFullError, match=rf"disk holding {tmp_path} .*summary.json"):
        write_summary(tmp_path, {"steps": 2})
    monkeypatch.undo()
    assert (tmp_path / "summary.json").read_text().strip().endswith("}") and not list(tmp_path.glob("*.tmp"))


def test_the_report_on_a_full_disk_keeps_the_earlier_page(tiny_model_dir, tmp_path, monkeypatch):
    from cohort.report import write_report

    run = tmp_path / "r"
    GRPOTrainer(_cfg(tiny_model_dir, run, steps=1)).train()
    before = (run / "report.html").read_text()
    monkeypatch.setattr(Path, "write_text", _no_space)
    with pytest.raises(DiskFullError, match=rf"disk holding {run} .*report.html.*cohort report"):
        write_report(run)
    monkeypatch.undo()
    assert (run / "report.html").read_text() == before


def test_cohort_sample_on_a_full_disk_says_so_in_one_line_and_keeps_the_earlier_file(
    tiny_model_dir, tmp_path, monkeypatch, capsys
):
    from cohort.cli import main

    out = tmp_path / "kept.jsonl"
    out.write_text('{"earlier": true}\n')
    real_open = builtins.open

    def full_open(file, mode="r", *a, **kw):
        if "w" in mode and str(file).endswith(".tmp"):
            raise OSError(errno.ENOSPC, "No space left on device", str(file))
        return real_open(file, mode, *a, **kw)

    monkeypatch.setattr(builtins, "open", full_open)
    args = ["sample", "--model", str(tiny_model_dir), "--task", "addition", "--n", "2", "--k", "1"]
    args += ["--max-completion-length", "2", "--reward", "accuracy", "--threshold", "0", "--out", str(out)]
    code = main(args)
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert f"error: no space left on the disk holding {tmp_path}" in err and "kept.jsonl" in err
    assert "--out" in err
    assert out.read_text() == '{"earlier": true}\n'
