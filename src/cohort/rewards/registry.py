"""Turn reward specs (built-in names, ``module:function``, ``file.py:function``, callables) into functions.

Spec forms:
- ``"accuracy"``, ``"format"``, ``"code"``: built-in functions (``"accuracy_reward"`` etc. also accepted);
- ``"code(timeout=2, all_or_nothing=True)"``: the code reward with its options (``make_code_reward``);
- ``"overlong(max_length=512, buffer=128)"``, ``"length(max_length=512)"``: built-in factories called
  with literal arguments; a bare ``"overlong"`` / ``"length"`` uses ``max_completion_length``;
- ``"my_pkg.rewards:func"``: a function imported from an installed module;
- ``"path/to/file.py:func"``: a function loaded from a Python file;
- ``"path/to/reward_model"`` (a folder with ``config.json``) or ``"org/name"`` (a hub id: one slash, no
  colon, not a built-in name), or a ``transformers.PreTrainedModel`` object: a reward model
  (sequence classification, ``num_labels == 1``), wrapped in :class:`cohort.rewards.reward_models.RewardModel`;
  a folder of a token-classification model is a process reward model
  (:class:`cohort.rewards.process_rewards.ProcessRewardModel`, one score per step, steps split by `step_separator`);
- any other callable, used as is.

One spec alone (a string, a path, a callable, a model) counts as a list of one.
"""

from __future__ import annotations

import ast
import difflib
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from cohort.errors import first_line
from cohort.rewards.code import code_reward, make_code_reward
from cohort.rewards.process_rewards import ProcessRewardModel
from cohort.rewards.reward_models import RewardModel
from cohort.rewards.rules import accuracy_reward, format_reward, make_length_reward, make_overlong_reward
from cohort.rewards.scoring import reward_signature
from cohort.runtime.plugins import load_function

__all__ = ["BUILTIN_REWARDS", "REWARD_FACTORIES", "resolve_reward_funcs"]

BUILTIN_REWARDS: dict[str, Callable] = {
    "accuracy": accuracy_reward,
    "format": format_reward,
    "code": code_reward,
}
"""Parameter-free built-in reward functions by spec name."""

REWARD_FACTORIES: dict[str, Callable[..., Callable]] = {
    "overlong": make_overlong_reward,
    "length": make_length_reward,
    "code": make_code_reward,
}
"""Built-in reward factories by spec name; spec ``"overlong(max_length=512)"`` calls the factory."""

_YAML_WORDS: dict[str, Any] = {"true": True, "false": False, "null": None}
"""YAML's words for True, False and None, read in a reward spec's arguments."""

_CALL = re.compile(r"^\s*(\w+)\s*\((.*)\)\s*$", re.DOTALL)
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def _known() -> str:
    """Returns the list of built-in spec forms, for error messages."""
    factories = [
        f"{name}({getattr(f, 'spec_example', 'max_length=...')})" for name, f in REWARD_FACTORIES.items()
    ]
    return ", ".join(list(BUILTIN_REWARDS) + factories)


def _example(name: str) -> str:
    """Returns example arguments of built-in factory `name`, for error messages."""
    return getattr(REWARD_FACTORIES[name], "spec_example", "max_length=512")


def _call_factory(name: str, args_text: str, spec: str) -> Callable:
    """Returns the function a built-in factory builds from the literal arguments in ``spec``."""

    def literal(node: ast.expr) -> Any:
        # YAML's spellings too: a spec written in a config file says true / false / null
        if isinstance(node, ast.Name) and node.id in _YAML_WORDS:
            return _YAML_WORDS[node.id]
        return ast.literal_eval(node)

    try:
        call = ast.parse(f"f({args_text})", mode="eval").body
        assert isinstance(call, ast.Call)
        args = [literal(a) for a in call.args]
        kwargs = {kw.arg: literal(kw.value) for kw in call.keywords if kw.arg is not None}
    except (SyntaxError, ValueError, AssertionError) as exc:
        raise ValueError(
            f"reward spec {spec!r}: arguments must be Python literals, e.g. '{name}({_example(name)})'"
        ) from exc
    try:
        return REWARD_FACTORIES[name](*args, **kwargs)
    except TypeError as exc:
        raise ValueError(f"reward spec {spec!r}: {exc}") from exc


def _model_folder(key: str) -> Path | None:
    """Returns the folder `key` names when it is an existing directory (a reward model's), else None."""
    try:
        path = Path(key).expanduser()
        return path if path.is_dir() else None
    except OSError:
        return None


