"""The 2026 family's config surface (issue 40): YAML keys, presets with their sources, the TRL drop-in fields, and
every impossible or out-of-range setting refused with a ConfigError before the model loads, naming the fix."""

from __future__ import annotations

import warnings

import pytest
from test_trainer import _cfg

from cohort import GRPOConfig
from cohort.config import ConfigError, load_config
from cohort.config.presets import PRESET_SOURCES, PRESETS, describe_presets
from cohort.errors import ConfigWarning


def _validate(tmp_path, **over):
    return _cfg("no-model-needed", tmp_path / "o", **over).validate(need_model=False)


@pytest.mark.parametrize(
    ("over", "fragment"),
    [
        ({"algo.kl_tau": -0.1}, "algo.kl_tau=-0.1 must be a number >= 0"),
        ({"algo.loss_type": "dro"}, "set algo.kl_tau > 0"),
        (
            {"algo.off_policy_mask_threshold": -0.5},
            "algo.off_policy_mask_threshold=-0.5 must be a number >= 0",
        ),
        ({"algo.loss_type": "vespo", "algo.loss_kwargs": {"k": 1.0}}, "has no parameter 'k'"),
        ({"algo.loss_type": "vespo", "algo.loss_kwargs": {"k_pos": 0}}, "k_pos must be > 0"),
        ({"algo.loss_type": "vespo", "algo.loss_kwargs": {"lambda_pos": -1.0}}, "lambda_pos must be > 0"),
        ({"algo.loss_type": "dppo_tv", "algo.loss_kwargs": {"mask_high": -0.1}}, "mask_high must be > 0"),
        ({"algo.loss_type": "dppo_kl", "algo.loss_kwargs": {"max_ratio": 0.5}}, "max_ratio must be > 1"),
        (
            {"algo.loss_type": "vespo", "algo.sampler_correction": "sequence_tis"},
            "would weigh each sequence twice: set algo.sampler_correction to token_tis, token_mis or none",
        ),
        ({"algo.loss_type": "vespo", "algo.importance": "sequence"}, "set algo.importance=token"),
        (
            {"algo.trust_region_anchor": "sampler", "algo.sampler_correction": "token_tis"},
            "set algo.sampler_correction=none",
        ),
        ({"algo.trust_region_anchor": "mu"}, "algo.trust_region_anchor"),
        ({"algo.dppo_topk": 20}, "set algo.loss_type to dppo_tv or dppo_kl"),
        (
            {"algo.loss_type": "dppo_tv", "algo.dppo_topk": 20, "rollout.engine": "hf"},
            "rollout.engine='hf' does not return them; set rollout.engine=builtin",
        ),
        (
            {"algo.loss_type": "dppo_kl", "algo.dppo_topk": 4, "rollout.workers": 2},
            "rollout workers (rollout.workers=2) do not return them; unset rollout.workers",
        ),
        (
            {"algo.loss_type": "dppo_tv", "algo.dppo_topk": 4, "episodes.tools": ["my_tools:search"]},
            "multi-turn episodes do not return them",
        ),
        ({"algo.loss_type": "dppo_tv", "algo.dppo_topk": 1.5}, "algo.dppo_topk=1.5: expected an integer"),
        ({"algo.loss_type": "dppo_tv", "algo.dppo_topk": -1}, "algo.dppo_topk=-1 must be an int >= 0"),
        (
            {"algo.advantage": "optimal_token_baseline", "algo.loss_type": "gmpo"},
            "loss_type=gmpo needs one per completion",
        ),
        ({"algo.advantage": "max_rl", "algo.scale": "none"}, "set algo.scale=group"),
    ],
)
def test_bad_2026_settings_are_refused_before_the_model_loads(tmp_path, over, fragment):
    with pytest.raises(ConfigError) as e:
        _validate(tmp_path, **over)
    assert fragment in str(e.value), str(e.value)


def test_the_sampler_anchor_turns_auto_correction_off_even_for_stale_batches(tmp_path):
    from cohort.config.derive import derive

    over = {"rollout.max_staleness": 1}
    cfg = derive(_cfg("m", tmp_path / "o", **over, **{"algo.trust_region_anchor": "sampler"}), world_size=1)
    assert cfg.algo.sampler_correction == "none"
    assert derive(_cfg("m", tmp_path / "o", **over), world_size=1).algo.sampler_correction == "token_tis"


def test_luspo_at_token_importance_warns_as_trl_does(tmp_path):
    with pytest.warns(ConfigWarning, match="luspo is meant with algo.importance=sequence"):
        _validate(tmp_path, **{"algo.loss_type": "luspo"})
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)
        _validate(tmp_path, **{"algo.loss_type": "luspo", "algo.importance": "sequence"})


def test_bias_corrected_kl_without_a_kl_term_is_named_inert(tmp_path):
    with pytest.warns(ConfigWarning, match="algo.use_bias_correction_kl=True changes nothing"):
        _validate(tmp_path, **{"algo.use_bias_correction_kl": True})


