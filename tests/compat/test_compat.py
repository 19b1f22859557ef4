"""TRL's GRPO usage, run on cohort with the import line changed: GRPOConfig's field names, the
GRPOTrainer(model=, reward_funcs=, args=, train_dataset=) form, and the errors for what cohort lacks.

The examples follow TRL's documented patterns (quick start, a conversational format reward, a
ground-truth column, a multi-task dataset whose rewards return None, reward weights) with two
substitutions this machine forces: a local tiny model instead of a hub id, and a `datasets.Dataset`
built in memory instead of one downloaded from the hub.
"""

from __future__ import annotations

import re

import pytest
import torch

from cohort import GRPOConfig, GRPOTrainer
from cohort.compat.drop_in import TRL_FIELDS
from cohort.errors import ConfigError

datasets = pytest.importorskip("datasets")


def _params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _changed(before, model) -> bool:
    return any(not torch.equal(before[n], p) for n, p in model.named_parameters() if n in before)


def _args(tmp_path, **extra) -> GRPOConfig:
    """Small enough for this CPU: the TRL docs' examples keep TRL's defaults for everything else."""
    return GRPOConfig(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=8,
        max_steps=2,
        learning_rate=1e-2,
        use_cpu=True,
        **extra,
    )


def _text_dataset(n: int = 16):
    return datasets.Dataset.from_list([{"prompt": f"{i}+{i}=", "ground_truth": str(2 * i)} for i in range(n)])


def test_quick_start(tiny_model_dir, tmp_path):
    def reward_len(completions, **kwargs):
        # closer to 4 characters is better
        return [-abs(4 - len(c)) for c in completions]

    trainer = GRPOTrainer(
        model=str(tiny_model_dir),
        reward_funcs=reward_len,
        args=_args(tmp_path, logging_steps=1),
        train_dataset=_text_dataset(),
    )
    before = _params(trainer.model)
    trainer.train()
    assert _changed(before, trainer.model)
    history = trainer.state.log_history
    # TRL's rows: one per logging_steps optimizer steps, then the closing summary row.
    assert [row["step"] for row in history] == [1, 2, 2] and trainer.state.global_step == 2
    for row in history[:2]:
        assert {"loss", "reward", "learning_rate", "epoch", "grad_norm", "entropy"} <= set(row)
        assert "kl" not in row  # beta = 0: TRL logs no kl
    assert history[0]["learning_rate"] > history[1]["learning_rate"]  # TRL's linear decay
    summary = history[-1]
    assert {"train_runtime", "train_samples_per_second", "train_steps_per_second", "train_loss"} <= set(
        summary
    )
    assert summary["train_steps_per_second"] == pytest.approx(2 / summary["train_runtime"])
    assert summary["train_samples_per_second"] == pytest.approx(16 / summary["train_runtime"])
    assert summary["train_loss"] == pytest.approx((history[0]["loss"] + history[1]["loss"]) / 2)
    folder = trainer.save_model()
    assert (folder / "config.json").is_file()


def test_conversational_format_reward(tiny_model_dir, tmp_path):
    def format_reward(completions, **kwargs):
        texts = [c[0]["content"] for c in completions]  # conversational: one assistant message each
        return [1.0 if re.match(r"^\d", t) else 0.0 for t in texts]

    rows = [{"prompt": [{"role": "user", "content": f"{i}+1="}]} for i in range(16)]
    trainer = GRPOTrainer(
        model=str(tiny_model_dir),
        reward_funcs=[format_reward],
        args=_args(tmp_path),
        train_dataset=datasets.Dataset.from_list(rows),
    )
    before = _params(trainer.model)
    trainer.train()
    assert _changed(before, trainer.model)


