"""TRL's GRPOConfig field names and the cohort key each one sets: the table `cohort.compat.drop_in` maps TRL
arguments with, and that `cohort.config` reads to answer a TRL name given as a config key.

Data only (it imports nothing from cohort), so the config can read it without importing `cohort.compat.drop_in`,
which builds on the config; `cohort.compat.drop_in` re-exports both names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["TRL_FIELDS", "Field"]


@dataclass(frozen=True)
class Field:
    """One TRL field: its default in TRL 1.16, and the cohort key it sets (None: not implemented)."""

    default: Any
    cohort: str | None
    note: str = ""
    """For a mapped field: how the value is translated. For an unmapped one: the nearest cohort option."""


TRL_FIELDS: dict[str, Field] = {
    # where the run goes and how long it lasts
    "output_dir": Field(None, "out_dir"),
    "max_steps": Field(
        -1,
        "steps",
        "optimizer steps, as TRL counts them: steps = max_steps / (optimizer steps per generation batch); -1: "
        "from num_train_epochs",
    ),
    "num_train_epochs": Field(
        3.0,
        "steps",
        "when max_steps is -1, TRL's count: ceil(epochs x floor(rows / prompts per generation batch) x optimizer "
        "steps per generation batch)",
    ),
    "seed": Field(42, "seed"),
    # batch shape
    "per_device_train_batch_size": Field(
        8,
        "rollout.batch_size",
        "completions per generation batch and process = this x steps_per_generation (whole groups on each "
        "process)",
    ),
    "gradient_accumulation_steps": Field(
        1,
        "algo.num_minibatches",
        "an optimizer step takes this x per_device_train_batch_size completions per process (cohort splits "
        "micro-batches by micro_batch_tokens)",
    ),
    "steps_per_generation": Field(
        None,
        "algo.num_minibatches",
        "None: gradient_accumulation_steps. num_minibatches = this / gradient_accumulation_steps optimizer steps "
        "per generation batch (a multiple of it)",
    ),
    "generation_batch_size": Field(
        None,
        "rollout.batch_size",
        "completions per generation batch over all processes: steps_per_generation = this / "
        "(per_device_train_batch_size x processes)",
    ),
    "num_generations": Field(8, "rollout.group_size"),
    # multi-turn episodes (tools= and environment_factory= are GRPOTrainer keywords)
    "max_tool_calling_iterations": Field(None, "episodes.max_tool_calling_iterations"),
    # sampling
    "max_completion_length": Field(512, "rollout.max_completion_length"),
    "max_prompt_length": Field(
        None, "data.max_prompt_length", "longer prompts are left out (counted), not truncated"
    ),
    "temperature": Field(1.0, "rollout.temperature"),
    "top_p": Field(1.0, "rollout.top_p"),
    "top_k": Field(0, "rollout.top_k", "None means 0 (off)"),
    "chat_template_kwargs": Field(None, "data.chat_template_kwargs"),
    # the objective
    "loss_type": Field("dapo", "algo.loss_type"),
    "beta": Field(0.0, "algo.beta"),
    "epsilon": Field(0.2, "algo.eps_low"),
    "epsilon_high": Field(None, "algo.eps_high", "with loss_type='cispo': algo.loss_kwargs.max_ratio"),
    "sapo_temperature_pos": Field(1.0, "algo.loss_kwargs", "tau_pos of loss_type='sapo'"),
    "sapo_temperature_neg": Field(1.05, "algo.loss_kwargs", "tau_neg of loss_type='sapo'"),
    "vespo_k_pos": Field(2.0, "algo.loss_kwargs", "k_pos of loss_type='vespo'"),
    "vespo_lambda_pos": Field(3.0, "algo.loss_kwargs", "lambda_pos of loss_type='vespo'"),
    "vespo_k_neg": Field(3.0, "algo.loss_kwargs", "k_neg of loss_type='vespo'"),
    "vespo_lambda_neg": Field(2.0, "algo.loss_kwargs", "lambda_neg of loss_type='vespo'"),
    "off_policy_mask_threshold": Field(None, "algo.off_policy_mask_threshold"),
    "use_bias_correction_kl": Field(
        True,
        "algo.use_bias_correction_kl",
        "TRL's default True is kept when beta > 0 (cohort's own default is false); no effect at beta 0",
    ),
    "delta": Field(None, "algo.delta"),
    "num_iterations": Field(1, "algo.num_iterations"),
    "scale_rewards": Field("group", "algo.scale", "True -> group, False -> none"),
    "importance_sampling_level": Field("token", "algo.importance"),
    "mask_truncated_completions": Field(False, "algo.mask_truncated"),
    "reward_weights": Field(None, "reward_weights"),
    "sync_ref_model": Field(
        False, "algo.ref_update_every", "True: copy the policy into the reference every ref_model_sync_steps"
    ),
    "ref_model_sync_steps": Field(512, "algo.ref_update_every"),
    "ref_model_mixup_alpha": Field(0.6, "algo.ref_mixup_alpha", "used with sync_ref_model=True"),
    # optimizer
    "learning_rate": Field(1e-6, "optim.lr"),
    "lr_scheduler_type": Field("linear", "optim.schedule", "constant, linear or cosine"),
    "warmup_steps": Field(0, "optim.warmup_steps"),
    "warmup_ratio": Field(0.0, "optim.warmup_steps", "warmup_steps = round(ratio x steps)"),
    "weight_decay": Field(0.0, "optim.weight_decay"),
    "adam_beta1": Field(0.9, "optim.adam_beta1"),
    "adam_beta2": Field(0.999, "optim.adam_beta2"),
    "adam_epsilon": Field(1e-8, "optim.adam_eps"),
    "max_grad_norm": Field(1.0, "optim.max_grad_norm"),
    # model and precision
    "use_cpu": Field(False, "model.device", "True -> cpu"),
    "bf16": Field(None, "model.bf16_autocast", "bfloat16 autocast of the forward passes (CUDA)"),
    "model_init_kwargs": Field(
        None, "model.dtype", "only dtype / torch_dtype, trust_remote_code and attn_implementation"
    ),
    "trust_remote_code": Field(False, "model.trust_remote_code"),
    "disable_dropout": Field(
        False, None, "cohort always runs the policy in eval mode: dropout is off whatever this says"
    ),
    "gradient_checkpointing": Field(True, "model.gradient_checkpointing"),
    "fsdp": Field(
        "",
        "distributed.strategy",
        "'full_shard' / 'shard_grad_op' / 'hybrid_shard' (with any options) -> fsdp",
    ),
    "ddp_backend": Field(None, "distributed.backend", "nccl or gloo"),
    # logging and saving
    "logging_steps": Field(
        10,
        "logging_steps",
        "optimizer steps between trainer.state.log_history rows (means over them) and plain progress lines (a "
        "float < 1: that fraction of max_steps); metrics.jsonl gets every generation batch",
    ),
    "report_to": Field("none", "tensorboard", "'tensorboard' and 'wandb' turn those sinks on"),
    "save_strategy": Field("steps", "save_every", "'no' -> save only at the end"),
    "save_steps": Field(500, "save_every", "optimizer steps (rounded up to whole generation batches)"),
    "save_total_limit": Field(None, "keep_checkpoints"),
    "eval_strategy": Field("no", "eval_every", "'steps' with eval_steps -> eval_every"),
    "eval_steps": Field(
        None, "eval_every", "optimizer steps (rounded up to whole generation batches); None: logging_steps"
    ),
    "per_device_eval_batch_size": Field(
        8, "eval_batch_size", "completions generated at once when evaluating"
    ),
    "metric_for_best_model": Field(
        None, "state.best_metric", "trainer.state.best_metric tracks it (EarlyStoppingCallback reads it)"
    ),
    "greater_is_better": Field(None, "state.best_metric", "None: True unless the metric name ends in loss"),
    "load_best_model_at_end": Field(
        False, None, "not implemented: trainer.state.best_global_step names the best evaluation's step"
    ),
    "log_completions": Field(
        False, "num_samples_logged", "cohort logs num_samples_logged completions per step"
    ),
    "num_completions_to_print": Field(None, "num_samples_logged"),
    "shuffle_dataset": Field(True, None, "cohort always shuffles (per epoch, seeded)"),
    # generation back ends and methods cohort does not have
    "use_vllm": Field(
        False,
        None,
        "rollout.engine=vllm with rollout.workers (`cohort serve --engine vllm`, as TRL's server mode); not run on "
        "a GPU yet (docs/vllm.md)",
    ),
    "top_entropy_quantile": Field(
        1.0, "algo.top_entropy_quantile", "must be > 0 (cohort keeps a share of tokens)"
    ),
    "entropy_coef": Field(0.0, "algo.entropy_coef"),
    "use_adaptive_entropy": Field(False, "algo.adaptive_entropy"),
    "entropy_target": Field(0.2, "algo.adaptive_entropy.target"),
    "entropy_coef_min": Field(0.0, "algo.adaptive_entropy.coef_min"),
    "entropy_coef_max": Field(1.0, "algo.adaptive_entropy.coef_max"),
    "entropy_coef_delta": Field(0.005, "algo.adaptive_entropy.delta"),
    "use_liger_loss": Field(
        False, None, "not implemented: cohort's chunked LM head (fast.chunked_head) bounds logits memory"
    ),
    "repetition_penalty": Field(1.0, None, "not implemented: rollout.temperature / top_p / top_k"),
    "min_p": Field(None, None, "not implemented: rollout.top_p / top_k"),
    "generation_kwargs": Field(None, None, "rollout.temperature / top_p / top_k / max_completion_length"),
    "multi_objective_aggregation": Field(
        "sum_then_normalize",
        "algo.reward_mode",
        "sum_then_normalize -> sum; normalize_then_sum -> decoupled (GDPO)",
    ),
    "fp16": Field(False, None, "model.dtype=float16 (no loss scaling)"),
    "torch_compile": Field(
        False,
        "fast.compile_update",
        "True -> auto: on CUDA the update's decoder forward and backward through torch.compile (cohort's decode "
        "step is a captured CUDA graph either way); False -> off",
    ),
    "push_to_hub": Field(
        False, None, "not implemented: trainer.save_model() writes a save_pretrained folder"
    ),
    "remove_unused_columns": Field(False, None, "cohort passes every dataset column to the reward functions"),
    "do_train": Field(False, None, "trainer.train()"),
    "overwrite_output_dir": Field(
        False, None, "resume=auto continues a run; another out_dir starts a new one"
    ),
    "logging_dir": Field(None, None, "out_dir/tb with report_to='tensorboard'"),
    "run_name": Field(None, None, "not implemented (W&B names the run)"),
    "dataloader_num_workers": Field(0, None, "not implemented: prompts are tokenized once, before training"),
}
"""TRL 1.16's GRPOConfig fields that cohort knows: mapped (cohort key set) or not (the note names the nearest
cohort option). Any other name is refused with the closest names."""
