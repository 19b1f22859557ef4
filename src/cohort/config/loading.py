"""Building a config from YAML and dotted ``key=value`` overrides, and writing it back.

A config is built in this order, each layer overriding the one before: field defaults (or a base config),
the named ``preset`` (:mod:`cohort.config.presets`), the YAML file, then overrides such as ``algo.beta=0.04``.
Every value is converted to its field's annotated type here (:func:`_coerce`), naming the key when it
cannot be; an unknown key is refused with the nearest valid keys (or the cohort name of a TRL field).
YAML is read as data only, and a key given twice in one mapping is an error.

Why not OmegaConf's merge and dotted overrides over the same dataclasses (tried with OmegaConf 2.4, which
takes every annotation of the schema and refuses duplicate YAML keys too): it does not convert what this
module converts (``steps=1e3`` or ``2.0`` to an int, ``rewards=a,b`` to a list, a YAML ``off`` in a text
field to "off" rather than "False"), refuses dotted keys inside a mapping (``algo.beta: 0.1``), resolves
``${...}`` inside any text value, and words its errors its own way over several lines ("Key 'betta' not in
'AlgoConfig'", "Value 'many' of type 'str' could not be converted to Integer", "Merge error: int is not a
subclass of ModelConfig"), without the key=value form, the TRL names or the moved keys these messages
give. Wrapped thinly, it failed 13 of the 146 tests of tests/test_config*.py and tests/test_bad_input.py;
making them pass would keep most of this module besides the new dependency.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import difflib
import inspect
import os
import textwrap
import types
import typing
import warnings
from pathlib import Path
from typing import Any

import yaml

from cohort.compat.fields import TRL_FIELDS
from cohort.config.checked import TrainConfig
from cohort.config.kinds import KIND_ALIASES, KIND_KEY, kind_name, kind_value, kinds_of, write_alias
from cohort.config.presets import PRESETS, apply_preset
from cohort.errors import ConfigError, ConfigWarning

__all__ = [
    "MOVED_KEYS",
    "current_keys",
    "describe_keys",
    "field_docs",
    "from_dict",
    "load_config",
    "parse_overrides",
    "read_yaml",
    "read_yaml_file",
    "save_config",
    "to_dict",
]


MOVED_KEYS: dict[str, str] = {
    "rollout.packed_weights": "fast.packed_weights",
    "malloc_mmap_threshold_mib": "fast.heap_mmap_threshold_mib",
}
"""Keys that moved, and where to: an old config naming one gets an error pointing at the new key."""


def field_docs(cls: type) -> dict[str, str]:
    """Return {field name: docstring} for a config dataclass, read from its source."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):  # a subclass's fields and docstrings may live in its bases
        if klass is object or not dataclasses.is_dataclass(klass):
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        body = tree.body[0].body  # type: ignore[attr-defined]
        for prev, node in zip(body, body[1:]):
            if (
                isinstance(prev, ast.AnnAssign)
                and isinstance(prev.target, ast.Name)
                and isinstance(node, ast.Expr)
                and isinstance(node.value, ast.Constant)
            ):
                docs[prev.target.id] = str(node.value.value)
    return docs


def _valid_keys(cls: type, prefix: str = "") -> list[str]:
    """Returns every dotted leaf key of a config dataclass, in declaration order."""
    keys = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        t = hints[f.name]
        if isinstance(t, type) and dataclasses.is_dataclass(t):
            keys += _valid_keys(t, f"{prefix}{f.name}.")
        else:  # a kind field too: its settings depend on its kind, whose own check names them
            keys.append(prefix + f.name)
    return keys


