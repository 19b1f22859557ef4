"""TRL's trainer contract beyond the config: optimizer-step counting, callbacks with TrainerState and
TrainerControl, evaluation with TRL's eval_* keys, train(resume_from_checkpoint=...), log_history's rows,
and entropy regularisation, each as a TRL script would use it (the import changed, a local tiny model)."""

from __future__ import annotations

import pytest
import torch
from transformers import EarlyStoppingCallback, TrainerCallback

from cohort import GRPOConfig, GRPOTrainer
from cohort.errors import ConfigError

datasets = pytest.importorskip("datasets")


def _args(tmp_path, **extra) -> GRPOConfig:
    fields = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=6,
        max_steps=2,
        learning_rate=1e-2,
        logging_steps=1,
        use_cpu=True,
    )
    fields.update(extra)
    return GRPOConfig(**fields)


def _rows(n: int = 16):
    return datasets.Dataset.from_list([{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(n)])


def reward_len(completions, **kwargs):
    return [-abs(4 - len(c)) for c in completions]


def digits(completions, **kwargs):
    return [sum(ch.isdigit() for ch in c) / 6 for c in completions]


def _trainer(model_dir, tmp_path, callbacks=None, eval_dataset=None, **extra) -> GRPOTrainer:
    return GRPOTrainer(
        model=str(model_dir),
        reward_funcs=[reward_len, digits],
        args=_args(tmp_path, **extra),
        train_dataset=_rows(),
        eval_dataset=eval_dataset,
        callbacks=callbacks,
    )


class Recorder(TrainerCallback):
    """Records every event with the global step it saw."""

    def __init__(self):
        self.events: list[tuple[str, int]] = []
        self.logs: list[dict] = []
        self.metrics: list[dict] = []

    def _note(self, name, state):
        self.events.append((name, state.global_step))

    def on_train_begin(self, args, state, control, **kw):
        assert kw["model"] is not None and kw["optimizer"] is not None and kw["processing_class"] is not None
        self._note("train_begin", state)

    def on_step_begin(self, args, state, control, **kw):
        self._note("step_begin", state)

    def on_step_end(self, args, state, control, **kw):
        self._note("step_end", state)

    def on_log(self, args, state, control, logs=None, **kw):
        self._note("log", state)
        self.logs.append(dict(logs))

    def on_evaluate(self, args, state, control, metrics=None, **kw):
        self._note("evaluate", state)
        self.metrics.append(dict(metrics))

    def on_save(self, args, state, control, **kw):
        self._note("save", state)

    def on_train_end(self, args, state, control, **kw):
        self._note("train_end", state)


def _optimizer_steps(trainer) -> int:
    return max(int(s["step"]) for s in trainer.optimizer.state.values())


# ------------------------------------------------------------------ step counting
def test_num_iterations_counts_optimizer_steps_as_trl(tiny_model_dir, tmp_path):
    trainer = _trainer(tiny_model_dir, tmp_path, num_iterations=2, max_steps=2)
    assert trainer.cfg.steps == 1 and trainer.state.max_steps == 2
    trainer.train()
    # One generation batch, two optimizer steps on it: TRL's max_steps=2 with num_iterations=2.
    assert _optimizer_steps(trainer) == 2 and trainer.state.global_step == 2
    lines = (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 1


@pytest.mark.parametrize(
    ("extra", "minibatches", "batch"),
    [
        (dict(steps_per_generation=2), 2, 16),  # two optimizer steps of 8 completions per generation
        (dict(generation_batch_size=16), 2, 16),
        (dict(gradient_accumulation_steps=2), 1, 16),  # one optimizer step of 16
        (dict(gradient_accumulation_steps=2, steps_per_generation=4), 2, 32),
    ],
)
def test_steps_per_generation_and_generation_batch_size_map_to_minibatches(extra, minibatches, batch):
    cfg = GRPOConfig(
        output_dir="o", per_device_train_batch_size=8, num_generations=4, max_steps=4, **extra
    ).to_train_config("m", 64)
    assert (cfg.algo.num_minibatches, cfg.rollout.batch_size) == (minibatches, batch)
    assert cfg.steps == 4 // minibatches  # generation batches: each makes `minibatches` optimizer steps


def test_steps_per_generation_trains_that_many_optimizer_steps_per_generation(tiny_model_dir, tmp_path):
    trainer = _trainer(tiny_model_dir, tmp_path, steps_per_generation=2, max_steps=4)
    trainer.train()
    assert _optimizer_steps(trainer) == 4 and trainer.state.global_step == 4
    assert len((tmp_path / "out" / "metrics.jsonl").read_text().splitlines()) == 2


def test_logging_save_and_warmup_count_optimizer_steps(tmp_path):
    cfg = GRPOConfig(
        output_dir="o",
        num_generations=4,
        num_iterations=2,
        max_steps=8,
        save_steps=4,
        logging_steps=2,
        warmup_ratio=0.25,
    ).to_train_config("m", 64)
    assert (cfg.steps, cfg.save_every, cfg.logging_steps) == (4, 2, 1)
    assert cfg.optim.warmup_steps == 2  # optimizer steps, as the scheduler counts
    # An interval that is not a whole number of generation batches acts at the next one.
    odd = GRPOConfig(output_dir="o", num_generations=4, num_iterations=2, max_steps=8, save_steps=3)
    assert odd.to_train_config("m", 64).save_every == 2


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (dict(num_iterations=2, max_steps=3), "multiple of 2"),
        (dict(steps_per_generation=2, generation_batch_size=16), "not both"),
        (dict(generation_batch_size=12), "multiple of per_device_train_batch_size"),
        (
            dict(gradient_accumulation_steps=2, steps_per_generation=3),
            "multiple of gradient_accumulation_steps",
        ),
        (dict(per_device_train_batch_size=2, steps_per_generation=2), "whole number of groups"),
    ],
)
def test_step_counting_that_cohort_cannot_match_is_refused(extra, match):
    fields = dict(output_dir="o", per_device_train_batch_size=8, num_generations=4, max_steps=4)
    fields.update(extra)
    with pytest.raises(ConfigError, match=match):
        GRPOConfig(**fields).to_train_config("m", 64)


