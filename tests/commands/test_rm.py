"""`cohort rm`: reward-model losses by hand, data formats, deterministic batches, training that learns, exact
resume, and the trained folder used as a reward."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from cohort import cli
from cohort.commands.rm import RMConfig, batch_indices, reward_model_loss, rm_examples, train_reward_model
from cohort.rewards import resolve_reward_funcs


def test_losses_by_hand():
    # Pairwise: chosen scores [2, 0], rejected [1, 1] -> margins [1, -1];
    # loss = (-log sigmoid(1) - log sigmoid(-1)) / 2 = (0.31326 + 1.31326) / 2, accuracy 1/2.
    loss, acc = reward_model_loss(torch.tensor([2.0, 0.0, 1.0, 1.0]), "pairwise")
    want = (-math.log(1 / (1 + math.exp(-1))) - math.log(1 / (1 + math.exp(1)))) / 2
    assert abs(loss.item() - want) < 1e-6 and acc.item() == 0.5
    # Pointwise: scores [0, 2], labels [1, 0]: BCE = (log 2 + log(1 + e^2)) / 2; both wrong -> accuracy 0.
    loss, acc = reward_model_loss(torch.tensor([0.0, 2.0]), "pointwise", torch.tensor([1.0, 0.0]))
    assert abs(loss.item() - (math.log(2) + math.log(1 + math.exp(2))) / 2) < 1e-6 and acc.item() == 0.0


def test_formats_and_bad_rows():
    kind, ex = rm_examples([{"prompt": "p", "chosen": "a", "rejected": "b"}])
    assert kind == "pairwise" and ex[0].chosen == "a"
    kind, ex = rm_examples([{"prompt": "p", "completion": "a", "label": True}])
    assert kind == "pointwise" and ex[0].label == 1.0
    with pytest.raises(ValueError, match="cannot tell"):
        rm_examples([{"prompt": "p", "answer": "a"}])
    with pytest.raises(ValueError, match="label 3"):
        rm_examples([{"prompt": "p", "completion": "a", "label": 3}])
    with pytest.raises(ValueError, match="no 'prompt' column"):
        rm_examples([{"question": "p", "chosen": "a", "rejected": "b"}])
    with pytest.raises(ValueError, match="row 1: 'chosen' is None; every row needs a text"):
        rm_examples(
            [
                {"prompt": "p", "chosen": "a", "rejected": "b"},
                {"prompt": "q", "chosen": None, "rejected": "b"},
            ]
        )
    with pytest.raises(ValueError, match="row 0: 'completion' is 5; every row needs a text"):
        rm_examples([{"prompt": "p", "label": 1, "completion": 5}])


def test_batches_are_deterministic_and_cover_each_epoch():
    a = [batch_indices(10, 4, s, seed=3) for s in range(5)]
    assert a == [batch_indices(10, 4, s, seed=3) for s in range(5)]
    flat = sum(a, [])
    assert sorted(flat[:10]) == list(range(10))  # the first epoch, then the second one starts
    assert sorted(flat[10:20]) == list(range(10))


def _pairs(path, n, seed):
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        good, bad = str(a + b), str(a + b + rng.choice([-2, -1, 1, 2]))
        rows.append({"prompt": f"{a}+{b}=", "chosen": good + "1", "rejected": bad + "0"})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_cohort_rm_learns_resumes_exactly_and_scores_as_a_reward(tiny_model_dir, tmp_path, capsys):
    data = _pairs(tmp_path / "pairs.jsonl", 120, 0)
    base = ["rm", "--model", str(tiny_model_dir), "--data", str(data), "--batch-size", "8", "--lr", "3e-3"]
    assert (
        cli.main(
            [*base, "--steps", "40", "--eval-every", "20", "--save-every", "20", "--out", str(tmp_path / "a")]
        )
        == 0
    )
    evals = [json.loads(x) for x in (tmp_path / "a" / "evals.jsonl").read_text().splitlines()]
    assert evals[0]["step"] == 0 and evals[-1]["step"] == 40
    assert evals[-1]["accuracy"] >= 0.9 and evals[-1]["loss"] < 0.2 * evals[0]["loss"]
    assert (tmp_path / "a" / "report.html").is_file()

    # Stopped at step 20 and resumed: the same weights as the uninterrupted run.
    out_b = str(tmp_path / "b")
    assert cli.main([*base, "--steps", "20", "--eval-every", "20", "--save-every", "20", "--out", out_b]) == 0
    assert cli.main([*base, "--steps", "40", "--eval-every", "20", "--save-every", "20", "--out", out_b]) == 0
    from safetensors.torch import load_file

    wa = load_file(str(tmp_path / "a" / "model" / "model.safetensors"))
    wb = load_file(str(tmp_path / "b" / "model" / "model.safetensors"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    steps = [json.loads(x)["step"] for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 41))  # no step logged twice
    # Rerun on the same folder with another learning rate: it would resume and drop the new value; refused.
    other = [a if a != "3e-3" else "1e-3" for a in base]
    assert cli.main([*other, "--steps", "60", "--out", out_b]) == 2
    err = capsys.readouterr().err
    assert "trained with other settings (lr: 0.003 -> 0.001)" in err and "pass another --out" in err, err

    reward = resolve_reward_funcs([str(tmp_path / "a" / "model")])[0]
    scores = reward(prompts=["3+4=", "3+4="], completions=["71", "80"])
    assert scores[0] > scores[1]


@pytest.mark.parametrize(
    "over, fragment",
    [
        ({"model": ""}, "needs --model"),
        ({"steps": 0}, "steps=0 must be >= 1"),
        ({"lr": 0.0}, "lr=0.0 must be a positive number"),
        ({"eval_fraction": 1.0}, r"eval_fraction=1.0 must be in \(0, 1\)"),
    ],
)
def test_bad_rm_settings(over, fragment):
    from cohort.errors import ConfigError

    cfg = RMConfig(model="m", data="d.jsonl")
    for k, v in over.items():
        setattr(cfg, k, v)
    with pytest.raises(ConfigError, match=fragment):
        cfg.validate()


def test_rm_cli_errors_before_loading(tmp_path, capsys):
    assert (
        cli.main(["rm", "--model", "m", "--data", str(tmp_path / "none.jsonl"), "--out", str(tmp_path / "o")])
        == 2
    )
    assert "does not exist" in capsys.readouterr().err
    rows = tmp_path / "bad.jsonl"
    rows.write_text(json.dumps({"prompt": "p", "text": "x"}) + "\n")
    with pytest.raises(ValueError, match="cannot tell"):
        train_reward_model(RMConfig(model="m", data=str(rows), out_dir=str(tmp_path / "o2")))


def test_rm_checks_its_model_as_the_other_commands_do(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pairs.jsonl").write_text(
        (json.dumps({"prompt": "p", "chosen": "a", "rejected": "b"}) + "\n") * 2
    )
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "pairs.jsonl").write_text("")
    (tmp_path / "run" / "final").mkdir(parents=True)  # a `cohort train` run directory
    (tmp_path / "run" / "metrics.jsonl").write_text("")
    (tmp_path / "run" / "final" / "config.json").write_text("{}")
    expected = {
        "data": "folder 'data' exists but holds no tokenizer_config.json; pass a folder written by save_pretrained",
        "run": "; run is a cohort run directory: its trained model is run/final",
        "./missing": "'./missing' is neither a local model folder nor a model that could be downloaded",
        "no-such-model": "'no-such-model' is neither a local model folder nor a model that could be downloaded",
    }

    def offline(*args, **kwargs):  # what transformers raises for a Hub name on a machine without the Hub
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files")

    monkeypatch.setattr("transformers.AutoTokenizer.from_pretrained", offline)
    for model, fragment in expected.items():
        out = f"out-{model.strip('./')}"
        assert cli.main(["rm", "--model", model, "--data", "pairs.jsonl", "--out", out]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and fragment in err, err
        assert "sentencepiece" not in err and "\n" not in err
        # a local path is refused before the data loads or the run directory is made
        assert (tmp_path / out).exists() == (model == "no-such-model")


def test_empty_reward_model_data_says_what_it_was_for(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "pairs.jsonl").write_text(json.dumps({"prompt": "p", "chosen": "a", "rejected": "b"}) + "\n")
    with pytest.raises(
        ValueError, match="it has no rows; a reward model needs at least one example to train on"
    ):
        train_reward_model(
            RMConfig(model="m", data=str(tmp_path / "empty.jsonl"), out_dir=str(tmp_path / "o"))
        )
    cfg = RMConfig(model="m", data=str(tmp_path / "pairs.jsonl"), eval_data=str(tmp_path / "empty.jsonl"))
    cfg.out_dir = str(tmp_path / "o2")
    with pytest.raises(ValueError, match=r"held-out evaluation \(--eval-data\) needs at least one example"):
        train_reward_model(cfg)


def test_the_optimizer_section_its_aliases_and_older_checkpoints(tmp_path):
    import dataclasses

    from cohort.commands.rm import _check_same_run
    from cohort.config import OptimConfig
    from cohort.errors import ConfigError

    cfg = RMConfig(model="m", data="d.jsonl", lr=3e-3, warmup_steps=2)
    assert cfg.optim == OptimConfig(lr=3e-3, warmup_steps=2, adam_beta2=0.999)
    assert (cfg.lr, cfg.warmup_steps, cfg.weight_decay, cfg.max_grad_norm) == (3e-3, 2, 0.0, 1.0)
    # The config an older cohort recorded in its checkpoints held the optimizer's settings flat.
    old = {k: v for k, v in dataclasses.asdict(cfg).items() if k != "optim"}
    old.update(lr=3e-3, warmup_steps=2, weight_decay=0.0, max_grad_norm=1.0)
    _check_same_run(cfg, old, tmp_path)  # the same run: resumes
    cfg.optim.adam_beta2 = 0.99
    with pytest.raises(ConfigError, match=r"other settings \(adam_beta2: 0.999 -> 0.99\)"):
        _check_same_run(cfg, old, tmp_path)
    with pytest.raises(ConfigError, match=r"schedule='cosinus' is not valid"):
        RMConfig(model="m", data="d.jsonl", optim=OptimConfig(schedule="cosinus")).validate()
