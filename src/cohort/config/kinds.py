"""Typed kinds: a config field that holds one of several small dataclasses, each with only its own settings.

A flat section plus rules ("cov_ratio does nothing unless cov_method is set") lets a user write a setting that
changes nothing; a kind cannot hold one. A kind field is annotated as a union of kind classes and None
(``cov: ClipCov | KLCov | None``); each kind class names itself in a ``KIND`` class attribute. In YAML and
``key=value`` overrides a kind is written as its name (its defaults: ``algo.cov=clip_cov``), as a mapping with
its name under ``kind`` (``algo.cov: {kind: kl_cov, coef: 2.0}``), or as none / null / false (off). A field of
one kind class only is an optional section: true turns it on with its defaults, a mapping sets its settings,
and ``kind`` may be left out.

The flat names that older configs and TRL's GRPOConfig use stay as aliases (``algo.cov_method``,
``algo.kl_cov_coef``, ``algo.entropy_target``, ...; :func:`kind_aliases`): each reads and writes its setting of
the kind the field holds. An alias whose kind is not chosen is accepted at its old default (an older cohort
wrote every key of its config, used or not) and refused otherwise, with the key that would make it count.
This module imports nothing of cohort but its errors: the schema, the loader and the checks all read it.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import types
import typing
from collections.abc import Callable
from typing import Any, TypeVar

from cohort.errors import ConfigError

__all__ = [
    "KIND_ALIASES",
    "KIND_KEY",
    "Alias",
    "kind_aliases",
    "kind_name",
    "kind_value",
    "kinds_of",
    "read_alias",
    "write_alias",
]

KIND_KEY = "kind"
"""The key of a kind's mapping that names the kind."""

_C = TypeVar("_C", bound=type)


@dataclasses.dataclass(frozen=True)
class Alias:
    """An older flat name of one setting of a kind field (`setting` "kind": the field's kind itself), or of a
    section that is always there (its `default` then unused)."""

    field: str
    setting: str
    default: Any
    """What the flat name held by default: what reading it gives when its kind is not chosen, and the value
    an older config may still carry for it."""
    turns_on: bool = False
    """The flat name was itself the switch (``ref_update_every: 64`` synced the reference): writing a value
    other than its default turns its one-kind section on, where any other setting's name would be refused."""

    def order(self) -> int:
        """Returns when this alias is written among the ones given together: the kind, then the switches, then
        the settings that need the kind chosen."""
        return 0 if self.setting == KIND_KEY else 1 if self.turns_on else 2


KIND_ALIASES: dict[type, dict[str, Alias]] = {}
"""{config class: {flat name: Alias}}: filled by :func:`kind_aliases`; the loader reads it."""


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    """Returns the class's resolved field annotations (read on every construction of a config with aliases)."""
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def kinds_of(tp: Any) -> dict[str, type] | None:
    """Returns {kind name: class} of a field annotated as a union of kind classes (and None), else None."""
    if typing.get_origin(tp) not in (typing.Union, types.UnionType):
        return None
    classes = [a for a in typing.get_args(tp) if a is not type(None)]
    if not classes or not all(
        dataclasses.is_dataclass(c) and isinstance(getattr(c, "KIND", None), str) for c in classes
    ):
        return None
    return {c.KIND: c for c in classes}


def kind_name(value: Any) -> str:
    """Returns the name of the kind a kind field holds ("none" when it holds None)."""
    return "none" if value is None else str(value.KIND)


def kind_value(current: Any, value: Any, kinds: dict[str, type], key: str) -> tuple[Any, dict[str, Any]]:
    """Returns (what kind field `key` holds after `value` (a name, a mapping, true / false, none) is set over
    `current`, the settings of the mapping left for the caller to apply to it, each checked to be the kind's)."""
    if value is None or value is False or (isinstance(value, str) and value.strip().lower() in _OFF):
        return None, {}
    names = ", ".join(kinds)
    if isinstance(value, str) and value.strip().lower() in _ON and len(kinds) == 1:
        value = True  # "true" from a Python mapping or an environment variable, as YAML's true
    if value is True:
        if len(kinds) == 1:
            cls = next(iter(kinds.values()))
            return (current if isinstance(current, cls) else cls()), {}
        raise ConfigError(f"{key}=true: name its kind, one of {names} (or none)")
    named_as = key  # where the kind's name was written: the key itself, or its mapping's `kind`
    if isinstance(value, str):
        name, settings = value.strip(), {}
    elif isinstance(value, dict):
        settings = dict(value)
        name = settings.pop(KIND_KEY, None)
        named_as = f"{key}.{KIND_KEY}"
        if name is None:
            if len(kinds) == 1:
                name = next(iter(kinds))
            elif current is not None:
                name = kind_name(current)
            else:
                raise ConfigError(f"{key} needs its kind: {key}.{KIND_KEY}=<one of {names}>, or {key}=<name>")
    elif len(kinds) == 1:
        settings_of = [f.name for f in dataclasses.fields(next(iter(kinds.values())))]
        example = f" ({key}.{settings_of[0]}=...)" if settings_of else ""
        raise ConfigError(
            f"{key}={value!r}: give true (on, with its defaults), false (off) or its settings{example}"
        )
    else:
        raise ConfigError(f"{key}={value!r}: give a kind ({names}), a mapping with its settings, or none")
    chosen = kinds.get(str(name))
    if chosen is None:
        raise ConfigError(f"{named_as}={name!r} is not one of {names} (or none)")
    fields = [f.name for f in dataclasses.fields(chosen)]
    for setting in settings:
        if setting not in fields:
            others = [n for n, c in kinds.items() if setting in {f.name for f in dataclasses.fields(c)}]
            where = f"; {' and '.join(others)} {'has' if len(others) == 1 else 'have'} it" if others else ""
            raise ConfigError(
                f"{key}.{setting} is not a setting of {key} kind {name} (its settings: {', '.join(fields)}){where}"
            )
    instance = copy.deepcopy(current) if isinstance(current, chosen) else chosen()
    return instance, settings