def test_ground_truth_column_multi_task_none_and_reward_weights(tiny_model_dir, tmp_path):
    def exact(completions, ground_truth, task, **kwargs):
        return [
            float(c.strip() == g) if t == "math" else None for c, g, t in zip(completions, ground_truth, task)
        ]

    def digits(completions, task, **kwargs):
        return [
            sum(ch.isdigit() for ch in c) / 8 if t == "count" else None for c, t in zip(completions, task)
        ]

    rows = [
        {"prompt": f"{i}+{i}=", "ground_truth": str(2 * i), "task": "math" if i % 2 else "count"}
        for i in range(16)
    ]
    args = _args(tmp_path, reward_weights=[2.0, 1.0])
    trainer = GRPOTrainer(
        model=str(tiny_model_dir),
        reward_funcs=[exact, digits],
        args=args,
        train_dataset=datasets.Dataset.from_list(rows),
    )
    assert trainer.reward_weights.tolist() == [2.0, 1.0]
    before = _params(trainer.model)
    trainer.train()
    assert _changed(before, trainer.model)


def test_a_model_object_with_its_tokenizer_and_a_list_dataset(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    rows = [{"prompt": f"{i}+{i}="} for i in range(16)]
    trainer = GRPOTrainer(
        model,
        lambda completions, **kw: [float(len(c)) for c in completions],
        _args(tmp_path),
        rows,
        processing_class=tokenizer,
    )
    assert trainer.model is model and trainer.tokenizer is tokenizer
    trainer.train()


def test_epochs_define_the_steps_when_max_steps_is_unset(tiny_model_dir, tmp_path):
    args = GRPOConfig(
        output_dir=str(tmp_path / "o"), per_device_train_batch_size=8, num_generations=4, num_train_epochs=2
    )
    cfg = args.to_train_config(str(tiny_model_dir), num_rows=10)
    assert cfg.steps == 10  # 2 epochs x 10 prompts / 2 prompts per step
    assert (cfg.algo.loss_type, cfg.optim.lr, cfg.optim.schedule, cfg.rollout.max_completion_length) == (
        "dapo",
        1e-6,
        "linear",
        512,
    )
    assert cfg.seed == 42 and cfg.rollout.batch_size == 8 and cfg.rollout.group_size == 4


@pytest.mark.parametrize(
    ("fields", "fragment"),
    [
        ({"lerning_rate": 1e-5}, "unknown GRPOConfig field 'lerning_rate': did you mean 'learning_rate'"),
        (
            {"use_vllm": True},
            "GRPOConfig(use_vllm=True) is not implemented by cohort; nearest: rollout.engine",
        ),
        (
            {"gradient_checkpointing_kwargs": {"use_reentrant": True}},
            "transformers' TrainingArguments field 'gradient_checkpointing_kwargs' is not implemented by cohort; "
            "leave it at its default (None)",
        ),
        ({"lr_scheduler_type": "polynomial"}, "choose one of linear, cosine, constant, constant_with_warmup"),
        ({"eval_strategy": "epoch"}, "cohort evaluates by steps ('steps') or not ('no')"),
        ({"num_generations_eval": 4}, "nearest: evaluation samples rollout.group_size completions"),
        ({"report_to": "mlflow"}, "tensorboard and wandb only"),
        ({"model_init_kwargs": {"device_map": "auto"}}, "model_init_kwargs={'device_map': ...}"),
    ],
)
def test_what_cohort_lacks_is_an_error_naming_the_nearest_option(fields, fragment):
    with pytest.raises(ConfigError) as e:
        GRPOConfig(output_dir="x", **fields).to_train_config("m", 8)
    assert fragment in str(e.value), str(e.value)


@pytest.mark.parametrize(
    ("fields", "fragment"),
    [
        (
            {"per_device_train_batch_size": 6},
            "(in GRPOConfig's terms: rollout.batch_size is set by per_device_train_batch_size or "
            "generation_batch_size; rollout.group_size is set by num_generations)",
        ),
        ({"top_p": 1.5}, "(in GRPOConfig's terms: rollout.top_p is set by top_p)"),
        ({"temperature": "hot"}, "(in GRPOConfig's terms: rollout.temperature is set by temperature)"),
    ],
)
def test_errors_of_the_trl_form_name_the_grpoconfig_fields(tiny_model_dir, tmp_path, fields, fragment):
    """The config's checks speak of cohort's keys; in TRL's form each error also names the fields that set them."""
    args = {**{"per_device_train_batch_size": 8, "num_generations": 4}, **fields}
    with pytest.raises(ConfigError) as e:
        GRPOTrainer(
            model=str(tiny_model_dir),
            reward_funcs=lambda completions, **kw: [0.0] * len(completions),
            args=GRPOConfig(output_dir=str(tmp_path), max_completion_length=8, use_cpu=True, **args),
            train_dataset=[{"prompt": "1+1="}] * 4,
        )
    assert str(e.value).endswith(fragment), str(e.value)


def test_in_trl_terms_reads_keys_as_whole_words():
    from cohort.compat.drop_in import in_trl_terms

    assert (
        in_trl_terms("set rollout.top_p to 1")
        == "set rollout.top_p to 1 (in GRPOConfig's terms: rollout.top_p is set by top_p)"
    )
    # bare keys only where given a value; a longer dotted key is not its prefix's; cohort-only keys add nothing
    assert in_trl_terms("the steps of a run; algo.adaptive_entropy.target") == (
        "the steps of a run; algo.adaptive_entropy.target (in GRPOConfig's terms: algo.adaptive_entropy.target is set "
        "by entropy_target)"
    )
    assert (
        in_trl_terms("steps=3 is below")
        == "steps=3 is below (in GRPOConfig's terms: steps is set by max_steps or num_train_epochs)"
    )
    assert in_trl_terms("fast.segments=on needs sdpa") == "fast.segments=on needs sdpa"


def test_trl_reference_sync_maps_onto_cohorts():
    cfg = GRPOConfig(output_dir="x", sync_ref_model=True, beta=0.1, ref_model_sync_steps=64).to_train_config(
        "m", 8
    )
    assert cfg.algo.ref_update_every == 64 and cfg.algo.ref_mixup_alpha == 0.6  # TRL's default mixes
    at_zero = GRPOConfig(output_dir="x", sync_ref_model=True, beta=0.0).to_train_config("m", 8)
    with pytest.raises(
        ConfigError,
        match=r"algo.ref_sync.every=512 algo.ref_sync.alpha=0.6 changes nothing in this configuration: "
        "algo.beta=0 runs no reference",
    ):
        at_zero.validate(need_data=False, reward_funcs=[len])


def test_trl_torch_compile_maps_onto_the_compiled_update():
    assert GRPOConfig(output_dir="x").to_train_config("m", 8).fast.compile_update == "off"
    on = GRPOConfig(output_dir="x", torch_compile=True).to_train_config("m", 8)
    assert on.fast.compile_update == "auto"  # CUDA only: a CPU run keeps its grouped update, uncompiled
    on.validate(need_data=False, reward_funcs=[len])
    with pytest.raises(ConfigError, match=r"GRPOConfig\(torch_compile='yes'\): give True or False"):
        GRPOConfig(output_dir="x", torch_compile="yes").to_train_config("m", 8)


def test_trl_defaults_are_accepted_unchanged():
    # A field cohort does not implement, at TRL's default, changes nothing and is accepted.
    args = GRPOConfig(output_dir="x", use_vllm=False, top_entropy_quantile=1.0, logging_steps=10)
    assert args.use_vllm is False and args.num_generations == 8
    assert all(spec.cohort is None or spec.note or spec.cohort for spec in TRL_FIELDS.values())


def test_iterable_dataset_needs_max_steps(tiny_model_dir, tmp_path):
    rows = datasets.Dataset.from_list([{"prompt": "1+1="}] * 8).to_iterable_dataset()
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4)
    with pytest.raises(ConfigError, match="needs max_steps"):
        GRPOTrainer(
            model=str(tiny_model_dir),
            reward_funcs=lambda completions, **k: [0.0] * len(completions),
            args=args,
            train_dataset=rows,
        )


