"""Config: YAML + dotted overrides, presets, validation errors that name the fix."""

import warnings

import pytest

from cohort.config import ConfigError, TrainConfig, field_docs, load_config, save_config
from cohort.config.presets import PRESETS


def _valid(**over):
    base = {"model.name_or_path": "some/model", "data.task": "addition"}
    base.update(over)
    return [f"{k}={v}" for k, v in base.items()]


def test_yaml_then_overrides_win(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text(
        "model:\n  name_or_path: m\nalgo:\n  beta: 0.1\nrollout.group_size: 4\ndata: {task: addition}\n"
    )
    cfg = load_config(f, ["algo.beta=0.02", "rollout.batch_size=16"])
    assert cfg.algo.beta == 0.02
    assert cfg.rollout.group_size == 4
    assert cfg.rollout.batch_size == 16
    assert cfg.validate().prompts_per_step == 4


def test_unknown_key_suggests_the_closest_keys():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["algo.betta=0.1"])
    assert "algo.betta" in str(e.value) and "did you mean 'algo.beta'" in str(e.value)
    with pytest.raises(ConfigError, match="did you mean 'steps'"):
        load_config(None, ["stepz=3"])
    with pytest.raises(
        ConfigError, match="the keys in 'rollout' are: rollout.engine, .*`cohort config` lists all"
    ):
        load_config(None, ["rollout.qqq=3"])


def test_type_errors_are_named():
    with pytest.raises(ConfigError, match="rollout.group_size"):
        load_config(None, ["rollout.group_size=many"])
    with pytest.raises(ConfigError, match="expected true or false"):
        load_config(None, ["algo.filter_zero_std=maybe"])


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("rollout.group_size=1", "at least 2"),
        ("rollout.batch_size=30", "multiple of"),
        ("rollout.max_completion_length=0", "positive"),
        ("algo.loss_type=ppo", "grpo, bnpo, dapo, dr_grpo"),
        ("algo.scale=zscore", "group, batch, none"),
        ("rollout.engine=vllm2", "builtin, hf"),
        ("reward_weights=[1,2]", "one weight per function"),
        ("rollout.temperature=-1", "rollout.temperature must be > 0"),
        ("rollout.top_p=0", r"rollout.top_p must be in \(0, 1\]"),
        ("rollout.top_k=-1", "rollout.top_k must be an int >= 0"),
        ("rollout.weight_transport=tcp", "rollout.weight_transport='tcp' is not one of auto, gloo, nccl"),
        ("distributed.backend=mpi", "distributed.backend='mpi' is not valid"),
    ],
)
def test_validation_errors(override, fragment):
    cfg = load_config(None, _valid() + [override])
    with pytest.raises(ConfigError, match=fragment):
        cfg.validate()


def test_unknown_preset():
    with pytest.raises(ConfigError, match="r1, dapo, dr_grpo"):
        load_config(None, ["preset=grpo_max"])


def test_presets_apply_and_can_be_overridden():
    cfg = load_config(None, _valid(preset="dapo") + ["rollout.group_size=8"])
    assert cfg.algo.eps_high == 0.28 and cfg.algo.loss_type == "dapo" and cfg.algo.beta == 0.0
    assert cfg.rollout.group_size == 8  # the override beats the preset
    r1 = load_config(None, _valid(preset="r1"))
    assert (r1.rollout.group_size, r1.algo.beta, r1.optim.lr) == (16, 1e-3, 1e-6)
    dr = load_config(None, _valid(preset="dr_grpo"))
    assert dr.algo.scale == "none" and dr.algo.loss_type == "dr_grpo"
    for name in PRESETS:
        load_config(None, _valid(preset=name)).validate()


def test_no_data_and_no_model_are_errors():
    with pytest.raises(ConfigError, match="model.name_or_path"):
        TrainConfig().validate()
    with pytest.raises(ConfigError, match="data.path"):
        load_config(None, ["model.name_or_path=m"]).validate()


def test_round_trip_through_yaml(tmp_path):
    cfg = load_config(None, _valid() + ["rewards=[accuracy,format]", "reward_weights=[1.0,0.5]"])
    save_config(cfg, tmp_path / "out.yaml")
    again = load_config(tmp_path / "out.yaml")
    assert again == cfg