_OFF = ("none", "null", "off", "false", "no", "0", "")
_ON = ("true", "on", "yes", "1")


def kind_aliases(**aliases: Alias) -> Callable[[_C], _C]:
    """Returns a class decorator for a config dataclass with kind fields or sections: each alias (an older flat
    name) becomes a constructor keyword and a property that read and write that setting of the field's kind, or
    of a section that is always there (``iterative.rm_lr`` of ``iterative.optim.lr``)."""

    def decorate(cls: _C) -> _C:
        init: Callable[..., None] = vars(cls)["__init__"]  # the dataclass's own

        @functools.wraps(init)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            given = {k: kwargs.pop(k) for k in list(kwargs) if k in aliases}
            init(self, *args, **kwargs)
            hints = _hints(type(self))
            for field in {a.field for a in aliases.values()}:
                kinds = kinds_of(hints[field])
                value = getattr(self, field)
                if kinds is None:  # a plain section: written through a copy, as one passed in may be shared
                    if any(aliases[n].field == field for n in given):
                        setattr(self, field, copy.copy(value))
                    continue
                # A kind given as YAML writes it (True, a name, a mapping): the kind's instance.
                if value is not None and not isinstance(value, tuple(kinds.values())):
                    instance, settings = kind_value(None, value, kinds, field)
                    for setting, v in settings.items():
                        setattr(instance, setting, v)
                    setattr(self, field, instance)
            for name in sorted(given, key=lambda n: aliases[n].order()):  # the kind first
                write_alias(self, name, given[name], name)

        type.__setattr__(cls, "__init__", __init__)  # mypy refuses `cls.__init__ = ...` on a class
        for name in aliases:
            setattr(cls, name, _alias_property(name))
        KIND_ALIASES[cls] = dict(aliases)
        return cls

    return decorate


def _alias_property(name: str) -> property:
    def get(self: Any) -> Any:
        return read_alias(self, name)

    def put(self: Any, value: Any) -> None:
        write_alias(self, name, value, name)

    return property(get, put, doc=f"Alias of a setting of a kind field ({name}: see cohort.config.kinds).")


def read_alias(obj: Any, name: str) -> Any:
    """Returns what flat name `name` reads on `obj`: its setting of the kind held, else its old default."""
    alias = KIND_ALIASES[type(obj)][name]
    held = getattr(obj, alias.field)
    if alias.setting == KIND_KEY:
        return kind_name(held)
    if held is not None and hasattr(held, alias.setting):
        return getattr(held, alias.setting)
    return copy.deepcopy(alias.default)


def write_alias(
    obj: Any, name: str, value: Any, key: str, coerce: Callable[[Any, Any, str], Any] | None = None
) -> None:
    """Sets flat name `name` (written as `key`) on `obj`: the field's kind, or that setting of the kind held.

    A setting of a kind that is not chosen is refused unless it is the old default (ConfigError naming the
    key that chooses a kind that reads it). `coerce(value, type, key)`: the loader's conversion of a YAML or
    command-line value (None: the value as given)."""
    alias = KIND_ALIASES[type(obj)][name]
    hints = _hints(type(obj))
    kinds = kinds_of(hints[alias.field]) or {}
    if alias.setting == KIND_KEY:
        instance, _ = kind_value(getattr(obj, alias.field), value, kinds, key)
        setattr(obj, alias.field, instance)
        return
    held = getattr(obj, alias.field)
    holders = [n for n, c in kinds.items() if alias.setting in {f.name for f in dataclasses.fields(c)}]
    if held is None and alias.turns_on and len(kinds) == 1 and value is not None:
        section = next(iter(kinds.values()))
        if coerce is not None:  # "0" from the command line is the default, and turns nothing on
            value = coerce(value, _hints(section)[alias.setting], key)
        if value != alias.default:
            held = section()
            setattr(obj, alias.field, held)
    if held is None or not hasattr(held, alias.setting):
        if value is None or value == alias.default:
            return  # an older config's default, written whether used or not
        field = obj_prefix(key) + alias.field
        if len(kinds) == 1:
            # A section whose flat names were its switches is turned on by one of those settings.
            switches = [
                a.setting for a in KIND_ALIASES[type(obj)].values() if a.field == alias.field and a.turns_on
            ]
            how = (
                " or ".join(f"{field}: {{{sw}: ..., {alias.setting}: ...}}" for sw in switches)
                if switches
                else f"{field}=true, or {field}: {{{alias.setting}: ...}}"
            )
            raise ConfigError(
                f"{key}={value!r} does nothing while {field} is off: turn it on ({how}) or drop this key"
            )
        readers = (
            " and ".join(holders) if len(holders) < 3 else f"{', '.join(holders[:-1])} and {holders[-1]}"
        )
        raise ConfigError(
            f"{key}={value!r} does nothing with {field}={kind_name(held)}: only {readers} "
            f"read{'s' if len(holders) == 1 else ''} it; choose one ({field}: {{kind: {holders[0]}, "
            f"{alias.setting}: ...}}) or drop this key"
        )
    if value is None:  # "the kind's default", as older configs wrote it
        value = getattr(type(held)(), alias.setting)
    elif coerce is not None:
        value = coerce(value, _hints(type(held))[alias.setting], key)
    setattr(held, alias.setting, value)


def obj_prefix(key: str) -> str:
    """Returns the section prefix of a dotted key ("algo." of "algo.cov_ratio"; "" for a bare name)."""
    return key.rsplit(".", 1)[0] + "." if "." in key else ""
