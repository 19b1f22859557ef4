"""Typed kinds in the config (cohort.config.kinds): algo.cov (clip_cov | kl_cov), algo.sampler_is (token_tis |
sequence_tis | token_mis | sequence_mis | auto), algo.adaptive_entropy, algo.dynamic_sampling and algo.ref_sync
hold only their own settings, in every form a config is written in, and the older flat names stay as aliases."""

from __future__ import annotations

import pytest

from cohort.config import (
    INERT_OPTIONS,
    AdaptiveEntropy,
    AlgoConfig,
    AutoSamplerIS,
    ClipCov,
    ConfigError,
    DynamicSampling,
    KLCov,
    RefSync,
    SequenceMIS,
    SequenceTIS,
    TokenMIS,
    TokenTIS,
    current_keys,
    describe_keys,
    load_config,
    save_config,
    to_dict,
)
from cohort.runtime.rundir import config_changes


@pytest.mark.parametrize(
    ("written", "cov"),
    [
        ({"algo": {"cov": "clip_cov"}}, ClipCov()),
        ({"algo": {"cov": {"kind": "kl_cov", "coef": 2.0}}}, KLCov(coef=2.0)),
        ({"algo.cov.kind": "clip_cov", "algo.cov.ratio": 1e-3}, ClipCov(ratio=1e-3)),
        ({"algo": {"cov": None}}, None),
        ({"algo": {"cov": "none"}}, None),
        ({"algo": {"cov_method": "kl_cov", "kl_cov_coef": 3.0, "cov_ratio": None}}, KLCov(coef=3.0)),
        (
            {"algo": {"cov_method": "clip_cov", "cov_ratio": 0.01, "clip_cov_bounds": [0, 2]}},
            ClipCov(0.01, [0, 2]),
        ),
    ],
)
def test_a_kind_is_written_by_name_mapping_dotted_keys_or_its_old_flat_names(written, cov, tmp_path):
    cfg = load_config(None, written)
    assert cfg.algo.cov == cov
    save_config(cfg, tmp_path / "c.yaml")  # and it reads back as itself
    assert load_config(tmp_path / "c.yaml").algo.cov == cov
    if cov is not None:
        assert to_dict(cfg)["algo"]["cov"]["kind"] == cov.KIND


def test_dynamic_sampling_is_a_section_with_its_rounds():
    assert load_config(None, ["algo.dynamic_sampling=true"]).algo.dynamic_sampling == DynamicSampling()
    old = load_config(None, {"algo": {"dynamic_sampling": True, "max_sampling_rounds": 6}}).algo
    assert old.dynamic_sampling == DynamicSampling(max_rounds=6) and old.max_sampling_rounds == 6
    assert load_config(
        None, {"algo.dynamic_sampling.max_rounds": 2}
    ).algo.dynamic_sampling == DynamicSampling(2)
    assert load_config(None, {"preset": "dapo"}).algo.dynamic_sampling == DynamicSampling()
    off = load_config(
        None, {"algo": {"dynamic_sampling": False, "max_sampling_rounds": 4}}
    ).algo  # the old default
    assert off.dynamic_sampling is None and off.max_sampling_rounds == 4


def test_the_adaptive_entropy_section_is_true_a_mapping_or_off():
    assert load_config(None, ["algo.adaptive_entropy=true"]).algo.adaptive_entropy == AdaptiveEntropy()
    on = load_config(None, {"algo": {"adaptive_entropy": {"target": 0.5, "delta": 0.01}}}).algo
    assert on.adaptive_entropy == AdaptiveEntropy(target=0.5, delta=0.01)
    assert (on.entropy_target, on.entropy_coef_delta, on.entropy_coef_max) == (0.5, 0.01, 1.0)  # the aliases
    assert load_config(None, ["algo.adaptive_entropy=false"]).algo.adaptive_entropy is None
    assert load_config(None, {"algo.adaptive_entropy": "true"}).algo.adaptive_entropy == AdaptiveEntropy()
    # the flat names of an older config turn nothing on by themselves, and write into the section when it is on
    old = load_config(
        None, {"algo": {"adaptive_entropy": True, "entropy_target": 0.3, "entropy_coef_min": 0.1}}
    )
    assert old.algo.adaptive_entropy == AdaptiveEntropy(target=0.3, coef_min=0.1)
    assert to_dict(old)["algo"]["adaptive_entropy"] == {
        "target": 0.3,
        "coef_min": 0.1,
        "coef_max": 1.0,
        "delta": 0.005,
    }


