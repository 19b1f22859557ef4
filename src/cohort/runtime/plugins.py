"""Load user code named in a config: ``my_pkg.module:function`` or ``path/to/file.py:function``.

Reward functions (`rewards:`), policy losses (`algo.loss_type`) and advantage estimators (`algo.advantage`)
all name user functions this way; every failure is a ValueError that starts with `label` (the option and
the spec) and says what to fix.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cohort.algo import check_loss_kwargs, register_loss
from cohort.algo.estimators import ADVANTAGE_TYPES, check_advantage_kwargs, register_advantage
from cohort.algo.losses import LOSS_TYPES
from cohort.algo.options import advantage_arguments, check_algo
from cohort.choices import is_function_spec
from cohort.errors import ConfigError


def import_failure(exc: BaseException, path: Path | None = None) -> str:
    """Returns one line saying where importing user code failed: the error and its file:line."""
    if isinstance(exc, SyntaxError):
        where = f"{exc.filename or path}:{exc.lineno}"
        return f"{where}: SyntaxError: {exc.msg}; fix the file"
    frames = traceback.extract_tb(exc.__traceback__)
    # The innermost frame in the user's file says which of its lines failed (not importlib's frames).
    own = [f for f in frames if path is not None and Path(f.filename).resolve() == path] or frames[-1:]
    where = f" at {own[-1].filename}:{own[-1].lineno}" if own else ""
    fix = "install it" if isinstance(exc, ImportError) else "fix the file"
    return f"importing it raised {type(exc).__name__}: {exc}{where}; {fix}"


def load_file(path_text: str, label: str) -> Any:
    """Returns the module executed from a Python file (cached under a name derived from its path)."""
    path = Path(path_text).expanduser().resolve()
    if not path.is_file():
        raise ValueError(f"{label}: file {path_text!r} not found (resolved to {str(path)!r})")
    module_name = f"cohort_user_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    file_spec = importlib.util.spec_from_file_location(module_name, path)
    if file_spec is None or file_spec.loader is None:
        raise ValueError(f"{label}: cannot import {str(path)!r} as a Python module")
    module = importlib.util.module_from_spec(file_spec)
    sys.modules[module_name] = module
    try:
        file_spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[module_name]
        raise ValueError(f"{label}: {import_failure(exc, path)}") from exc
    return module


def load_function(key: str, label: str) -> Callable:
    """Returns the function a ``module:function`` or ``file.py:function`` spec names."""
    target, attr = key.rsplit(":", 1)
    if not attr.strip():
        raise ValueError(f"{label} names no function after the ':'; write e.g. '{target}:my_function'")
    if target.endswith(".py") or "/" in target or "\\" in target:
        module = load_file(target, label)
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as exc:
            raise ValueError(
                f"{label}: cannot import module {target!r} ({exc}); check that it is installed "
                "or on PYTHONPATH, or use 'path/to/file.py:function'"
            ) from exc
        except Exception as exc:  # the module exists but its own code fails (SyntaxError included)
            raise ValueError(f"{label}: module {target!r}: {import_failure(exc)}") from exc
    func = getattr(module, attr, None)
    if func is None:
        public = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise ValueError(f"{label}: {target!r} has no attribute {attr!r}; its callables are {public}")
    if not callable(func):
        raise ValueError(
            f"{label}: {attr!r} is a {type(func).__name__}, not a function; name a function defined in it"
        )
    return func


def resolve_loss(spec: str, loss_kwargs: dict[str, Any], label: str = "algo.loss_type") -> str:
    """Return the loss type's name after loading and registering it when it names user code (checks its
    keyword arguments and signature either way)."""
    if spec not in LOSS_TYPES and is_function_spec(spec):
        fn = load_function(spec, f"{label}={spec!r}")
        register_loss(spec, fn, "dapo")
    elif spec not in LOSS_TYPES:
        raise ValueError(
            f"{label}={spec!r} is not a loss type; choose one of {', '.join(LOSS_TYPES)} or name your own as "
            "'my_pkg.module:function' / 'path/to/file.py:function'"
        )
    check_loss_kwargs(spec, loss_kwargs)
    return spec


def resolve_advantage(spec: str, kwargs: dict[str, Any], label: str = "algo.advantage") -> str:
    """Return the advantage estimator's name after loading and registering it when it names user code."""
    if spec not in ADVANTAGE_TYPES and is_function_spec(spec):
        register_advantage(spec, load_function(spec, f"{label}={spec!r}"))
    elif spec not in ADVANTAGE_TYPES:
        raise ValueError(
            f"{label}={spec!r} is not an advantage estimator; choose one of {', '.join(ADVANTAGE_TYPES)} or name "
            "your own as 'my_pkg.module:function' / 'path/to/file.py:function'"
        )
    check_advantage_kwargs(spec, kwargs)
    return spec


def check_user_objective(cfg: Any) -> None:
    """Returns None after importing and registering the loss and advantage estimator a config (`cfg`, a
    TrainConfig) names as user code, and checking that each can run as configured (ConfigError otherwise).

    The config's own validation imports nothing; a trainer calls this once its model, data and run folder are
    checked, so that a refused run runs none of the user's code."""
    a = cfg.algo
    try:
        resolve_loss(a.loss_type, a.loss_kwargs)
        resolve_advantage(a.advantage, advantage_arguments(a.advantage, a))
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError(str(e)) from None
    check_algo(a)  # again, now that what the user's loss and estimator read is known