_BOOLEAN_MEANS: dict[str, tuple[Any, Any]] = {"resume": ("auto", None)}
"""String keys whose true / false mean a value of their own (resume=true continues the newest checkpoint, as TRL's
resume_from_checkpoint=True), not the words on / off."""


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Return `value` converted to the annotated type `tp`, or raise ConfigError naming `key`."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{key}: cannot use {value!r}")
    if origin is list:
        if isinstance(value, str):
            value = yaml.safe_load(value) if value.startswith("[") else [v for v in value.split(",") if v]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}={value!r}: expected a list, e.g. {key}=[a,b]")
        return [_coerce(v, args[0], key) for v in value] if args else list(value)
    if origin is dict or tp is dict:
        if isinstance(value, str):
            value = yaml.safe_load(value)
        if not isinstance(value, dict):
            raise ConfigError(f"{key}={value!r}: expected a mapping, e.g. {key}={{a: 1}}")
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
            return value.lower() in ("true", "1", "yes", "on")
        raise ConfigError(f"{key}={value!r}: expected true or false")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{key}={value!r}: expected an integer")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                f = float(value)
            except ValueError:
                f = None
            if f is not None and f.is_integer():
                return int(f)
        raise ConfigError(f"{key}={value!r}: expected an integer")
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{key}={value!r}: expected a number")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}={value!r}: expected a number") from None
    if tp is str:
        if isinstance(value, bool) and key in _BOOLEAN_MEANS:
            return _BOOLEAN_MEANS[key][not value]
        if isinstance(value, bool):  # YAML 1.1 reads a bare on / off (yes / no) as a boolean
            return "on" if value else "off"
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{key}={value!r}: expected a string")
        return str(value)
    return value


def _apply(obj: Any, values: dict[str, Any], prefix: str = "") -> None:
    """Sets the fields of a config tree from nested `values`, converted to their types (ConfigError naming the key)."""
    hints = typing.get_type_hints(type(obj))
    names = {f.name for f in dataclasses.fields(obj)}
    flat = KIND_ALIASES.get(type(obj), {})

    def order(k: str) -> int:  # a kind before the flat names of its settings, which need the kind chosen
        return 1 if k not in flat else 0 if flat[k].setting == KIND_KEY else 1 + flat[k].order()

    for k in sorted(values, key=order):
        v = values[k]
        key = prefix + k
        if k in flat:  # an older flat name of a kind's or a section's setting (cohort.config.kinds)
            write_alias(obj, k, v, key, coerce=_coerce)
            continue
        if k in names and (kinds := kinds_of(hints[k])) is not None:
            instance, settings = kind_value(getattr(obj, k), v, kinds, key)
            if settings:
                _apply(instance, settings, key + ".")
            setattr(obj, k, instance)
            continue
        if k not in names:
            if key in MOVED_KEYS:
                raise ConfigError(
                    f"config key {key!r} moved to {MOVED_KEYS[key]!r} (the fast-path switchboard, "
                    f"auto | on | off for switches); rename it"
                )
            raise ConfigError(_unknown_key_message(key, _valid_keys(type(obj), prefix)))
        tp = hints[k]
        if dataclasses.is_dataclass(tp):
            if not isinstance(v, dict):
                raise ConfigError(
                    f"{key} is a section; give its keys, e.g. {key}.{dataclasses.fields(tp)[0].name}=..."
                )
            _apply(getattr(obj, k), v, key + ".")
        else:
            setattr(obj, k, _coerce(v, tp, key))


def describe_keys(cls: type = TrainConfig, prefix: str = "", obj: Any = None) -> list[tuple[str, Any, str]]:
    """Returns (dotted key, default, docstring) for every key of the config tree, in declaration order."""
    obj = cls() if obj is None else obj
    docs = field_docs(cls)
    hints = typing.get_type_hints(cls)
    out: list[tuple[str, Any, str]] = []
    for f in dataclasses.fields(cls):
        t = hints[f.name]
        kinds = kinds_of(t)
        if isinstance(t, type) and dataclasses.is_dataclass(t):
            out += describe_keys(t, f"{prefix}{f.name}.", getattr(obj, f.name))
        elif kinds is not None:  # the field (its kind's name), then each kind's settings, named by kind
            out.append((prefix + f.name, kind_name(getattr(obj, f.name)), docs.get(f.name, "")))
            for name, cls in kinds.items():
                held = getattr(obj, f.name)
                inner = held if isinstance(held, cls) else cls()
                for setting, default, doc in describe_keys(cls, f"{prefix}{f.name}.", inner):
                    out.append((setting, default, f"[{name}] {doc}"))
        else:
            out.append((prefix + f.name, getattr(obj, f.name), docs.get(f.name, "")))
    return out