def test_new_options_validate_together(tmp_path):
    cfg = _validate(
        tmp_path,
        **{
            "algo.loss_type": "dppo_kl",
            "algo.kl_tau": 1e-3,
            "algo.off_policy_mask_threshold": 0.5,
            "algo.beta": 0.01,
            "algo.use_bias_correction_kl": True,
            "algo.advantage": "max_rl",
            "algo.num_iterations": 2,
        },
    )
    assert cfg.algo.loss_type == "dppo_kl" and cfg.algo.kl_tau == 1e-3


def test_dppo_topk_validates_with_the_builtin_engine_and_is_inert_against_pi_old_in_one_step(tmp_path):
    over = {"algo.loss_type": "dppo_tv", "algo.dppo_topk": 4}
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)
        for anchor in ({"algo.trust_region_anchor": "sampler"}, {"algo.num_iterations": 2}):
            assert _validate(tmp_path, **over, **anchor).algo.dppo_topk == 4
    with pytest.warns(ConfigWarning, match="algo.dppo_topk=4 changes nothing.*top-K divergence is 0"):
        _validate(tmp_path, **over)


def test_kl_tau_against_pi_old_in_one_step_is_named_inert(tmp_path):
    with pytest.warns(ConfigWarning, match="algo.kl_tau=0.001 changes nothing.*trust_region_anchor=sampler"):
        _validate(tmp_path, **{"algo.kl_tau": 1e-3})
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)
        _validate(tmp_path, **{"algo.kl_tau": 1e-3, "algo.trust_region_anchor": "sampler"})
        _validate(tmp_path, **{"algo.kl_tau": 1e-3, "algo.num_minibatches": 2})


def test_defaults_are_unchanged():
    a = load_config(None, ["model.name_or_path=m", "data.task=addition"]).algo
    assert (a.kl_tau, a.use_bias_correction_kl, a.off_policy_mask_threshold) == (0.0, False, None)
    assert (a.trust_region_anchor, a.dppo_topk, a.loss_type, a.advantage) == ("old", 0, "grpo", "grpo")


@pytest.mark.parametrize("name", ["dppo", "prime_rl", "vespo", "luspo", "max_rl"])
def test_the_2026_presets_validate_and_say_their_source(name):
    cfg = load_config(None, {"model": {"name_or_path": "m"}, "data": {"task": "addition"}, "preset": name})
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)  # no preset sets an inert option
        assert cfg.validate().preset == name
    assert set(PRESET_SOURCES) == set(PRESETS)
    assert any(line.startswith(f"{name}: {PRESET_SOURCES[name]}") for line in describe_presets())


def test_prime_rl_preset_is_its_default_loss():
    a = load_config(
        None, {"model": {"name_or_path": "m"}, "data": {"task": "addition"}, "preset": "prime_rl"}
    ).algo
    assert (a.loss_type, a.aggregation, a.trust_region_anchor, a.kl_tau) == (
        "dppo_tv",
        "dapo",
        "sampler",
        1e-3,
    )
    assert a.loss_kwargs == {"mask_low": 0.2, "mask_high": 0.2, "max_ratio": None}


def test_cli_lists_presets_with_sources(capsys):
    from cohort import cli

    assert cli.main(["config", "--presets"]) == 0
    out = capsys.readouterr().out
    assert "prime_rl: prime-rl's default loss" in out and "algo.kl_tau=0.001" in out


# ---------------------------------------------------------------------------------------------------------
# The TRL drop-in
# ---------------------------------------------------------------------------------------------------------


def test_trl_vespo_fields_map_to_loss_kwargs():
    args = GRPOConfig(output_dir="x", loss_type="vespo", vespo_k_pos=1.5, vespo_lambda_neg=2.5)
    a = args.to_train_config("m", 8).algo
    assert a.loss_type == "vespo"
    assert a.loss_kwargs == {"k_pos": 1.5, "lambda_pos": 3.0, "k_neg": 3.0, "lambda_neg": 2.5}
    with pytest.raises(ConfigError, match="vespo_k_pos apply to loss_type='vespo'"):
        GRPOConfig(output_dir="x", loss_type="dapo", vespo_k_pos=1.5).to_train_config("m", 8)


def test_trl_off_policy_mask_and_bias_corrected_kl_follow_trls_defaults():
    a = GRPOConfig(output_dir="x", beta=0.04, off_policy_mask_threshold=0.5).to_train_config("m", 8).algo
    assert a.off_policy_mask_threshold == 0.5 and a.use_bias_correction_kl is True  # TRL's default on
    a = GRPOConfig(output_dir="x", beta=0.04, use_bias_correction_kl=False).to_train_config("m", 8).algo
    assert a.use_bias_correction_kl is False
    a = GRPOConfig(output_dir="x").to_train_config("m", 8).algo  # beta 0: nothing to correct
    assert a.use_bias_correction_kl is False and a.off_policy_mask_threshold is None


def test_trl_luspo_maps_onto_the_luspo_loss():
    a = GRPOConfig(output_dir="x", loss_type="luspo", importance_sampling_level="sequence").to_train_config(
        "m", 8
    )
    assert (a.algo.loss_type, a.algo.importance) == ("luspo", "sequence")
