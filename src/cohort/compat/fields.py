"""TRL's GRPOConfig field names and the cohort key each one sets: the table `cohort.compat.drop_in` maps TRL
arguments with, and that `cohort.config` reads to answer a TRL name given as a config key.

Data only (it imports nothing from cohort), so the config can read it without importing `cohort.compat.drop_in`,
which builds on the config; `cohort.compat.drop_in` re-exports both names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["ANY_VALUE", "TRL_FIELDS", "Field"]


@dataclass(frozen=True)
class Field:
    """One TRL field: its default in TRL 1.16, and the cohort key it sets (None: not implemented)."""

    default: Any
    cohort: str | None
    note: str = ""
    """For a mapped field: how the value is translated. For an unmapped one: the nearest cohort option."""
    kind: Any = None
    """The field's type as TRL declares it, where the default's own type does not say it (a None default);
    argument parsers (transformers' HfArgumentParser, TRL's TrlParser) read it."""
    any_value: bool = False
    """An unmapped field accepted at any value: cohort behaves as its note says whatever the value."""


TRL_FIELDS: dict[str, Field] = {
    # where the run goes and how long it lasts
    "output_dir": Field(None, "out_dir", kind=str | None),
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
        kind=int | None,
    ),
    "generation_batch_size": Field(
        None,
        "rollout.batch_size",
        "completions per generation batch over all processes: steps_per_generation = this / "
        "(per_device_train_batch_size x processes)",
        kind=int | None,
    ),
    "num_generations": Field(8, "rollout.group_size"),
    # multi-turn episodes (tools= and environment_factory= are GRPOTrainer keywords)
    "max_tool_calling_iterations": Field(None, "episodes.max_tool_calling_iterations", kind=int | None),
    # sampling
    "max_completion_length": Field(512, "rollout.max_completion_length"),
    "max_prompt_length": Field(
        None,
        "data.max_prompt_length",
        "not in TRL 1.16 (an earlier TRL's or transformers' field, kept for older scripts): longer prompts are left out (counted), not truncated",
        kind=int | None,
    ),
    "temperature": Field(1.0, "rollout.temperature"),
    "top_p": Field(1.0, "rollout.top_p"),
    "top_k": Field(0, "rollout.top_k", "None means 0 (off)"),
    "chat_template_kwargs": Field(None, "data.chat_template_kwargs", kind=dict | str | None),
    # the objective
    "loss_type": Field("dapo", "algo.loss_type"),
    "beta": Field(0.0, "algo.beta"),
    "epsilon": Field(0.2, "algo.eps_low"),
    "epsilon_high": Field(
        None, "algo.eps_high", "with loss_type='cispo': algo.loss_kwargs.max_ratio", kind=float | None
    ),
    "sapo_temperature_pos": Field(1.0, "algo.loss_kwargs", "tau_pos of loss_type='sapo'"),
    "sapo_temperature_neg": Field(1.05, "algo.loss_kwargs", "tau_neg of loss_type='sapo'"),
    "vespo_k_pos": Field(2.0, "algo.loss_kwargs", "k_pos of loss_type='vespo'"),
    "vespo_lambda_pos": Field(3.0, "algo.loss_kwargs", "lambda_pos of loss_type='vespo'"),
    "vespo_k_neg": Field(3.0, "algo.loss_kwargs", "k_neg of loss_type='vespo'"),
    "vespo_lambda_neg": Field(2.0, "algo.loss_kwargs", "lambda_neg of loss_type='vespo'"),
    "off_policy_mask_threshold": Field(None, "algo.off_policy_mask_threshold", kind=float | None),
    "use_bias_correction_kl": Field(
        True,
        "algo.use_bias_correction_kl",
        "TRL's default True is kept when beta > 0 (cohort's own default is false); no effect at beta 0",
    ),
    "delta": Field(None, "algo.delta", kind=float | None),
    "num_iterations": Field(1, "algo.num_iterations"),
    "scale_rewards": Field("group", "algo.scale", "True -> group, False -> none"),
    "importance_sampling_level": Field("token", "algo.importance"),
    "mask_truncated_completions": Field(False, "algo.mask_truncated"),
    "reward_weights": Field(None, "reward_weights", kind=list[float] | None),
    "sync_ref_model": Field(
        False, "algo.ref_update_every", "True: copy the policy into the reference every ref_model_sync_steps"
    ),
    "ref_model_sync_steps": Field(512, "algo.ref_update_every"),
    "ref_model_mixup_alpha": Field(0.6, "algo.ref_mixup_alpha", "used with sync_ref_model=True"),
    # optimizer
    "learning_rate": Field(1e-6, "optim.lr"),
    "lr_scheduler_type": Field(
        "linear",
        "optim.schedule",
        "linear, cosine, constant_with_warmup, or constant (no warm-up, as transformers: warmup_steps is not read)",
    ),
    "warmup_steps": Field(0, "optim.warmup_steps"),
    "warmup_ratio": Field(
        0.0,
        "optim.warmup_steps",
        "not in TRL 1.16 (an earlier TRL's or transformers' field, kept for older scripts): warmup_steps = round(ratio x steps)",
    ),
    "weight_decay": Field(0.0, "optim.weight_decay"),
    "adam_beta1": Field(0.9, "optim.adam_beta1"),
    "adam_beta2": Field(0.999, "optim.adam_beta2"),
    "adam_epsilon": Field(1e-8, "optim.adam_eps"),
    "max_grad_norm": Field(1.0, "optim.max_grad_norm"),
    # model and precision
    "use_cpu": Field(False, "model.device", "True -> cpu"),
    "bf16": Field(
        None, "model.bf16_autocast", "bfloat16 autocast of the forward passes (CUDA)", kind=bool | None
    ),
    "model_init_kwargs": Field(
        None,
        "model.dtype",
        "only dtype / torch_dtype, trust_remote_code and attn_implementation",
        kind=dict | str | None,
    ),
    "trust_remote_code": Field(False, "model.trust_remote_code"),
    "disable_dropout": Field(
        False,
        None,
        "cohort always runs the policy in eval mode: dropout is off whatever this says (TRL's default leaves it on)",
        any_value=True,
    ),
    "gradient_checkpointing": Field(True, "model.gradient_checkpointing"),
    "fsdp": Field(
        None,
        "distributed.strategy",
        "'full_shard' / 'shard_grad_op' / 'hybrid_shard' (with any options) -> fsdp",
        kind=list[str] | str | None,
    ),
    "ddp_backend": Field(None, "distributed.backend", "nccl or gloo", kind=str | None),
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
    "save_total_limit": Field(None, "keep_checkpoints", "None: every checkpoint is kept", kind=int | None),
    "eval_strategy": Field("no", "eval_every", "'steps' with eval_steps -> eval_every"),
    "eval_steps": Field(
        None,
        "eval_every",
        "optimizer steps (rounded up to whole generation batches); None: logging_steps",
        kind=float | None,
    ),
    "per_device_eval_batch_size": Field(
        8, "eval_batch_size", "completions generated at once when evaluating"
    ),
    "metric_for_best_model": Field(
        None,
        "state.best_metric",
        "trainer.state.best_metric tracks it (EarlyStoppingCallback reads it)",
        kind=str | None,
    ),
    "greater_is_better": Field(
        None, "state.best_metric", "None: True unless the metric name ends in loss", kind=bool | None
    ),
    "load_best_model_at_end": Field(
        False, None, "not implemented: trainer.state.best_global_step names the best evaluation's step"
    ),
    "log_completions": Field(
        False, "num_samples_logged", "cohort logs num_samples_logged completions per step"
    ),
    "num_completions_to_print": Field(None, "num_samples_logged", kind=int | None),
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
        False,
        None,
        "not in TRL 1.16 (an earlier TRL's or transformers' field, kept for older scripts): cohort's chunked LM head (fast.chunked_head) bounds logits memory",
    ),
    "repetition_penalty": Field(1.0, None, "not implemented: rollout.temperature / top_p / top_k"),
    "min_p": Field(None, None, "not implemented: rollout.top_p / top_k", kind=float | None),
    "generation_kwargs": Field(
        None, None, "rollout.temperature / top_p / top_k / max_completion_length", kind=dict | str | None
    ),
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
    "remove_unused_columns": Field(
        False, None, "cohort passes every dataset column to the reward functions", any_value=True
    ),
    "do_train": Field(False, None, "no effect (in TRL either): trainer.train() trains", any_value=True),
    "overwrite_output_dir": Field(
        False,
        None,
        "not in TRL 1.16 (an earlier TRL's or transformers' field, kept for older scripts): resume=auto continues a run; another out_dir starts a new one",
    ),
    "logging_dir": Field(
        None,
        None,
        "not in TRL 1.16 (an earlier TRL's or transformers' field, kept for older scripts): out_dir/tb with report_to='tensorboard'",
        kind=str | None,
    ),
    "run_name": Field(None, None, "not implemented (W&B names the run)", kind=str | None),
    "dataloader_num_workers": Field(0, None, "not implemented: prompts are tokenized once, before training"),
    # TRL 1.16's other fields: generation back ends, logging sinks and model-specific switches cohort has no
    # counterpart for, accepted at TRL's default
    "num_generations_eval": Field(
        None, None, "evaluation samples rollout.group_size completions per prompt", kind=int | None
    ),
    "router_aux_loss_coef": Field(
        None, None, "not implemented (mixture-of-experts router loss)", kind=float | None
    ),
    "cast_lm_head_to_fp32": Field(
        False, None, "the LM head's log-probs are computed in float32 (fast.chunked_head)"
    ),
    "ds3_gather_for_generation": Field(True, None, "DeepSpeed is not used: distributed.strategy=fsdp"),
    "pad_to_multiple_of": Field(
        "auto", None, "cohort lays rows out by its own fast paths", kind=int | str | None
    ),
    "cache_implementation": Field(
        None, None, "the builtin engine's own KV cache (fast.preallocated_kv)", kind=str | None
    ),
    "vllm_mode": Field(
        "colocate",
        None,
        "rollout.engine=vllm with rollout.workers (docs/vllm.md): a separate worker, as TRL's server mode",
    ),
    "vllm_model_impl": Field("vllm", None, "rollout.engine=vllm with rollout.workers (docs/vllm.md)"),
    "vllm_enable_sleep_mode": Field(False, None, "rollout.engine=vllm with rollout.workers (docs/vllm.md)"),
    "vllm_structured_outputs_regex": Field(None, None, "not implemented", kind=str | None),
    "vllm_server_base_url": Field(None, None, "rollout.workers: the workers' addresses", kind=str | None),
    "vllm_server_host": Field("0.0.0.0", None, "rollout.workers: the workers' addresses"),
    "vllm_server_port": Field(8000, None, "rollout.workers: the workers' addresses"),
    "vllm_server_timeout": Field(240.0, None, "rollout.connect_timeout"),
    "vllm_group_port": Field(51216, None, "rollout.engine=vllm with rollout.workers (docs/vllm.md)"),
    "vllm_gpu_memory_utilization": Field(0.3, None, "cohort serve --engine vllm --gpu-memory-utilization"),
    "vllm_max_model_length": Field(
        None, None, "rollout.engine=vllm with rollout.workers (docs/vllm.md)", kind=int | None
    ),
    "vllm_tensor_parallel_size": Field(1, None, "rollout.engine=vllm with rollout.workers (docs/vllm.md)"),
    "vllm_importance_sampling_correction": Field(True, None, "algo.sampler_correction"),
    "vllm_importance_sampling_mode": Field("sequence_mask", None, "algo.sampler_correction"),
    "vllm_importance_sampling_clip_max": Field(3.0, None, "algo.sampler_correction", kind=float | None),
    "vllm_importance_sampling_clip_min": Field(None, None, "algo.sampler_correction", kind=float | None),
    "vllm_importance_sampling_cap": Field(None, None, "algo.sampler_correction", kind=float | None),
    "log_multimodal": Field(True, None, "cohort trains text models"),
    "log_unique_prompts": Field(False, None, "num_samples_logged groups per step in samples.jsonl"),
    "log_completions_hub_repo": Field(
        None, None, "not implemented: samples.jsonl in out_dir", kind=str | None
    ),
    "use_transformers_continuous_batching": Field(
        False, None, "rollout.engine=builtin (cohort's own engine)"
    ),
    "transformers_continuous_batching_config": Field(
        None, None, "rollout.engine=builtin", kind=dict | str | None
    ),
    "use_transformers_paged": Field(False, None, "rollout.engine=builtin (cohort's own engine)"),
}
"""TRL 1.16's GRPOConfig fields that cohort knows: mapped (cohort key set) or not (the note names the nearest
cohort option). Any other name is refused with the closest names."""


ANY_VALUE: dict[str, str] = {
    "log_level": "cohort's own messages are printed on the main process",
    "log_level_replica": "cohort's own messages are printed on the main process",
    "log_on_each_node": "cohort's own messages are printed on the main process",
    "disable_tqdm": "True turns the progress bar off (progress=false)",
    "ddp_find_unused_parameters": "cohort reduces gradients itself (no DistributedDataParallel wrapper)",
    "ddp_bucket_cap_mb": "cohort reduces gradients itself (no DistributedDataParallel wrapper)",
    "ddp_broadcast_buffers": "cohort reduces gradients itself (no DistributedDataParallel wrapper)",
    "dataloader_pin_memory": "no DataLoader: prompts are tokenized once, before training",
    "dataloader_persistent_workers": "no DataLoader: prompts are tokenized once, before training",
    "dataloader_prefetch_factor": "no DataLoader: prompts are tokenized once, before training",
    "hub_model_id": "read with push_to_hub only, which cohort does not implement",
    "hub_strategy": "read with push_to_hub only, which cohort does not implement",
    "hub_token": "read with push_to_hub only, which cohort does not implement",
    "hub_private_repo": "read with push_to_hub only, which cohort does not implement",
    "hub_always_push": "read with push_to_hub only, which cohort does not implement",
    "hub_revision": "read with push_to_hub only, which cohort does not implement",
    "skip_memory_metrics": "cohort reports peak memory in summary.json either way",
    "do_eval": "no effect (in TRL either): eval_strategy decides",
    "do_predict": "no effect (in TRL either)",
}
"""transformers TrainingArguments fields that are not in TRL_FIELDS and that cohort accepts at any value, with why:
they change nothing cohort does (or, disable_tqdm, map as said). Every other TrainingArguments field is accepted at
its default only."""