@pytest.mark.parametrize(
    ("written", "fragment"),
    [
        (
            {"algo.cov": {"kind": "clip_cov", "coef": 2.0}},
            "not a setting of algo.cov kind clip_cov .*kl_cov has it",
        ),
        ({"algo.cov.coef": 2.0}, "algo.cov needs its kind"),
        ({"algo.cov": "kl"}, r"algo.cov='kl' is not one of clip_cov, kl_cov"),
        ({"algo.cov": {"kind": "kl"}}, r"algo.cov.kind='kl' is not one of clip_cov, kl_cov"),
        ({"algo.sampler_correction": "tis"}, r"algo.sampler_correction='tis' is not one of token_tis, "),
        (
            {"algo.sampler_is_max": 3.0},
            r"does nothing with algo.sampler_is=auto: only token_tis, sequence_tis, token_mis and sequence_mis",
        ),
        (
            {"algo.sampler_correction": "token_tis", "algo.sampler_is_min": 0.5},
            "algo.sampler_is_min=0.5 does nothing with algo.sampler_is=token_tis: only token_mis and sequence_mis",
        ),
        ({"algo.sampler_is": {"kind": "token_tis", "min_ratio": 0.5}}, "token_mis and sequence_mis have it"),
        ({"algo.cov": True}, "name its kind"),
        (
            {"algo.cov_ratio": 1e-3},
            r"algo.cov_ratio=0.001 does nothing with algo.cov=none: only clip_cov and kl_cov",
        ),
        (
            {"algo.cov_method": "clip_cov", "algo.kl_cov_coef": 2.0},
            "does nothing with algo.cov=clip_cov: only kl_cov",
        ),
        (
            {"algo.entropy_target": 0.3},
            "algo.entropy_target=0.3 does nothing while algo.adaptive_entropy is off",
        ),
        ({"algo.adaptive_entropy": {"goal": 0.3}}, "not a setting of algo.adaptive_entropy"),
        ({"algo.max_sampling_rounds": 8}, "does nothing while algo.dynamic_sampling is off: turn it on"),
    ],
)
def test_a_setting_the_chosen_kind_does_not_hold_cannot_be_written(written, fragment):
    with pytest.raises(ConfigError, match=fragment):
        load_config(None, written)


def test_the_python_constructor_takes_the_kinds_and_the_old_names():
    assert AlgoConfig(cov=KLCov(coef=2.0)).kl_cov_coef == 2.0
    a = AlgoConfig(cov_method="clip_cov", cov_ratio=0.01)
    assert a.cov == ClipCov(ratio=0.01) and a.cov_method == "clip_cov" and a.kl_cov_coef == 1.0
    a.cov_method = "kl_cov"  # a property writes the kind (its defaults)
    assert a.cov == KLCov()
    with pytest.raises(ConfigError, match="only clip_cov reads it"):
        AlgoConfig(cov_method="kl_cov", clip_cov_bounds=[0.0, 3.0])
    assert AlgoConfig().cov_method == "none" and AlgoConfig().entropy_target == 0.2
    # the kinds as YAML writes them, and the old boolean
    assert AlgoConfig(adaptive_entropy=True, entropy_target=0.5).adaptive_entropy == AdaptiveEntropy(
        target=0.5
    )
    assert AlgoConfig(adaptive_entropy=False).adaptive_entropy is None
    assert AlgoConfig(cov={"kind": "kl_cov", "coef": 2.0}).cov == KLCov(coef=2.0)
    assert AlgoConfig(cov="clip_cov").cov == ClipCov()