def _unknown_key_message(key: str, valid: list[str]) -> str:
    """Returns the error for an unknown key: the closest valid keys, or the cohort twin of a TRL field name."""
    leaf = key.rsplit(".", 1)[-1]
    trl = TRL_FIELDS.get(leaf)
    if trl is not None and trl.cohort is not None and trl.cohort.startswith("state."):
        return (
            f"unknown config key {key!r}: TRL's {leaf!r} belongs to the Python API (GRPOConfig({leaf}=...), read "
            f"by callbacks): {trl.note}"
        )
    if trl is not None and trl.cohort is not None and trl.cohort != leaf:
        return f"unknown config key {key!r}: {leaf!r} is TRL's name; cohort's is {trl.cohort!r}"
    if trl is not None and trl.cohort is None:
        return f"unknown config key {key!r}: TRL's {leaf!r} is not implemented by cohort; nearest: {trl.note}"
    everything = _valid_keys(TrainConfig)
    leaves = {v.rsplit(".", 1)[-1]: v for v in valid}  # this section's keys, by their last part
    # and its sub-sections by name ('modle' -> model), which a misspelt section is compared with
    prefix = key.rsplit(".", 1)[0] + "." if "." in key else ""
    for v in valid:
        rest = v[len(prefix) :] if v.startswith(prefix) else ""
        if "." in rest:
            leaves.setdefault(rest.split(".", 1)[0], f"{prefix}{rest.split('.', 1)[0]}.*")
    close = [leaves[m] for m in difflib.get_close_matches(leaf, list(leaves), n=3, cutoff=0.6)]
    close += [m for m in difflib.get_close_matches(key, everything, n=3, cutoff=0.85) if m not in close]
    if close:
        return f"unknown config key {key!r}; did you mean {', '.join(repr(c) for c in close[:3])}?"
    section = f" in {key.rsplit('.', 1)[0]!r}" if "." in key else ""
    return (
        f"unknown config key {key!r}; the keys{section} are: {', '.join(valid)} (`cohort config` lists all)"
    )


def _nest(dotted: dict[str, Any]) -> dict[str, Any]:
    """Returns the nested dict of a {dotted key: value} dict."""
    out: dict[str, Any] = {}
    for key, value in dotted.items():
        node = out
        parts = key.split(".")
        for i, p in enumerate(parts[:-1]):
            parent, node = node, node.setdefault(p, {})
            # a kind chosen by a word in the same command (x=true, x=<kind>), then given settings (x.setting=...)
            if node is True or (isinstance(node, str) and node.strip().lower() in ("true", "on", "yes")):
                node = parent[p] = {}
            elif isinstance(node, str):
                node = parent[p] = {KIND_KEY: node}
            if not isinstance(node, dict):
                raise ConfigError(f"{key}: {'.'.join(parts[: i + 1])}={node!r} is not a section")
        node[parts[-1]] = value
    return out


def _deep_merge(base: dict, extra: dict) -> dict:
    """Returns `base` updated by `extra`, merging nested dicts key by key."""
    out = dict(base)
    for k, v in extra.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """Return the nested dict described by ``key=value`` strings (values parsed as YAML scalars)."""
    flat: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key=value (e.g. algo.beta=0.04)")
        key, raw = item.split("=", 1)
        key = key.strip().lstrip("-").replace("-", "_")
        if not key:
            raise ConfigError(
                f"override {item!r} has no key before '='; write key=value (e.g. algo.beta=0.04)"
            )
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        if isinstance(value, dict) and not raw.lstrip().startswith("{"):
            value = raw  # `rewards=f.py:` or `x=a: b` is a text with a colon, not a YAML mapping
        flat[key] = value
    return _nest(flat)


