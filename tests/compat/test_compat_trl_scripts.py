"""What TRL scripts do around the trainer, with the import changed: build GRPOConfig with transformers' and TRL's
argument parsers, set fields after construction, pass TrainingArguments' fields at their defaults, read `args`
and the trainer's Trainer attributes from callbacks and the script, and read train()'s TrainOutput."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from transformers import (
    EarlyStoppingCallback,
    HfArgumentParser,
    TrainerCallback,
    TrainerControl,
    TrainerState,
)

from cohort import GRPOConfig, GRPOTrainer
from cohort.errors import ConfigError


def test_transformers_argument_parser_builds_it_from_a_command_line_and_a_yaml_file(tmp_path):
    """TRL's own scripts build their GRPOConfig this way; it needs a dataclass of every field, typed."""
    assert dataclasses.is_dataclass(GRPOConfig)
    argv = ["--output_dir", "o", "--learning_rate", "1e-5", "--num_generations", "4", "--max_steps", "2"]
    argv += [
        "--bf16",
        "false",
        "--lr_scheduler_type",
        "cosine",
        "--chat_template_kwargs",
        '{"enable_thinking": false}',
    ]
    (args,) = HfArgumentParser(GRPOConfig).parse_args_into_dataclasses(argv)
    assert isinstance(args, GRPOConfig) and args.chat_template_kwargs == {"enable_thinking": False}
    cfg = args.to_train_config("m", 64)
    assert (cfg.optim.lr, cfg.optim.schedule, cfg.rollout.group_size, cfg.steps) == (1e-5, "cosine", 4, 2)
    assert cfg.data.chat_template_kwargs == {"enable_thinking": False}
    (tmp_path / "grpo.yaml").write_text("output_dir: y\nlearning_rate: 2.0e-6\nnum_generations: 2\n")
    (from_yaml,) = HfArgumentParser(GRPOConfig).parse_yaml_file(str(tmp_path / "grpo.yaml"))
    assert (from_yaml.output_dir, from_yaml.learning_rate, from_yaml.num_generations) == ("y", 2e-6, 2)
    with pytest.raises(ConfigError, match="'repetition_penalty'|repetition_penalty=1.5"):
        HfArgumentParser(GRPOConfig).parse_args_into_dataclasses(["--repetition_penalty", "1.5"])


def test_trls_parser_builds_it_beside_trls_own_argument_classes(tmp_path, monkeypatch):
    trl = pytest.importorskip("trl")
    (tmp_path / "grpo.yaml").write_text("output_dir: z\nlearning_rate: 3.0e-6\nmodel_name_or_path: m\n")
    monkeypatch.setattr("sys.argv", ["grpo.py", "--config", str(tmp_path / "grpo.yaml"), "--max_steps", "2"])
    parser = trl.TrlParser((trl.ScriptArguments, GRPOConfig, trl.ModelConfig))
    _, args, model_args = parser.parse_args_and_config()
    assert isinstance(args, GRPOConfig) and (args.output_dir, args.max_steps) == ("z", 2)
    assert model_args.model_name_or_path == "m"


def test_a_field_set_after_construction_counts_and_is_checked_as_at_construction():
    args = GRPOConfig(output_dir="a")
    args.output_dir, args.seed, args.max_prompt_length, args.per_device_train_batch_size = "b", 3, 10, 16
    cfg = args.to_train_config("m", 64)
    assert (cfg.out_dir, cfg.seed, cfg.data.max_prompt_length, cfg.rollout.batch_size) == ("b", 3, 10, 16)
    with pytest.raises(ConfigError, match=r"GRPOConfig\(repetition_penalty=1.2\) is not implemented"):
        args.repetition_penalty = 1.2
    with pytest.raises(
        ConfigError, match="unknown GRPOConfig field 'lerning_rate': did you mean 'learning_rate'"
    ):
        args.lerning_rate = 1e-5
    args.lr_scheduler_type = "polynomial"  # a choice checked at construction is checked again when read
    with pytest.raises(ConfigError, match="choose one of linear, cosine, constant, constant_with_warmup"):
        args.to_train_config("m", 64)