def test_an_older_config_with_every_flat_key_loads_and_resumes_as_the_same_run(tmp_path):
    # An older cohort wrote every key, used or not: the defaults of unchosen kinds are accepted, and the
    # resume check (config_changes over current_keys) sees the same run.
    flat = {
        "cov_method": "kl_cov",
        "cov_ratio": None,
        "clip_cov_bounds": [1.0, 5.0],
        "kl_cov_coef": 1.5,
        "adaptive_entropy": False,
        "entropy_target": 0.2,
        "entropy_coef_min": 0.0,
        "entropy_coef_max": 1.0,
        "entropy_coef_delta": 0.005,
        "num_iterations": 2,
    }
    saved = to_dict(load_config(None, {}))
    saved["algo"] = {k: v for k, v in saved["algo"].items() if k not in ("cov", "adaptive_entropy")} | flat
    cfg = load_config(None, {"algo": flat})
    assert cfg.algo.cov == KLCov(coef=1.5) and cfg.algo.adaptive_entropy is None
    assert not config_changes(current_keys(saved), to_dict(cfg))
    # with the adaptive coefficient on, its flat settings are the section's
    saved["algo"] |= {"adaptive_entropy": True, "entropy_target": 0.3}
    on = load_config(None, {"algo": {**flat, "adaptive_entropy": True, "entropy_target": 0.3}})
    assert on.algo.adaptive_entropy == AdaptiveEntropy(target=0.3)
    assert not config_changes(current_keys(saved), to_dict(on))
    assert config_changes(current_keys(saved), to_dict(cfg)) == [
        ("algo.adaptive_entropy", to_dict(on)["algo"]["adaptive_entropy"], None)
    ]


def test_overrides_keep_or_switch_the_kind_of_a_base_config():
    base = load_config(None, {"algo": {"cov": {"kind": "kl_cov", "coef": 3.0}}})
    kept = load_config(None, ["algo.cov.ratio=0.01"], base=base)
    assert kept.algo.cov == KLCov(ratio=0.01, coef=3.0) and base.algo.cov == KLCov(coef=3.0)
    assert load_config(None, ["algo.cov=clip_cov"], base=base).algo.cov == ClipCov()
    assert load_config(None, ["algo.cov=none"], base=base).algo.cov is None


def test_presets_the_listing_and_the_inert_rules_follow_the_kinds():
    assert load_config(None, {"preset": "kl_cov"}).algo.cov == KLCov(ratio=2e-3, coef=1.0)
    assert load_config(None, {"preset": "clip_cov"}).algo.cov == ClipCov(ratio=2e-4, bounds=[1.0, 5.0])
    rows = {k: (v, d) for k, v, d in describe_keys() if k.startswith("algo.cov")}
    assert rows["algo.cov"][0] == "none" and "[kl_cov]" in rows["algo.cov.coef"][1]
    assert rows["algo.cov.bounds"][0] == [1.0, 5.0]
    # no rule is left for a setting a kind now holds: it cannot be written where it would do nothing
    keys = {rule.key for rule in INERT_OPTIONS}
    for old in (
        "cov_ratio",
        "clip_cov_bounds",
        "kl_cov_coef",
        "entropy_target",
        "entropy_coef_delta",
        "max_sampling_rounds",
    ):
        assert f"algo.{old}" not in keys


def test_trl_adaptive_entropy_fields_become_the_section(tmp_path):
    from cohort.compat.drop_in import GRPOConfig

    args = GRPOConfig(
        output_dir=str(tmp_path), use_adaptive_entropy=True, entropy_target=0.4, entropy_coef_delta=0.01
    )
    algo = args.to_train_config("m", 8).algo
    assert algo.adaptive_entropy == AdaptiveEntropy(target=0.4, delta=0.01)
    assert GRPOConfig(output_dir=str(tmp_path)).to_train_config("m", 8).algo.adaptive_entropy is None