def load_config(
    path: str | os.PathLike | None = None,
    overrides: list[str] | dict[str, Any] | None = None,
    *,
    base: TrainConfig | None = None,
) -> TrainConfig:
    """Return a TrainConfig from defaults (or `base`), preset, YAML file and overrides, in that order."""
    layers: dict[str, Any] = {}
    from_file: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if p.is_dir():
            hint = f" (e.g. {str(p / 'config.yaml')!r})" if (p / "config.yaml").is_file() else ""
            raise ConfigError(f"config file {str(p)!r} is a folder; pass the path of a YAML file{hint}")
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist; pass the path of a YAML file")
        loaded = read_yaml_file(p, "config file")
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {str(p)!r} must hold a mapping of keys to values")
        from_file = _nest_top(loaded)
        layers = _deep_merge(layers, from_file)
    if overrides:
        extra = parse_overrides(list(overrides)) if isinstance(overrides, list) else _nest_top(overrides)
        layers = _deep_merge(layers, extra)
    cfg = dataclasses.replace(base) if base is not None else TrainConfig()
    cfg = from_dict(to_dict(cfg))  # deep copy
    preset = layers.get("preset", cfg.preset)
    if preset is not None:
        apply_preset(cfg, preset)
        _after_preset(cfg, str(preset), layers, from_file)
    _apply(cfg, layers)
    return cfg


def _after_preset(cfg: TrainConfig, preset: str, layers: dict[str, Any], from_file: dict[str, Any]) -> None:
    """Returns None after fitting the preset's values to the layers applied after it: its loss parameters are
    dropped where a later layer names another loss (they are that loss's, and refused by any other), and a
    ConfigWarning names the file's values that win over a preset given only as an override (the file comes later
    in the order, whatever the command line's order)."""
    values = PRESETS[preset]  # a known name: apply_preset refused any other
    algo = layers.get("algo")
    later: dict[str, Any] = algo if isinstance(algo, dict) else {}
    own = values.get("algo", {})
    if "loss_type" in later and later["loss_type"] != own.get("loss_type") and "loss_kwargs" not in later:
        cfg.algo.loss_kwargs = {}
    if "preset" in from_file or not from_file:
        return
    beaten = [
        f"{section}.{key}={from_file[section][key]!r} (the preset's {value!r})"
        for section, settings in values.items()
        for key, value in settings.items()
        if isinstance(from_file.get(section), dict)
        and key in from_file[section]
        and from_file[section][key] != value
        and not (isinstance(layers.get(section), dict) and layers[section].get(key) == value)
    ]
    if beaten:
        warnings.warn(
            f"preset={preset} is applied before the config file, and the file's {', '.join(beaten)} win over "
            "it; to take the preset's values, remove them from the file or give them as overrides too",
            ConfigWarning,
            stacklevel=3,
        )


class _StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a key given twice in one mapping is an error, not last-wins."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, Any] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            try:
                first = seen.get(key)
            except TypeError:
                continue  # an unhashable key: the base class reports it
            if first is not None:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"key {key!r} is given twice (first on line {first.line + 1}); keep one of them",
                    key_node.start_mark,
                )
            seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)


def _yaml_problem(e: yaml.YAMLError) -> str:
    """Returns a YAML error as one line: the problem and the line it was found on."""
    problem = getattr(e, "problem", None)
    mark = getattr(e, "problem_mark", None)
    if problem is None:
        return " ".join(str(e).split())
    where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
    context = getattr(e, "context", None)
    return f"{context + ': ' if context else ''}{problem}{where}"