def test_every_field_has_a_docstring():
    import dataclasses

    from cohort import config as c

    for cls in (
        c.TrainConfig,
        c.ModelConfig,
        c.DataConfig,
        c.RolloutConfig,
        c.AlgoConfig,
        c.OptimConfig,
        c.LoraConfig,
    ):
        docs = field_docs(cls)
        missing = [f.name for f in dataclasses.fields(cls) if f.name not in docs]
        assert not missing, f"{cls.__name__} fields without docstring: {missing}"


def test_missing_config_file_is_clear(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


@pytest.mark.parametrize("bad", ["nan", ".inf", "-.inf"])
def test_non_finite_reward_weight_is_a_config_error(bad):
    cfg = load_config(None, _valid() + ["rewards=[accuracy,format]", f"reward_weights=[1.0,{bad}]"])
    with pytest.raises(ConfigError, match=r"reward_weights\[1\]=.*\(for 'format'\) is not finite"):
        cfg.validate()


def test_reward_weights_are_checked_against_the_functions_the_run_uses():
    def a(completions, **kw):
        return [0.0] * len(completions)

    def b(completions, **kw):
        return [0.0] * len(completions)

    cfg = load_config(None, _valid() + ["reward_weights=[1.0,0.5]"])  # rewards=[accuracy]: one function
    with pytest.raises(ConfigError, match="one weight per function"):
        cfg.validate()
    assert cfg.validate(reward_funcs=[a, b]) is cfg  # two functions passed instead of the config's one
    with pytest.raises(ConfigError, match=r"2 values but there are 1 reward functions \['a'\]"):
        cfg.validate(reward_funcs=[a])


def test_lora_dtype_and_schedule_checks():
    with pytest.raises(ConfigError, match="model.lora.r=0 must be a positive integer"):
        load_config(None, _valid() + ["model.lora.enabled=true", "model.lora.r=0"]).validate()
    load_config(None, _valid() + ["model.lora.r=0"]).validate()  # not enabled: not used, not checked
    load_config(None, _valid() + ["model.dtype=bf16"]).validate()  # the same names load_model accepts
    with pytest.raises(ConfigError, match="model.dtype='float8' is not valid; choose one of: float32"):
        load_config(None, _valid() + ["model.dtype=float8"]).validate()
    with pytest.raises(ConfigError, match="constant, linear, cosine"):
        load_config(None, _valid() + ["optim.schedule=step"]).validate()


def test_logprob_temperature():
    cfg = load_config(None, _valid() + ["rollout.temperature=0.7"])
    assert cfg.rollout.logprob_temperature() == 0.7
    cfg.rollout.temperature = 0.0  # greedy sampling: log-probs of the untempered distribution
    assert cfg.rollout.logprob_temperature() == 1.0


def test_engine_names_match_the_registry_and_config_stays_light():
    import subprocess
    import sys

    from cohort import choices, rollout

    assert tuple(rollout.ENGINES) == choices.ENGINES
    code = "import sys, cohort.config; print('transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", "importing cohort.config must not import transformers"


# ------------------------------------------------------------------ the fast-path switchboard


def test_fast_switches_from_yaml_and_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    # A bare `off` / `on` is a boolean in YAML: the switchboard reads it as the switch value.
    f.write_text("fast:\n  segments: off\n  shared_prefix: on\n  pack_after_steps: 4\n")
    cfg = load_config(f, ["fast.chunked_head=off", "fast.packed_weights=auto", *_valid()]).validate()
    assert (cfg.fast.segments, cfg.fast.shared_prefix, cfg.fast.chunked_head) == ("off", "on", "off")
    assert cfg.fast.pack_after_steps == 4 and cfg.fast.packed_weights == "auto"
    save_config(cfg, tmp_path / "saved.yaml")
    assert load_config(tmp_path / "saved.yaml").fast == cfg.fast  # the resolved config round-trips


@pytest.mark.parametrize(
    ("over", "fragment"),
    [
        (
            {"fast.segments": "sometimes"},
            "fast.segments='sometimes' is not valid; choose one of: auto, on, off",
        ),
        ({"fast.segments_min_tokens": -1}, "fast.segments_min_tokens=-1 must be an integer >= 0"),
        ({"fast.head_chunk_mib": 0}, "fast.head_chunk_mib=0 must be an integer >= 1"),
        ({"fast.drop_ended_fraction": 1.5}, "fast.drop_ended_fraction=1.5 must be in (0, 1]"),
        ({"fast.attention_slowdown": -1}, "fast.attention_slowdown=-1.0 must be >= 0"),
        ({"fast.segments": "on", "fast.grouped": "off"}, "fast.segments=on needs the grouped layout"),
        (
            {"fast.skip_zero_advantage": "on", "algo.beta": 0.04},
            "fast.skip_zero_advantage=on with algo.beta=0.04",
        ),
        (
            {"fast.segments": "on", "model.attn_implementation": "eager"},
            "fast.segments=on needs model.attn_implementation=sdpa",
        ),
        (
            {"fast.grouped": "on", "model.attn_implementation": "flash_attention_2"},
            "fast.grouped=on needs a custom attention mask",
        ),
        (
            {"fast.packed_weights": "on", "model.dtype": "bfloat16"},
            "fast.packed_weights=on needs the builtin engine",
        ),
        (
            {"fast.packed_weights": "on", "rollout.engine": "hf"},
            "fast.packed_weights=on needs the builtin engine",
        ),
    ],
)
def test_fast_switch_errors_name_the_key_and_the_fix(over, fragment):
    cfg = load_config(None, _valid(**over))
    with pytest.raises(ConfigError) as e:
        cfg.validate()
    assert fragment in str(e.value), str(e.value)


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("rollout.packed_weights=false", "fast.packed_weights"),
        ("malloc_mmap_threshold_mib=8", "fast.heap_mmap_threshold_mib"),
    ],
)
def test_moved_keys_point_at_their_new_place(old, new):
    with pytest.raises(ConfigError, match=f"moved to '{new}'"):
        load_config(None, [old])


