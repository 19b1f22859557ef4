"""Typed run configuration: dataclasses, YAML files, dotted ``key=value`` overrides, validation.

One tree of dataclasses is the single source of truth for a run. It is built in this order, each layer
overriding the one before: field defaults, the named ``preset`` (see :mod:`cohort.config.presets`), the YAML
file, then command-line overrides such as ``algo.beta=0.04``. Every check that can be done without
loading a model is done in :meth:`TrainConfig.validate`, so a typo costs seconds, not a model load; it
first derives the fields that follow from others (:func:`derive`, for the :class:`RunEnvironment` the run
starts in), then checks the result without changing it.

The package is a leaf of cohort: it imports only light modules that never import it back
(:mod:`cohort.errors`, :mod:`cohort.choices`, :mod:`cohort.compat.fields`, :mod:`cohort.config.presets`, the name
lists and pure functions of :mod:`cohort.algo`, :mod:`cohort.runtime.plugins`, :mod:`cohort.fastpath.switches`
and the reward-weight check of :mod:`cohort.rewards`); tests/test_imports.py keeps it so.

- :mod:`cohort.config.schema`: the dataclasses (every field with its default and docstring);
- :mod:`cohort.config.derive`: the one step that sets derived fields, and the environment it reads;
- :mod:`cohort.config.validation`: the checks ``TrainConfig.validate`` runs (pure: nothing changed or read);
- :mod:`cohort.config.inert`: the options that are accepted yet change nothing, and why;
- :mod:`cohort.config.loading`: YAML, overrides, type conversion, ``load_config`` / ``save_config``.
"""

from __future__ import annotations

from cohort.choices import ATTENTION_KINDS, SAMPLER_DTYPES
from cohort.config.checked import TrainConfig
from cohort.config.derive import RunEnvironment, derive, torchrun_world_size
from cohort.config.inert import INERT_OPTIONS, Inert, inert_options
from cohort.config.loading import (
    MOVED_KEYS,
    current_keys,
    describe_keys,
    field_docs,
    from_dict,
    load_config,
    parse_overrides,
    read_yaml,
    read_yaml_file,
    save_config,
    to_dict,
)
from cohort.config.loading import _valid_keys as _valid_keys  # read by cohort.compat.drop_in
from cohort.config.schema import (
    AdaptiveEntropy,
    AlgoConfig,
    AutoSamplerIS,
    ClipCov,
    CurriculumConfig,
    DataConfig,
    DistributedConfig,
    DynamicSampling,
    EpisodeConfig,
    HealthConfig,
    IterativeConfig,
    KLCov,
    LoraConfig,
    ModelConfig,
    OptimConfig,
    ProcessConfig,
    RefSync,
    RolloutConfig,
    SamplerIS,
    SequenceMIS,
    SequenceTIS,
    TokenMIS,
    TokenTIS,
    TrainFields,
    check_lora,
    optim_aliases,
)
from cohort.config.validation import check_optim, check_reward_weights, validate_config
from cohort.errors import ConfigError, ConfigWarning
from cohort.fastpath.switches import FastConfig

__all__ = [
    "ATTENTION_KINDS",
    "INERT_OPTIONS",
    "MOVED_KEYS",
    "SAMPLER_DTYPES",
    "AdaptiveEntropy",
    "AlgoConfig",
    "AutoSamplerIS",
    "ClipCov",
    "DynamicSampling",
    "KLCov",
    "ConfigError",
    "ConfigWarning",
    "CurriculumConfig",
    "DataConfig",
    "DistributedConfig",
    "FastConfig",
    "HealthConfig",
    "Inert",
    "IterativeConfig",
    "LoraConfig",
    "ModelConfig",
    "OptimConfig",
    "ProcessConfig",
    "RefSync",
    "EpisodeConfig",
    "RolloutConfig",
    "RunEnvironment",
    "SamplerIS",
    "SequenceMIS",
    "SequenceTIS",
    "TokenMIS",
    "TokenTIS",
    "TrainConfig",
    "TrainFields",
    "check_reward_weights",
    "check_lora",
    "check_optim",
    "current_keys",
    "derive",
    "describe_keys",
    "field_docs",
    "from_dict",
    "inert_options",
    "load_config",
    "optim_aliases",
    "parse_overrides",
    "read_yaml",
    "read_yaml_file",
    "save_config",
    "to_dict",
    "torchrun_world_size",
    "validate_config",
]