def test_peft_config_trains_an_adapter(tiny_model_dir, tmp_path):
    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = GRPOTrainer(
        model=str(tiny_model_dir),
        reward_funcs=lambda completions, **k: [float(len(c)) for c in completions],
        args=_args(tmp_path),
        train_dataset=_text_dataset(),
        peft_config=lora,
    )
    trainable = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert trainer.cfg.model.lora.r == 4 and sorted(trainer.cfg.model.lora.target_modules) == [
        "q_proj",
        "v_proj",
    ]


def test_the_trl_page_holds_the_generated_mapping():
    from pathlib import Path

    from cohort.compat.drop_in import mapping_table

    page = (Path(__file__).resolve().parents[2] / "docs" / "trl.md").read_text()
    start = page.index("<!-- generated: cohort.compat.drop_in.mapping_table() -->\n") + len(
        "<!-- generated: cohort.compat.drop_in.mapping_table() -->\n"
    )
    assert page[start : page.index("<!-- end generated -->")] == mapping_table(), (
        "regenerate docs/trl.md's table"
    )


def test_config_keys_are_discoverable(capsys):
    from cohort.cli import main
    from cohort.config import describe_keys, load_config

    rows = describe_keys()
    assert len(rows) > 60 and all(doc.strip() for _, _, doc in rows), [k for k, _, d in rows if not d.strip()]
    assert main(["config", "fast.packed"]) == 0
    assert "fast.packed_weights = 'auto'" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="'learning_rate' is TRL's name; cohort's is 'optim.lr'"):
        load_config(None, ["learning_rate=1e-5"])
    with pytest.raises(ConfigError, match="did you mean 'algo.beta'"):
        load_config(None, ["algo.betta=0.1"])
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and "cohort 0.1.0" in capsys.readouterr().out