def test_every_example_config_loads_and_validates():
    """The configs shipped in examples/ are what users copy: each must load and pass validation."""
    from pathlib import Path

    files = sorted((Path(__file__).resolve().parents[1] / "examples" / "configs").glob("*.yaml"))
    assert files
    for f in files:
        load_config(f).validate()


# ------------------------------------------------------------------ deriving, then checking


def test_deriving_is_one_explicit_step_and_the_checks_change_nothing():
    import dataclasses

    from cohort.config import RunEnvironment, derive, validate_config

    cfg = load_config(None, _valid(**{"distributed.global_batch_size": 24, "rollout.group_size": 4}))
    cfg.fast.segments = False  # a boolean from Python: derived as "off"
    given = dataclasses.asdict(cfg)
    with pytest.raises(ConfigError, match=r"rollout.batch_size=64 is not .*derive the config"):
        validate_config(cfg, world_size=3, cuda_available=False)
    assert dataclasses.asdict(cfg) == given  # a refusal changed nothing either
    assert derive(cfg, world_size=3) is cfg
    assert (cfg.rollout.batch_size, cfg.fast.segments) == (8, "off")
    derived = dataclasses.asdict(cfg)
    assert dataclasses.asdict(derive(cfg, world_size=3)) == derived  # deriving again changes nothing
    assert validate_config(cfg, world_size=3, cuda_available=False) is cfg
    assert dataclasses.asdict(cfg) == derived
    # The environment is an argument: the same config for two processes, whatever WORLD_SIZE says here.
    other = load_config(None, _valid(**{"distributed.global_batch_size": 24, "rollout.group_size": 4}))
    assert other.validate(environment=RunEnvironment(world_size=2)).rollout.batch_size == 12


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_the_inert_table_reads_the_process_count_it_is_given(backend):
    from cohort.config import RunEnvironment, inert_options
    from cohort.errors import ConfigWarning

    cfg = load_config(None, _valid(**{"distributed.backend": backend}))
    assert [key for key, *_ in inert_options(cfg, world_size=1)] == ["distributed.backend"]
    assert inert_options(cfg, world_size=2) == []
    with pytest.warns(ConfigWarning, match=f"distributed.backend='{backend}' changes nothing.*torchrun"):
        cfg.validate(environment=RunEnvironment(world_size=1))