def test_trainingarguments_fields_pass_at_their_default_and_where_cohort_does_the_same():
    args = GRPOConfig(
        output_dir="o",
        logging_strategy="steps",
        optim="adamw_torch",
        gradient_checkpointing_kwargs={"use_reentrant": False},
        log_level="info",
        ddp_find_unused_parameters=False,
        disable_dropout=True,  # cohort's policy never runs dropout
        disable_tqdm=True,
        eval_on_start=False,
    )
    assert args.to_train_config("m", 8).progress is False
    assert GRPOConfig(output_dir="o").to_train_config("m", 8).progress is True
    for field, value in (("logging_first_step", True), ("optim", "adafactor"), ("eval_on_start", True)):
        with pytest.raises(
            ConfigError, match=f"TrainingArguments field '{field}' is not implemented by cohort"
        ):
            GRPOConfig(output_dir="o", **{field: value})


def test_args_answers_what_callbacks_read_of_trainingarguments():
    args = GRPOConfig(
        output_dir="o", per_device_train_batch_size=4, gradient_accumulation_steps=2, use_cpu=True
    )
    assert (args.world_size, args.process_index, args.local_process_index, args.n_gpu) == (1, 0, 0, 0)
    assert args.should_save and args.should_log and str(args.device) == "cpu" and args.train_batch_size == 4
    assert (args.steps_per_generation, args.generation_batch_size) == (2, 8)  # as TRL fills them in
    assert json.loads(args.to_json_string())["learning_rate"] == 1e-6
    assert args.to_sanitized_dict()["report_to"] == "none"


@pytest.mark.parametrize(("metric", "greater"), [("reward", True), ("eval_loss", False)])
def test_early_stopping_judges_in_the_metrics_direction(metric, greater):
    """transformers' EarlyStoppingCallback compares with args.greater_is_better, which TRL derives from the
    metric's name: a reward that fell was read as progress when it stayed None."""
    args = GRPOConfig(output_dir="o", metric_for_best_model=metric)
    assert args.greater_is_better is greater
    stopper = EarlyStoppingCallback(early_stopping_patience=2)
    state, control = TrainerState(best_metric=1.0), TrainerControl()
    worse, better = (0.5, 2.0) if greater else (2.0, 0.5)
    stopper.check_metric_value(args, state, control, worse)
    assert stopper.early_stopping_patience_counter == 1
    stopper.check_metric_value(args, state, control, better)
    assert stopper.early_stopping_patience_counter == 0


def _rows(n: int = 16):
    return [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(n)]


def counted(completions, log_metric=None, **kwargs):
    log_metric("letters", float(np.mean([sum(ch.isalpha() for ch in c) for c in completions])))
    return [-abs(4 - len(c)) for c in completions]


class Seen(TrainerCallback):
    def __init__(self):
        self.rows: list[dict] = []

    def on_log(self, args, state, control, logs=None, **kw):
        self.rows.append(dict(logs))