def test_a_reward_model_by_path(tiny_model_dir, tmp_path):
    """TRL's pattern reward_funcs="<reward model>": a sequence classifier with one logit, by path."""
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    from cohort.models import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
    )
    classifier = Qwen2ForSequenceClassification(config)
    with torch.no_grad():
        classifier.score.weight.normal_(0, 1.0)  # scores that differ between completions
    classifier.save_pretrained(tmp_path / "rm")
    tokenizer.save_pretrained(tmp_path / "rm")
    trainer = GRPOTrainer(
        model=str(tiny_model_dir),
        reward_funcs=str(tmp_path / "rm"),
        args=_args(tmp_path, logging_steps=1),
        train_dataset=_text_dataset(),
    )
    before = _params(trainer.model)
    trainer.train()
    assert _changed(before, trainer.model)
    assert trainer.state.log_history[0]["rewards/rm/std"] > 0


def test_the_batch_is_per_process_under_torchrun(monkeypatch):
    from cohort import GRPOConfig

    monkeypatch.setenv("WORLD_SIZE", "2")
    args = GRPOConfig(
        output_dir="o", per_device_train_batch_size=8, gradient_accumulation_steps=2, num_train_epochs=1
    )
    cfg = args.to_train_config("m", 64)
    # Each of the 2 processes samples 16 completions (2 groups of 8): 4 prompts per step over both, 64 rows.
    assert cfg.rollout.batch_size == 16 and cfg.steps == 16


def test_gradient_checkpointing_maps_and_trains(tiny_model_dir, tmp_path):
    from test_trainer import _cfg

    from cohort import GRPOConfig
    from cohort.trainer import GRPOTrainer

    assert (
        GRPOConfig(output_dir="o").to_train_config("m", 8).model.gradient_checkpointing is True
    )  # TRL's default
    assert (
        GRPOConfig(output_dir="o", gradient_checkpointing=False)
        .to_train_config("m", 8)
        .model.gradient_checkpointing
        is False
    )
    t = GRPOTrainer(_cfg(tiny_model_dir, tmp_path, **{"model.gradient_checkpointing": True, "steps": 2}))
    t.train()
    layers = [m for m in t.model.modules() if getattr(m, "gradient_checkpointing", False) is True]
    assert layers and not any(m.training for m in layers)  # checkpointed, and back in eval mode after updates


def test_trl_fsdp_and_backend_fields_map_onto_the_distributed_section(monkeypatch):
    from cohort import GRPOConfig

    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = GRPOConfig(output_dir="o", fsdp="full_shard auto_wrap", ddp_backend="gloo").to_train_config("m", 8)
    assert cfg.distributed.strategy == "fsdp" and cfg.distributed.backend == "gloo"
    assert GRPOConfig(output_dir="o").to_train_config("m", 8).distributed.strategy == "auto"
    with pytest.raises(ConfigError, match="names a sharding strategy"):
        GRPOConfig(output_dir="o", fsdp="offload").to_train_config("m", 8)
    with pytest.raises(ConfigError, match="nccl or gloo"):
        GRPOConfig(output_dir="o", ddp_backend="mpi").to_train_config("m", 8)