@pytest.mark.parametrize(
    ("written", "kind"),
    [
        ({}, AutoSamplerIS()),
        ({"algo.sampler_is": "none"}, None),
        ({"algo": {"sampler_is": "sequence_tis"}}, SequenceTIS()),
        ({"algo": {"sampler_is": {"kind": "token_mis", "min_ratio": 0.5}}}, TokenMIS(min_ratio=0.5)),
        (
            {"algo.sampler_is.kind": "sequence_mis", "algo.sampler_is.max_ratio": 3.0},
            SequenceMIS(max_ratio=3.0),
        ),
        ({"algo": {"sampler_correction": "token_tis", "sampler_is_max": 1.5}}, TokenTIS(max_ratio=1.5)),
        (
            {"algo": {"sampler_correction": "token_mis", "sampler_is_min": 0.2, "sampler_is_max": 4.0}},
            TokenMIS(max_ratio=4.0, min_ratio=0.2),
        ),
        # an older run folder's config: every key, auto already resolved, the bounds at their defaults
        ({"algo": {"sampler_correction": "none", "sampler_is_max": 2.0, "sampler_is_min": None}}, None),
    ],
)
def test_the_sampler_correction_is_a_kind_with_its_own_bounds(written, kind, tmp_path):
    cfg = load_config(None, written)
    assert cfg.algo.sampler_is == kind
    # the flat names read the kind: its name, and its bounds (their old defaults where it has none)
    assert cfg.algo.sampler_correction == ("none" if kind is None else kind.KIND)
    assert cfg.algo.sampler_is_max == getattr(kind, "max_ratio", 2.0)
    assert cfg.algo.sampler_is_min == getattr(kind, "min_ratio", None)
    save_config(cfg, tmp_path / "c.yaml")
    assert load_config(tmp_path / "c.yaml").algo.sampler_is == kind


def test_auto_resolves_to_a_kind_when_the_config_is_derived():
    from cohort.config.derive import derive

    plain = derive(load_config(None, {}), world_size=1)
    assert plain.algo.sampler_is is None and plain.algo.sampler_correction == "none"
    stale = derive(load_config(None, {"rollout.max_staleness": 1}), world_size=1)
    assert stale.algo.sampler_is == TokenTIS() and stale.algo.sampler_correction == "token_tis"
    anchored = {"rollout.max_staleness": 1, "algo.trust_region_anchor": "sampler"}
    assert derive(load_config(None, anchored), world_size=1).algo.sampler_is is None
    chosen = derive(
        load_config(None, {"algo.sampler_is": {"kind": "token_mis", "min_ratio": 0.1}}), world_size=1
    )
    assert chosen.algo.sampler_is == TokenMIS(min_ratio=0.1)  # a chosen kind stays as chosen
    keys = {rule.key for rule in INERT_OPTIONS}
    assert "algo.sampler_is_max" not in keys and "algo.sampler_is_min" not in keys


def test_an_older_run_with_the_flat_sampler_keys_resumes_as_the_same_run():
    flat = {"sampler_correction": "token_mis", "sampler_is_max": 3.0, "sampler_is_min": 0.25}
    saved = to_dict(load_config(None, {}))
    saved["algo"] = {k: v for k, v in saved["algo"].items() if k != "sampler_is"} | flat
    cfg = load_config(None, {"algo": flat})
    assert cfg.algo.sampler_is == TokenMIS(max_ratio=3.0, min_ratio=0.25)
    assert not config_changes(current_keys(saved), to_dict(cfg))
    assert AlgoConfig(sampler_correction="sequence_tis", sampler_is_max=1.5).sampler_is == SequenceTIS(1.5)