def _is_token_classifier(folder: Path) -> bool:
    """Returns whether a model folder's config names a token-classification architecture (a process RM)."""
    import json

    try:
        archs = json.loads((folder / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError):
        return False
    return any(str(a).endswith("ForTokenClassification") for a in archs)


def _resolve_one(
    spec: Any, max_completion_length: int | None, tokenizer: Any, separator: str = "\n"
) -> Callable:
    """Returns the reward function for one spec (`tokenizer`: the reward model's, when it is one)."""
    if isinstance(spec, RewardModel):
        return spec
    if isinstance(spec, torch.nn.Module):  # before callable(): a model is callable too
        return RewardModel(spec, tokenizer)
    if callable(spec):
        return spec
    if isinstance(spec, os.PathLike):
        spec = os.fspath(spec)
    if not isinstance(spec, str):
        raise TypeError(
            f"reward spec {spec!r} must be a string, a callable or a reward model, got {type(spec).__name__}"
        )
    key = spec.strip()
    bare = key.removesuffix("_reward")
    if bare in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[bare]
    call = _CALL.match(key)
    if call and call.group(1).removesuffix("_reward") in REWARD_FACTORIES:
        return _call_factory(call.group(1).removesuffix("_reward"), call.group(2), spec)
    opened = re.match(r"\s*(\w+)\s*\(", key)
    name = opened.group(1).removesuffix("_reward") if opened else ""
    if name in REWARD_FACTORIES and not key.endswith(")"):
        raise ValueError(
            f"reward spec {spec!r} ends before its closing parenthesis: a YAML list splits an unquoted spec at "
            f'its commas; quote it, e.g. rewards: ["{name}({_example(name)})"]'
        )
    if bare in REWARD_FACTORIES:
        if max_completion_length is None:
            raise ValueError(
                f"reward {spec!r} needs parameters, e.g. '{bare}(max_length=512)'; or resolve it with "
                "max_completion_length set"
            )
        return REWARD_FACTORIES[bare](max_length=max_completion_length)
    folder = _model_folder(key)
    if folder is not None:
        if not (folder / "config.json").is_file():
            raise ValueError(
                f"reward {spec!r} is a folder without config.json; a reward model folder is one written by "
                "save_pretrained (AutoModelForSequenceClassification with num_labels=1)"
            )
        if _is_token_classifier(folder):
            return ProcessRewardModel(str(folder), tokenizer, separator=separator)
        return RewardModel(str(folder), tokenizer)
    if ":" in key:
        return load_function(key, f"reward spec {spec!r}")
    if _HUB_ID.fullmatch(key) and not key.endswith(".py"):
        try:
            return RewardModel(key, tokenizer)
        except OSError as exc:
            raise ValueError(
                f"reward {spec!r} reads as a Hugging Face hub model id (org/name), which could not be loaded "
                f"({first_line(exc)}); for a local "
                "reward model give an existing folder; built-in rewards are: " + _known()
            ) from exc
    if key.endswith(".py"):
        raise ValueError(f"reward {spec!r}: name the function in the file, e.g. '{key}:my_reward'")
    if "/" in key or "\\" in key or key.startswith((".", "~")):
        raise ValueError(
            f"reward {spec!r} looks like a path, but no such folder exists (resolved to "
            f"{str(Path(key).expanduser().resolve())!r}); a reward model is a folder written by save_pretrained"
        )
    close = difflib.get_close_matches(key, [*BUILTIN_REWARDS, *REWARD_FACTORIES], n=1, cutoff=0.6)
    guess = f"did you mean {close[0]!r}? " if close else ""
    raise ValueError(
        f"unknown reward {spec!r}; {guess}built-in rewards are: {_known()}; or give 'package.module:function', "
        "'path/to/file.py:function', a reward model folder or an 'org/name' hub id"
    )


def _tokenizers(given: Any, n: int) -> list[Any]:
    """Returns one tokenizer (or None) per reward spec from ``reward_processing_classes``."""
    if given is None:
        return [None] * n
    tokenizers = list(given) if isinstance(given, (list, tuple)) else [given]
    if len(tokenizers) != n:
        raise ValueError(
            f"reward_processing_classes has {len(tokenizers)} entries for {n} reward functions; give one per "
            "function (None where it is not a reward model, or where the model's own tokenizer should be loaded)"
        )
    return tokenizers


def resolve_reward_funcs(
    specs: Sequence[Any] | str | os.PathLike | Callable,
    *,
    max_completion_length: int | None = None,
    reward_processing_classes: Sequence[Any] | Any = None,
    step_separator: str = "\n",
) -> list[Callable]:
    """Returns one reward function per spec (see the module docstring for the accepted forms).

    `reward_processing_classes` (TRL's argument): one tokenizer, or a list aligned with `specs`, for the
    reward models among them (None entries: the model's own tokenizer is loaded; entries of plain
    functions are ignored). Each function's signature is read here, once.
    """
    if isinstance(specs, (str, os.PathLike)) or callable(specs):
        specs = [specs]
    specs = list(specs)
    if not specs:
        raise ValueError(f"no reward functions given; use at least one of: {_known()}")
    tokenizers = _tokenizers(reward_processing_classes, len(specs))
    funcs = [
        _resolve_one(spec, max_completion_length, tok, step_separator) for spec, tok in zip(specs, tokenizers)
    ]
    for func in funcs:
        reward_signature(func)  # cached for score(); refuses functions that cannot take keyword arguments
    return funcs
