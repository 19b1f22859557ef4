"""resolve_reward_funcs: built-in names, factories, module and file specs, one spec alone, and their errors."""

from __future__ import annotations

import pytest

from cohort.rewards import accuracy_reward, format_reward, resolve_reward_funcs


def test_builtin_names_and_callables():
    def mine(completions, **kwargs):
        return [0.0] * len(completions)

    assert resolve_reward_funcs(["accuracy", "format_reward", mine]) == [accuracy_reward, format_reward, mine]
    assert resolve_reward_funcs("format") == [format_reward]


def test_factories():
    (overlong,) = resolve_reward_funcs(["overlong(max_length=10, buffer=4)"])
    assert overlong(completions=["", ""], completion_ids=[[1] * 7, [1] * 11]) == [-0.25, -1.0]
    (positional,) = resolve_reward_funcs(["length(8)"])
    assert positional(completions=[""], completion_ids=[[1, 2]]) == [-0.25]
    (bare,) = resolve_reward_funcs(["overlong"], max_completion_length=20)
    assert (bare.max_length, bare.buffer) == (20, 4)
    with pytest.raises(ValueError, match=r"needs parameters, e.g. 'overlong\(max_length=512\)'"):
        resolve_reward_funcs(["overlong"])
    with pytest.raises(ValueError, match="must be Python literals"):
        resolve_reward_funcs(["overlong(max_length=n)"])
    with pytest.raises(ValueError, match="unexpected keyword argument 'size'"):
        resolve_reward_funcs(["length(size=3)"])


def test_a_spec_written_in_yaml_reads_its_words_and_a_split_one_says_to_quote_it():
    """A config file says true / false / null; a YAML flow list cut `code(timeout=2, all_or_nothing=true)` at its
    comma, and the piece was 'an unknown reward'."""
    (fn,) = resolve_reward_funcs(["code(timeout=2, all_or_nothing=true)"])
    assert fn.all_or_nothing is True
    (fn,) = resolve_reward_funcs(["code(all_or_nothing=false)"])
    assert fn.all_or_nothing is False
    with pytest.raises(
        ValueError,
        match=r"ends before its closing parenthesis: .*quote it, e.g. rewards: "
        r'\["code\(timeout=5, all_or_nothing=True\)"\]',
    ):
        resolve_reward_funcs(["code(timeout=2", "all_or_nothing=true)"])
    with pytest.raises(
        ValueError, match=r"must be Python literals, e.g. 'code\(timeout=5, all_or_nothing=True\)'"
    ):
        resolve_reward_funcs(["code(timeout=two)"])


def test_unknown_name_lists_builtins():
    with pytest.raises(
        ValueError,
        match=r"unknown reward 'acuracy'; did you mean 'accuracy'\? built-in rewards are: accuracy, format, ",
    ):
        resolve_reward_funcs(["acuracy"])
    with pytest.raises(ValueError, match="no reward functions given"):
        resolve_reward_funcs([])
    with pytest.raises(TypeError, match="must be a string, a callable or a reward model, got int"):
        resolve_reward_funcs([3])


def test_one_spec_alone_is_a_list_of_one():
    def mine(completions, **kwargs):
        return [0.0] * len(completions)

    assert resolve_reward_funcs(mine) == [mine]
    assert resolve_reward_funcs("accuracy") == [accuracy_reward]  # not iterated letter by letter
    assert resolve_reward_funcs("cohort.rewards.rules:format_reward") == [format_reward]
    (overlong,) = resolve_reward_funcs("overlong(max_length=10)")
    assert overlong.max_length == 10


def test_paths_and_hub_ids_are_told_apart_from_functions(tmp_path, monkeypatch):
    """Strings that are not built-ins or module:function read as reward models only when they look like one."""
    loaded = []

    class FakeRewardModel:  # no download: records what would be loaded
        def __init__(self, name, tokenizer=None):
            if name.startswith("offline/"):
                raise OSError("We couldn't connect to 'https://huggingface.co'")
            loaded.append(name)

    monkeypatch.setattr("cohort.rewards.registry.RewardModel", FakeRewardModel)
    (model,) = resolve_reward_funcs("some-org/reward-model-7b")
    assert isinstance(model, FakeRewardModel) and loaded == ["some-org/reward-model-7b"]
    with pytest.raises(
        ValueError, match=r"reads as a Hugging Face hub model id \(org/name\), which could not be loaded"
    ):
        resolve_reward_funcs("offline/model")
    with pytest.raises(ValueError, match="is a folder without config.json"):
        resolve_reward_funcs(str(tmp_path))
    with pytest.raises(ValueError, match="looks like a path, but no such folder exists"):
        resolve_reward_funcs(str(tmp_path / "missing" / "model"))
    with pytest.raises(ValueError, match=r"name the function in the file, e.g. 'rewards.py:my_reward'"):
        resolve_reward_funcs("rewards.py")
    with pytest.raises(ValueError, match="unknown reward 'cohort.rewards.rules'"):
        resolve_reward_funcs("cohort.rewards.rules")  # a module without ':function' is not a model


def test_reward_processing_classes_align_with_the_specs():
    with pytest.raises(ValueError, match="reward_processing_classes has 2 entries for 1 reward functions"):
        resolve_reward_funcs(["accuracy"], reward_processing_classes=[None, None])
    # entries of plain functions are ignored, as in TRL
    assert resolve_reward_funcs(["accuracy"], reward_processing_classes=[object()]) == [accuracy_reward]


def test_functions_that_cannot_take_keyword_arguments_are_refused_at_resolve_time():
    def positional(completions, /):
        return [0.0] * len(completions)

    with pytest.raises(TypeError, match="'positional' takes 'completions' as a positional-only argument"):
        resolve_reward_funcs(positional)


def test_module_spec():
    assert resolve_reward_funcs(["cohort.rewards.rules:format_reward"]) == [format_reward]
    with pytest.raises(ValueError, match="cannot import module 'no_such_pkg.rewards'"):
        resolve_reward_funcs(["no_such_pkg.rewards:f"])
    with pytest.raises(ValueError, match=r"has no attribute 'nope'; its callables are \[.*'format_reward'"):
        resolve_reward_funcs(["cohort.rewards.rules:nope"])
    with pytest.raises(ValueError, match="'BUILTIN_REWARDS' is a dict, not a function"):
        resolve_reward_funcs(["cohort.rewards.registry:BUILTIN_REWARDS"])


def test_file_spec(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(
        "LIMIT = 3\n"
        "def short(completions, **kwargs):\n"
        "    return [float(len(c) <= LIMIT) for c in completions]\n",
        encoding="utf-8",
    )
    (short,) = resolve_reward_funcs([f"{path}:short"])
    assert short(completions=["ab", "abcd"]) == [1.0, 0.0]
    assert resolve_reward_funcs([f"{path}:short"]) == [short]  # loaded once
    with pytest.raises(ValueError, match=r"has no attribute 'long'; its callables are \['short'\]"):
        resolve_reward_funcs([f"{path}:long"])
    with pytest.raises(ValueError, match="'LIMIT' is a int, not a function"):
        resolve_reward_funcs([f"{path}:LIMIT"])
    with pytest.raises(ValueError, match="file .*missing.py' not found"):
        resolve_reward_funcs([f"{tmp_path / 'missing.py'}:f"])