def test_epochs_round_up_to_whole_generation_batches():
    args = GRPOConfig(
        output_dir="o",
        per_device_train_batch_size=8,
        num_generations=4,
        num_iterations=2,
        num_train_epochs=1.5,
    )
    # 10 rows, 2 prompts per generation batch: 5 batches an epoch (TRL drops none here), 2 optimizer steps each
    cfg = args.to_train_config("m", 10)
    assert cfg.steps == 8  # ceil(1.5 x 5 x 2 = 15 optimizer steps) rounded up to 16, as 8 generation batches


# ------------------------------------------------------------------ callbacks and log_history
def test_callbacks_see_transformers_events_with_optimizer_steps(tiny_model_dir, tmp_path):
    recorder = Recorder()
    trainer = _trainer(
        tiny_model_dir, tmp_path, callbacks=[recorder], num_iterations=2, max_steps=4, logging_steps=2
    )
    trainer.train()
    names = [e for e, _ in recorder.events]
    assert names[0] == "train_begin" and names[-1] == "train_end"
    assert [s for e, s in recorder.events if e == "step_end"] == [2, 4]
    assert [s for e, s in recorder.events if e == "log"] == [2, 4, 4]  # two rows and the summary
    assert recorder.logs[-1].keys() >= {"train_runtime", "train_loss"}
    assert [r["step"] for r in trainer.state.log_history] == [2, 4, 4]
    assert trainer.state.log_history[0]["epoch"] > 0


def test_a_callback_class_is_instantiated_and_a_bad_one_refused(tiny_model_dir, tmp_path):
    trainer = _trainer(tiny_model_dir, tmp_path, callbacks=[Recorder])
    assert isinstance(trainer.callbacks.callbacks[0], Recorder)
    with pytest.raises(ConfigError, match="TrainerCallback"):
        _trainer(tiny_model_dir, tmp_path / "b", callbacks=[object()])


class StopAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kw):
        if state.global_step >= self.step:
            control.should_training_stop = True


class SaveAt(TrainerCallback):
    def on_step_end(self, args, state, control, **kw):
        if state.global_step == 1:
            control.should_save = True


