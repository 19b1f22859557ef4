"""Turn reward specs (built-in names, ``module:function``, ``file.py:function``, callables) into functions.

Spec forms:
- ``"accuracy"``, ``"format"``: built-in functions (``"accuracy_reward"`` etc. also accepted);
- ``"overlong(max_length=512, buffer=128)"``, ``"length(max_length=512)"``: built-in factories called
  with literal arguments; a bare ``"overlong"`` / ``"length"`` uses ``max_completion_length``;
- ``"my_pkg.rewards:func"``: a function imported from an installed module;
- ``"path/to/file.py:func"``: a function loaded from a Python file;
- any callable, used as is.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import importlib.util
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from cohort.rewards.builtin import accuracy_reward, format_reward, make_length_reward, make_overlong_reward

__all__ = ["BUILTIN_REWARDS", "REWARD_FACTORIES", "resolve_reward_funcs"]

BUILTIN_REWARDS: dict[str, Callable] = {"accuracy": accuracy_reward, "format": format_reward}
"""Parameter-free built-in reward functions by spec name."""

REWARD_FACTORIES: dict[str, Callable[..., Callable]] = {
    "overlong": make_overlong_reward,
    "length": make_length_reward,
}
"""Built-in reward factories by spec name; spec ``"overlong(max_length=512)"`` calls the factory."""

_CALL = re.compile(r"^\s*(\w+)\s*\((.*)\)\s*$", re.DOTALL)


def _known() -> str:
    """Returns the list of built-in spec forms, for error messages."""
    factories = [f"{name}(max_length=...)" for name in REWARD_FACTORIES]
    return ", ".join(sorted(BUILTIN_REWARDS) + factories)


def _call_factory(name: str, args_text: str, spec: str) -> Callable:
    """Returns the function a built-in factory builds from the literal arguments in ``spec``."""
    try:
        call = ast.parse(f"f({args_text})", mode="eval").body
        assert isinstance(call, ast.Call)
        args = [ast.literal_eval(a) for a in call.args]
        kwargs = {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords if kw.arg is not None}
    except (SyntaxError, ValueError, AssertionError) as exc:
        raise ValueError(
            f"reward spec {spec!r}: arguments must be Python literals, e.g. '{name}(max_length=512, buffer=128)'"
        ) from exc
    try:
        return REWARD_FACTORIES[name](*args, **kwargs)
    except TypeError as exc:
        raise ValueError(f"reward spec {spec!r}: {exc}") from exc


def _load_file(path_text: str, spec: str) -> Any:
    """Returns the module executed from a Python file (cached under a name derived from its path)."""
    path = Path(path_text).expanduser().resolve()
    if not path.is_file():
        raise ValueError(f"reward spec {spec!r}: file {path_text!r} not found (resolved to {str(path)!r})")
    module_name = f"cohort_user_reward_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    file_spec = importlib.util.spec_from_file_location(module_name, path)
    if file_spec is None or file_spec.loader is None:
        raise ValueError(f"reward spec {spec!r}: cannot import {str(path)!r} as a Python module")
    module = importlib.util.module_from_spec(file_spec)
    sys.modules[module_name] = module
    try:
        file_spec.loader.exec_module(module)
    except Exception:
        del sys.modules[module_name]
        raise
    return module


def _resolve_one(spec: str | Callable, max_completion_length: int | None) -> Callable:
    """Returns the reward function for one spec."""
    if callable(spec):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"reward spec {spec!r} must be a string or a callable, got {type(spec).__name__}")
    key = spec.strip()
    bare = key.removesuffix("_reward")
    if bare in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[bare]
    call = _CALL.match(key)
    if call and call.group(1).removesuffix("_reward") in REWARD_FACTORIES:
        return _call_factory(call.group(1).removesuffix("_reward"), call.group(2), spec)
    if bare in REWARD_FACTORIES:
        if max_completion_length is None:
            raise ValueError(
                f"reward {spec!r} needs parameters, e.g. '{bare}(max_length=512)'; or resolve it with "
                "max_completion_length set"
            )
        return REWARD_FACTORIES[bare](max_length=max_completion_length)
    if ":" not in key:
        raise ValueError(
            f"unknown reward {spec!r}; built-in rewards are: {_known()}; or give 'package.module:function' "
            "or 'path/to/file.py:function'"
        )
    target, attr = key.rsplit(":", 1)
    if target.endswith(".py") or "/" in target or "\\" in target:
        module = _load_file(target, spec)
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as exc:
            raise ValueError(
                f"reward spec {spec!r}: cannot import module {target!r} ({exc}); check that it is installed "
                "or on PYTHONPATH, or use 'path/to/file.py:function'"
            ) from exc
    func = getattr(module, attr, None)
    if func is None:
        public = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise ValueError(
            f"reward spec {spec!r}: {target!r} has no attribute {attr!r}; its callables are {public}"
        )
    if not callable(func):
        raise TypeError(f"reward spec {spec!r}: {attr!r} is a {type(func).__name__}, not a function")
    return func


def resolve_reward_funcs(
    specs: Sequence[str | Callable] | str | Callable, *, max_completion_length: int | None = None
) -> list[Callable]:
    """Returns one reward function per spec (see the module docstring for the accepted forms)."""
    if isinstance(specs, str) or callable(specs):
        specs = [specs]
    specs = list(specs)
    if not specs:
        raise ValueError(f"no reward functions given; use at least one of: {_known()}")
    return [_resolve_one(spec, max_completion_length) for spec in specs]