def read_yaml(text: str) -> Any:
    """Returns the YAML document in text, refusing a mapping that gives a key twice."""
    return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass


def read_yaml_file(path: str | os.PathLike, what: str) -> Any:
    """Returns the YAML document in a file ({} when empty); ConfigError in one line for any problem.

    Parsed as data only (a SafeLoader: a ``!!python/...`` tag is an error, never a call), refusing a
    key given twice. `what` names the file in messages ("config file", "pipeline file")."""
    p = Path(path)
    try:
        return read_yaml(p.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError as e:
        raise ConfigError(f"{what} {str(p)!r} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{what} {str(p)!r} is not valid YAML: {_yaml_problem(e)}") from None


def _nest_top(d: dict[str, Any]) -> dict[str, Any]:
    """Nest any dotted keys of a YAML mapping so `algo.beta: 0.1` and `algo: {beta: 0.1}` both work."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        v = _nest_top(v) if isinstance(v, dict) else v
        out = _deep_merge(out, _nest({str(k): v}))
    return out


def to_dict(cfg: Any) -> dict[str, Any]:
    """Return the config as plain nested dicts (for YAML / JSON); a kind as a mapping naming it under `kind`."""
    hints = typing.get_type_hints(type(cfg))
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        kinds = kinds_of(hints[f.name])
        if kinds is not None and value is not None:
            named = {KIND_KEY: kind_name(value)} if len(kinds) > 1 else {}
            out[f.name] = {**named, **dataclasses.asdict(value)}
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            out[f.name] = to_dict(value)
        else:
            out[f.name] = copy.deepcopy(value)
    return out


def from_dict(d: dict[str, Any]) -> TrainConfig:
    """Return a TrainConfig built from nested dicts (unknown keys raise ConfigError)."""
    cfg = TrainConfig()
    _apply(cfg, d)
    return cfg


def current_keys(d: dict[str, Any], cls: type = TrainConfig) -> dict[str, Any]:
    """Returns a copy of the config mapping `d` (as an older cohort wrote it) with each alias key moved to the
    field it names (``iterative.rm_lr`` to ``iterative.optim.lr``; ``algo.kl_cov_coef`` to ``algo.cov``'s kind);
    an `optim` section it has to create holds that class's defaults besides, as the older config ran with them."""
    out = dict(d)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if isinstance(tp, type) and dataclasses.is_dataclass(tp) and isinstance(out.get(f.name), dict):
            out[f.name] = current_keys(out[f.name], tp)
    kind_fields = [f.name for f in dataclasses.fields(cls) if kinds_of(hints[f.name]) is not None]
    flat = KIND_ALIASES.get(cls, {})
    given = {k: out.pop(k) for k in list(out) if k in flat}
    for k in [k for k in given if flat[k].field not in kind_fields]:  # a setting of a section always there
        field, value = flat[k].field, given.pop(k)
        section = out.get(field)
        base = section if isinstance(section, dict) else dataclasses.asdict(getattr(cls(), field))
        out[field] = {**base, flat[k].setting: value}
    named = [n for n in kind_fields if n in out or any(flat[k].field == n for k in given)]
    if named:
        # The kinds as this cohort writes them: an older cohort wrote adaptive_entropy: false and flat names
        # (cov_method, kl_cov_coef, ...); a setting of a kind it did not choose changed nothing then.
        obj = cls()
        for name in kind_fields:
            if name in out:
                try:
                    _apply(obj, {name: out[name]})
                except ConfigError:
                    continue
        for k in sorted(given, key=lambda k: flat[k].order()):
            try:
                write_alias(obj, k, given[k], k, coerce=_coerce)
            except ConfigError:
                continue
        written = to_dict(obj)
        for name in named:
            out[name] = written[name]
    return out


def save_config(cfg: TrainConfig, path: str | os.PathLike) -> None:
    """Write the resolved config as YAML to `path` (returns None)."""
    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