def test_a_callback_can_stop_training_and_force_a_save(tiny_model_dir, tmp_path):
    trainer = _trainer(tiny_model_dir, tmp_path, callbacks=[StopAt(2), SaveAt()], max_steps=5, save_steps=100)
    summary = trainer.train()
    assert trainer.state.global_step == 2 and summary["steps"] == 2
    ckpts = sorted(p.name for p in (tmp_path / "out" / "checkpoints").iterdir())
    assert ckpts == ["step-1", "step-2"]  # forced at 1, the final one at 2


def test_resume_continues_log_history_as_the_uninterrupted_run(tiny_model_dir, tmp_path):
    whole = _trainer(tiny_model_dir, tmp_path / "a", max_steps=4)
    whole.train()
    first = _trainer(tiny_model_dir, tmp_path / "b", callbacks=[StopAt(2)], max_steps=4)
    first.train()
    with pytest.raises(ConfigError, match=r"trainer.train\(resume_from_checkpoint=True\)"):
        _trainer(tiny_model_dir, tmp_path / "b", max_steps=4).train()
    again = _trainer(tiny_model_dir, tmp_path / "b", max_steps=4)
    again.train(resume_from_checkpoint=True)
    a, b = whole.state.log_history, again.state.log_history
    assert [r["step"] for r in b] == [r["step"] for r in a] == [1, 2, 3, 4, 4]
    for x, y in zip(a[:-1], b[:-1]):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5, abs=1e-7)
        assert y["learning_rate"] == pytest.approx(x["learning_rate"])


def test_resume_from_a_named_checkpoint_and_the_bad_forms(tiny_model_dir, tmp_path):
    _trainer(tiny_model_dir, tmp_path, callbacks=[StopAt(1)], max_steps=3).train()
    with pytest.raises(ConfigError, match="no checkpoint"):
        _trainer(tiny_model_dir, tmp_path / "empty", max_steps=3).train(resume_from_checkpoint=True)
    with pytest.raises(ConfigError, match="step-1"):
        _trainer(tiny_model_dir, tmp_path, max_steps=3).train(
            resume_from_checkpoint=str(tmp_path / "nowhere")
        )
    with pytest.raises(ConfigError, match="trial"):
        _trainer(tiny_model_dir, tmp_path, max_steps=3).train(trial={"lr": 1})
    trainer = _trainer(tiny_model_dir, tmp_path, max_steps=3)
    trainer.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-1"))  # TRL's folder name
    assert trainer.state.global_step == 3
    assert [r["step"] for r in trainer.state.log_history][:1] == [1]


def test_trls_checkpoint_number_is_its_global_step(tiny_model_dir, tmp_path):
    """With two optimizer steps a generation batch, TRL's checkpoint-4 is the state after global step 4: cohort's
    step 2; an odd number names no checkpoint, and the refusal lists them under both names."""
    _trainer(tiny_model_dir, tmp_path, num_iterations=2, max_steps=6, save_steps=2).train()
    with pytest.raises(ConfigError, match=r"multiple of 2; .*step-2 \(TRL's checkpoint-4\)"):
        _trainer(tiny_model_dir, tmp_path, num_iterations=2, max_steps=8).train(
            resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-3")
        )
    trainer = _trainer(tiny_model_dir, tmp_path, num_iterations=2, max_steps=8)
    trainer.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-4"))
    assert trainer.state.global_step == 8
    # the history up to global step 4 from the checkpoint, then this run's (the first run's step 6 is not kept)
    assert [r["step"] for r in trainer.state.log_history if "loss" in r] == [2, 4, 6, 8]


# ------------------------------------------------------------------ evaluation
def test_evaluate_returns_trl_keys_besides_accuracy(tiny_model_dir, tmp_path):
    trainer = _trainer(tiny_model_dir, tmp_path, eval_dataset=_rows(4), per_device_eval_batch_size=8)
    metrics = trainer.evaluate()
    assert {"accuracy", "n"} <= set(metrics)
    expected = {
        "eval_loss",
        "eval_reward",
        "eval_reward_std",
        "eval_rewards/reward_len/mean",
        "eval_rewards/digits/std",
        "eval_completions/mean_length",
        "eval_completions/clipped_ratio",
        "eval_frac_reward_zero_std",
        "eval_entropy",
        "eval_runtime",
        "eval_samples_per_second",
        "eval_steps_per_second",
    }
    assert expected <= set(metrics)
    assert "eval_kl" not in metrics  # beta = 0
    assert metrics["eval_samples_per_second"] == pytest.approx(16 / metrics["eval_runtime"])
    assert metrics["eval_steps_per_second"] == pytest.approx(
        2 / metrics["eval_runtime"]
    )  # 8 completions a call
    assert metrics["eval_reward"] == pytest.approx(
        metrics["eval_rewards/reward_len/mean"] + metrics["eval_rewards/digits/mean"], abs=1e-5
    )