def test_iterative_reward_model_takes_an_optimizer_section_and_the_old_key():
    from cohort.config import IterativeConfig, OptimConfig, current_keys, to_dict

    cfg = load_config(None, _valid(**{"iterative.rm_lr": 5e-3, "iterative.optim.weight_decay": 0.1}))
    assert cfg.iterative.optim == OptimConfig(lr=5e-3, weight_decay=0.1, adam_beta2=0.999)
    assert cfg.iterative.rm_lr == 5e-3 and IterativeConfig(rm_lr=2e-3).optim.lr == 2e-3
    assert "rm_lr" not in to_dict(cfg)["iterative"]  # written under its one name
    with pytest.raises(ConfigError, match="iterative.rm_lr='fast': expected a number"):
        load_config(None, ["iterative.rm_lr=fast"])
    with pytest.raises(ConfigError, match=r"iterative.optim.warmup_steps=5 changes nothing.*constant"):
        load_config(None, _valid(**{"iterative.optim.warmup_steps": 5})).validate()
    with pytest.raises(ConfigError, match=r"iterative.optim.lr=0.0 must be > 0"):
        load_config(None, _valid(**{"iterative.every": 2, "iterative.optim.lr": 0})).validate()
    # A checkpoint's config written by an older cohort (iterative.rm_lr) compares equal to today's.
    old = to_dict(TrainConfig())
    del old["iterative"]["optim"]
    old["iterative"]["rm_lr"] = 1e-4
    assert current_keys(old) == to_dict(TrainConfig())


def test_under_torchrun_on_gpus_each_process_trains_on_its_local_gpu(monkeypatch):
    """FSDP places the model on the GPU of the local rank and the process group talks there: another model.device
    (the CPU, another GPU) would fail at the first forward, or broadcast CPU tensors over NCCL."""
    from cohort.config import validate_config

    monkeypatch.setenv("LOCAL_RANK", "1")
    for device in ("auto", "cuda", "cuda:1"):
        cfg = load_config(None, _valid(**{"model.device": device}))
        assert validate_config(cfg, world_size=2, cuda_available=True) is cfg
    for device in ("cpu", "cuda:0"):
        with pytest.raises(
            ConfigError, match=rf"model.device={device} cannot run under torchrun .*cuda:1 for this"
        ):
            validate_config(
                load_config(None, _valid(**{"model.device": device})), world_size=2, cuda_available=True
            )
    cfg = load_config(None, _valid(**{"model.device": "cpu"}))
    assert (
        validate_config(cfg, world_size=2, cuda_available=False) is cfg
    )  # GPUs hidden: gloo processes on CPUs
    assert validate_config(cfg, world_size=1, cuda_available=True) is cfg  # one process: any device


def test_packed_weights_on_is_refused_where_auto_picks_a_gpu():
    from cohort.config import RunEnvironment

    cfg = load_config(None, _valid(**{"fast.packed_weights": "on"}))
    assert cfg.validate(environment=RunEnvironment(cuda_available=False)) is cfg  # auto stays on the CPU
    with pytest.raises(ConfigError, match="fast.packed_weights=on needs the builtin engine decoding float32"):
        load_config(None, _valid(**{"fast.packed_weights": "on"})).validate(
            environment=RunEnvironment(cuda_available=True)
        )


def test_a_task_beside_a_data_path_is_refused_and_task_sizes_without_a_task_are_named():
    """data.path's prompts are used and data.task's problems never made: both set is a contradiction (it dropped the
    held-out set without a word); a task's sizes without a task change nothing."""
    from cohort.errors import ConfigWarning

    both = {"data.path": "train.jsonl", "data.task": "addition"}
    with pytest.raises(
        ConfigError, match=r"data.task='addition' changes nothing.*data.path is set.*drop one"
    ):
        load_config(None, [f"{k}={v}" for k, v in both.items()]).validate(need_model=False)
    for key, value in (("data.n_train", 10), ("data.n_eval", 5), ("data.task_seed", 7)):
        with pytest.warns(ConfigWarning, match=rf"{key}={value} changes nothing.*data.task is unset"):
            load_config(None, ["data.path=train.jsonl", f"{key}={value}"]).validate(need_model=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)
        load_config(None, ["data.task=addition", "data.n_train=10"]).validate(need_model=False)