def test_a_trl_script_around_the_trainer(tiny_model_dir, tmp_path, capsys):
    """args, processing_class, the datasets, add / pop / remove_callback, log, train()'s TrainOutput, the
    learning rate each step used, log_metric's plain name, save_metrics and save_state, and every checkpoint
    kept without a save_total_limit."""
    args = GRPOConfig(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=6,
        max_steps=4,
        learning_rate=1e-3,
        logging_steps=1,
        save_steps=1,
        use_cpu=True,
    )
    rows = _rows()
    trainer = GRPOTrainer(model=str(tiny_model_dir), reward_funcs=counted, args=args, train_dataset=rows)
    assert trainer.args is args and trainer.train_dataset is rows and trainer.eval_dataset is None
    assert trainer.processing_class is trainer.tokenizer and trainer.reward_func_names == ["counted"]
    assert (
        trainer.num_generations == 4 and trainer.is_world_process_zero() and trainer.lr_scheduler is not None
    )
    seen = Seen()
    trainer.add_callback(seen)
    trainer.add_callback(Seen)
    assert trainer.pop_callback(Seen) is seen  # the first of the class, as transformers
    trainer.remove_callback(Seen)
    assert trainer.pop_callback(Seen) is None
    trainer.add_callback(seen)
    trainer.log({"custom": 1.0})
    logged = trainer.state.log_history[-1]
    assert (logged["custom"], logged["step"]) == (
        1.0,
        0,
    ) and "epoch" in logged  # 0.0 (None on transformers 5.0)
    result = trainer.train()
    assert result.global_step == 4 and result["steps"] == 4
    assert set(result.metrics) >= {"train_runtime", "train_loss", "train_steps_per_second"}
    assert result.training_loss == result.metrics["train_loss"]
    steps = [r for r in trainer.state.log_history if "loss" in r and "train_runtime" not in r]
    # TRL logs the rate the step used: TRL's linear decay from 1e-3 over 4 steps, no warm-up
    assert [r["learning_rate"] for r in steps] == pytest.approx([1e-3, 7.5e-4, 5e-4, 2.5e-4])
    assert all("letters" in r and "rewards/counted/letters" not in r for r in steps)
    assert seen.rows[0] == {"custom": 1.0} and len(seen.rows) == len(trainer.state.log_history)
    trainer.log_metrics("train", result.metrics)
    assert "***** train metrics *****" in capsys.readouterr().out
    trainer.save_metrics("train", result.metrics)
    trainer.save_state()
    out = tmp_path / "out"
    assert json.loads((out / "all_results.json").read_text())["train_loss"] == result.training_loss
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == 4
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [f"step-{i}" for i in range(1, 5)]


def test_what_a_trl_script_may_pass_that_cohort_does_not_implement_is_named(tiny_model_dir, tmp_path):
    args = GRPOConfig(
        output_dir=str(tmp_path / "o"), per_device_train_batch_size=8, num_generations=4, max_steps=2
    )
    with pytest.raises(
        ConfigError, match=r"rollout_func=\.\.\.\) is not implemented by cohort.*environment_factory"
    ):
        GRPOTrainer(
            model=str(tiny_model_dir),
            reward_funcs=counted,
            args=args,
            train_dataset=_rows(),
            rollout_func=len,
        )
    with pytest.raises(ConfigError, match="a dict of evaluation datasets .* is not implemented by cohort"):
        GRPOTrainer(
            model=str(tiny_model_dir),
            reward_funcs=counted,
            args=args,
            train_dataset=_rows(),
            eval_dataset={"a": _rows(4), "b": _rows(4)},
        )


def test_the_schedules_follow_transformers_names():
    def schedule(**fields):
        o = GRPOConfig(output_dir="o", max_steps=8, **fields).to_train_config("m", 64).optim
        return o.schedule, o.warmup_steps

    assert schedule(lr_scheduler_type="constant_with_warmup", warmup_steps=2) == ("constant", 2)
    assert schedule(lr_scheduler_type="constant", warmup_steps=2) == (
        "constant",
        0,
    )  # transformers: no warm-up
    assert schedule(lr_scheduler_type="cosine", warmup_steps=2) == ("cosine", 2)


def test_evaluate_takes_the_trainers_signature(tiny_model_dir, tmp_path):
    args = GRPOConfig(
        output_dir=str(tmp_path / "o"),
        per_device_train_batch_size=8,
        num_generations=4,
        max_steps=2,
        use_cpu=True,
    )
    args.max_completion_length = 6
    trainer = GRPOTrainer(
        model=str(tiny_model_dir),
        reward_funcs=counted,
        args=args,
        train_dataset=_rows(),
        eval_dataset=_rows(4),
    )
    metrics = trainer.evaluate(metric_key_prefix="test")
    assert (
        "test_reward" in metrics
        and "test_loss" in metrics
        and not any(k.startswith("eval_") for k in metrics)
    )
    assert "eval_reward" in trainer.evaluate()
    with pytest.raises(ConfigError, match=r"evaluate\(eval_dataset=\.\.\.\) is not implemented by cohort"):
        trainer.evaluate(eval_dataset=_rows(4))