def test_eval_steps_log_eval_rows_and_early_stopping_stops(tiny_model_dir, tmp_path):
    recorder = Recorder()
    stopper = EarlyStoppingCallback(early_stopping_patience=1, early_stopping_threshold=1e9)
    trainer = _trainer(
        tiny_model_dir,
        tmp_path,
        callbacks=[recorder, stopper],
        eval_dataset=_rows(4),
        eval_strategy="steps",
        eval_steps=1,
        max_steps=5,
        metric_for_best_model="reward",
    )
    trainer.train()
    # The first evaluation sets the best; the second cannot beat it by 1e9: patience 1 stops the run there.
    assert trainer.state.global_step == 2
    evals = [r for r in trainer.state.log_history if "eval_reward" in r]
    assert [r["step"] for r in evals] == [1, 2]
    assert "eval_accuracy" in evals[0] and "eval_loss" in evals[0]
    assert [s for e, s in recorder.events if e == "evaluate"] == [1, 2]
    best = max(r["eval_reward"] for r in evals)  # greater is better for a reward (TRL's default)
    assert trainer.state.best_metric == best
    assert trainer.state.best_global_step == next(r["step"] for r in evals if r["eval_reward"] == best)
    with pytest.raises(ConfigError, match="unknown GRPOConfig field 'eval_stepz'"):
        GRPOConfig(output_dir="o", eval_stepz=3)


def test_eval_steps_evaluate_after_every_step_including_the_last(tiny_model_dir, tmp_path):
    recorder = Recorder()
    trainer = _trainer(
        tiny_model_dir,
        tmp_path,
        callbacks=[recorder],
        eval_dataset=_rows(4),
        eval_strategy="steps",
        eval_steps=1,
        max_steps=2,
    )
    trainer.train()
    # TRL evaluates after step 1 and after step 2, the last one too, and only then.
    evals = [r for r in trainer.state.log_history if "eval_reward" in r]
    assert [r["step"] for r in evals] == [1, 2]
    assert [s for e, s in recorder.events if e == "evaluate"] == [1, 2]
    assert recorder.events.index(("evaluate", 2)) < recorder.events.index(("train_end", 2))


# ------------------------------------------------------------------ entropy regularisation
def test_entropy_regularisation_from_trl_fields(tiny_model_dir, tmp_path):
    trainer = _trainer(
        tiny_model_dir,
        tmp_path,
        entropy_coef=0.05,
        use_adaptive_entropy=True,
        entropy_target=100.0,
        entropy_coef_delta=0.01,
    )
    assert trainer.cfg.algo.entropy_coef == 0.05 and trainer.cfg.algo.adaptive_entropy
    trainer.train()
    coefs = [r["entropy_coef"] for r in trainer.state.log_history if "entropy_coef" in r]
    assert coefs == pytest.approx([0.06, 0.07])  # entropy below the target: up by delta each optimizer step
    state = torch.load(tmp_path / "out" / "checkpoints" / "step-2" / "trainer_state.pt", weights_only=True)
    assert state["extra"]["entropy"]["coef"] == pytest.approx(0.07)


@pytest.mark.parametrize(
    "extra",
    [
        dict(loss_type="vespo", vespo_k_pos=1.5, off_policy_mask_threshold=0.5, beta=0.04),
        dict(loss_type="luspo", importance_sampling_level="sequence", beta=0.04, use_bias_correction_kl=True),
    ],
)
def test_trl_2026_fields_train(tiny_model_dir, tmp_path, extra):
    # Issue 40: a TRL 1.16 script with the 2026 fields runs on the drop-in (TRL's bias-corrected KL on at beta > 0).
    trainer = _trainer(tiny_model_dir, tmp_path, max_steps=1, **extra)
    assert trainer.cfg.algo.loss_type == extra["loss_type"] and trainer.cfg.algo.use_bias_correction_kl
    before = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    trainer.train()
    assert any(not torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())