def test_a_preset_given_as_an_override_meets_the_file_applied_after_it(tmp_path):
    """The order is preset, file, overrides whatever the command line's order: the file's values win, said in a
    warning when the preset came only from the command line; the preset's loss parameters go where another loss
    is named (they were refused by it, naming neither the key nor the preset)."""
    from cohort.errors import ConfigWarning

    f = tmp_path / "c.yaml"
    f.write_text(
        "model: {name_or_path: m}\ndata: {task: addition}\nalgo: {loss_type: dapo, eps_high: 0.28}\n"
    )
    with pytest.warns(
        ConfigWarning,
        match=r"preset=vespo is applied before the config file, and the file's "
        r"algo.loss_type='dapo' \(the preset's 'vespo'\), algo.eps_high=0.28 \(the preset's None\) win",
    ):
        cfg = load_config(f, ["preset=vespo"])
    assert cfg.algo.loss_type == "dapo" and cfg.algo.loss_kwargs == {} and cfg.algo.importance == "token"
    cfg.validate(need_model=False)  # dapo with no loss parameters: valid
    # the file's value also given as an override: the preset's wins there, nothing to say about it
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)
        cfg = load_config(f, ["preset=vespo", "algo.loss_type=vespo", "algo.eps_high=null"])
    assert cfg.algo.loss_type == "vespo" and cfg.algo.loss_kwargs["k_pos"] == 2.0
    # a preset named in the file itself: the file's own choice, no warning
    f.write_text("preset: sapo\nmodel: {name_or_path: m}\ndata: {task: addition}\nalgo: {loss_type: dapo}\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)
        assert load_config(f).algo.loss_kwargs == {}
    # loss parameters that fit no loss name their key
    bad = load_config(None, _valid(**{"algo.loss_type": "dapo", "algo.loss_kwargs": "{tau_pos: 1.0}"}))
    with pytest.raises(
        ConfigError, match=r"algo.loss_kwargs=\{'tau_pos': 1.0\}: loss_type='dapo' takes no parameters"
    ):
        bad.validate(need_model=False)


def test_iterative_keys_while_iterative_grpo_is_off_are_named():
    from cohort.errors import ConfigWarning

    for key, value in (("iterative.prompts", 4), ("iterative.rm_steps", 7), ("iterative.rm_lr", 0.01)):
        shown = "iterative.optim.lr" if key == "iterative.rm_lr" else key
        with pytest.warns(ConfigWarning, match=rf"{shown}={value} changes nothing.*iterative.every=0"):
            load_config(None, _valid(**{key: value})).validate(need_model=False)


def test_resume_true_means_the_newest_checkpoint_and_a_missing_folder_is_named_as_missing(tmp_path):
    """resume=true read as the string 'on' ("resume='on' is not a cohort checkpoint"); TRL's True is 'auto'."""
    from cohort.runtime.checkpoint_files import find_resume_dir

    assert load_config(None, {"resume": True}).resume == "auto"
    assert load_config(None, {"resume": False}).resume is None
    assert load_config(None, ["resume=true"]).resume == "auto"
    with pytest.raises(
        FileNotFoundError, match="there is no such folder; .* has no checkpoint: leave resume unset"
    ):
        find_resume_dir(str(tmp_path / "checkpoints" / "step-3"), tmp_path)
    (tmp_path / "checkpoints" / "step-2").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step-2" / "trainer_state.pt").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="has step-2: pass one of them, or resume=auto"):
        find_resume_dir(str(tmp_path / "checkpoints" / "step-3"), tmp_path)


def test_a_misspelt_section_is_compared_with_the_sections():
    """'modle.name_or_path' listed every key of the config (about 200) and suggested nothing."""
    with pytest.raises(ConfigError, match=r"unknown config key 'modle'; did you mean 'model\.\*'"):
        load_config(None, ["modle.name_or_path=tiny"])
    with pytest.raises(ConfigError, match=r"unknown config key 'rolout'; did you mean 'rollout\.\*'"):
        load_config(None, ["rolout.group_size=4"])