@pytest.mark.parametrize(
    ("written", "sync"),
    [
        ({}, None),
        ({"algo": {"ref_sync": {"every": 64, "alpha": 0.6}}}, RefSync(every=64, alpha=0.6)),
        ({"algo.ref_sync.kl": 0.5}, RefSync(kl=0.5)),
        # the flat names: a trigger turns the section on, whatever order they come in
        ({"algo": {"ref_mixup_alpha": 0.6, "ref_update_every": 8}}, RefSync(every=8, alpha=0.6)),
        ({"algo": {"ref_mixup_alpha": 0.5, "ref_sync_kl": 0.2}}, RefSync(kl=0.2, alpha=0.5)),
        (["algo.ref_update_every=4", "algo.ref_sync_kl=0.3"], RefSync(every=4, kl=0.3)),
        (["algo.ref_update_every=0"], None),  # the default turns nothing on
        # an older run folder's config, every key at its default
        ({"algo": {"ref_update_every": 0, "ref_sync_kl": None, "ref_mixup_alpha": 1.0}}, None),
    ],
)
def test_the_reference_sync_is_a_section_its_old_flat_triggers_turn_on(written, sync, tmp_path):
    cfg = load_config(None, written)
    assert cfg.algo.ref_sync == sync
    assert cfg.algo.ref_update_every == (sync.every if sync else 0)
    assert cfg.algo.ref_sync_kl == (sync.kl if sync else None)
    assert cfg.algo.ref_mixup_alpha == (sync.alpha if sync else 1.0)
    save_config(cfg, tmp_path / "c.yaml")
    assert load_config(tmp_path / "c.yaml").algo.ref_sync == sync


def test_the_reference_sync_refuses_what_would_do_nothing():
    with pytest.raises(
        ConfigError, match=r"algo.ref_mixup_alpha=0.6 does nothing while algo.ref_sync is off"
    ):
        load_config(None, {"algo.ref_mixup_alpha": 0.6})
    with pytest.raises(ConfigError, match=r"not a setting of algo.ref_sync"):
        load_config(None, {"algo.ref_sync": {"steps": 3}})
    assert AlgoConfig(ref_update_every=3, ref_mixup_alpha=0.5).ref_sync == RefSync(every=3, alpha=0.5)
    keys = {rule.key for rule in INERT_OPTIONS}
    assert "algo.ref_sync" in keys and not keys & {"algo.ref_update_every", "algo.ref_mixup_alpha"}


def test_an_older_run_that_synced_its_reference_resumes_as_the_same_run():
    flat = {"ref_update_every": 3, "ref_sync_kl": 2e-4, "ref_mixup_alpha": 0.6, "beta": 0.04}
    saved = to_dict(load_config(None, {}))
    saved["algo"] = {k: v for k, v in saved["algo"].items() if k != "ref_sync"} | flat
    cfg = load_config(None, {"algo": flat})
    assert cfg.algo.ref_sync == RefSync(every=3, kl=2e-4, alpha=0.6)
    assert not config_changes(current_keys(saved), to_dict(cfg))


def test_a_kind_switched_on_and_given_settings_in_one_command():
    """algo.dynamic_sampling=true algo.dynamic_sampling.max_rounds=2 said "dynamic_sampling is not a section"
    (the same two in a YAML file and on the command line worked)."""
    cfg = load_config(None, ["algo.dynamic_sampling=true", "algo.dynamic_sampling.max_rounds=2"])
    assert cfg.algo.dynamic_sampling is not None and cfg.algo.dynamic_sampling.max_rounds == 2
    with pytest.raises(ConfigError, match=r"algo.beta=0.1 is not a section"):
        load_config(None, ["algo.beta=0.1", "algo.beta.x=2"])
    with pytest.raises(
        ConfigError,
        match=r"dynamic_sampling=2: give true .*, false \(off\) or its settings \(algo.dynamic_sampling",
    ):
        load_config(None, ["algo.dynamic_sampling=2"])
