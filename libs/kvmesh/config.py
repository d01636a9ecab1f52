"""Configuration as dataclasses: defaults in code, overridden by env, then flags.

A service declares ``@dataclass class FooConfig`` with typed, documented fields.
``add_dataclass_args`` turns the fields into ``--field-name`` flags and
``load_config`` resolves precedence: flag > ``PREFIX_FIELD_NAME`` env > default.
A value that does not parse raises ``ConfigError`` naming the setting.

A field whose type is itself a dataclass is *nested*: its fields become flags and
env settings of their own. By default a nested field ``scoring`` gives
``--scoring-<field>`` flags and ``PREFIX_SCORING_<FIELD>`` env names; field
metadata can change that: ``flag_prefix`` (e.g. ``""`` keeps the bare field names as
flags), ``env_aliases`` (older env prefixes, relative to the parent's, still read at
a lower precedence than the canonical name) and ``group`` (the ``--help`` section).
A plain field's metadata may also give ``choices`` (checked for env values too),
``nargs`` (e.g. ``"+"``: ``--trace a b`` for a list field) and ``metavar``.
``--help`` shows every setting's default and its env name.

The env prefix belongs to the config class: ``ENV_PREFIX: ClassVar[str] =
"KVMESH_FOO_"``. ``add_dataclass_args`` and ``load_config`` both read it when not
given one, so the names ``--help`` shows are the names that are read.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import types
import typing
from typing import Any, TypeVar

T = TypeVar("T")


class ConfigError(ValueError):
    """A setting has a bad value; the message names the setting and the source."""


def _base_type(tp: Any) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _base_type(args[0]) if args else str
    return tp


def _parse(name: str, tp: Any, raw: Any, source: str) -> Any:
    if not isinstance(raw, str):
        return raw
    base = _base_type(tp)
    origin = typing.get_origin(base)
    try:
        if base is bool:
            low = raw.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off", ""):
                return False
            raise ValueError(raw)
        if base is int:
            return int(raw)
        if base is float:
            return float(raw)
        if origin in (list, tuple):
            raw = raw.strip()
            if raw.startswith("["):
                return list(json.loads(raw))
            items = [x.strip() for x in raw.split(",") if x.strip()]
            (inner,) = typing.get_args(base)[:1] or (str,)
            return [_parse(name, inner, x, source) for x in items]
        if origin is dict or base is dict:
            return dict(json.loads(raw)) if raw.strip() else {}
        return raw
    except (ValueError, json.JSONDecodeError) as exc:
        raise ConfigError(f"setting {name!r} from {source}: cannot parse {raw!r} as {base}") from exc


def _flag(name: str, flag_prefix: str = "") -> str:
    return "--" + flag_prefix + name.replace("_", "-")


def _nested(tp: Any) -> type | None:
    base = _base_type(tp)
    return base if isinstance(base, type) and dataclasses.is_dataclass(base) else None


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _show(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value) or "''"
    if isinstance(value, dict):
        return json.dumps(value) if value else "{}"
    if value == "":
        return "''"
    return str(value)


def _nested_prefixes(f: dataclasses.Field) -> tuple[str, str, list[str]]:
    """(flag prefix, env segment, env alias segments) of a nested field."""
    flag_prefix = f.metadata.get("flag_prefix", f.name.replace("_", "-") + "-")
    env_seg = f.metadata.get("env_prefix", f.name.upper() + "_")
    return flag_prefix, env_seg, list(f.metadata.get("env_aliases", ()))


def env_prefix_of(cls: type) -> str | None:
    """The env prefix a config class declares (``ENV_PREFIX``), if any."""
    return getattr(cls, "ENV_PREFIX", None)


def add_dataclass_args(parser: Any, cls: type, env_prefix: str | None = None) -> None:
    """Add one flag per field; help text comes from field metadata ``help``, plus default and env name.

    ``env_prefix`` defaults to the class's ``ENV_PREFIX``; with neither, ``--help``
    shows no env names. Nested dataclass fields add their own fields (in an argument
    group when ``parser`` is a parser), see the module docstring.
    """
    _add_args(parser, cls, env_prefix if env_prefix is not None else env_prefix_of(cls), "", "")


def _add_args(parser: Any, cls: type, env_prefix: str | None, _flag_prefix: str, _dest_prefix: str) -> None:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        sub = _nested(hints[f.name])
        if sub is not None:
            flag_prefix, env_seg, _ = _nested_prefixes(f)
            target = parser
            if isinstance(parser, argparse.ArgumentParser):
                title = f.metadata.get("group") or f.name
                target = parser.add_argument_group(title, f.metadata.get("help"))
            _add_args(target, sub, None if env_prefix is None else env_prefix + env_seg,
                      _flag_prefix + flag_prefix, _dest_prefix + f.name + ".")
            continue
        extra = f"default: {_show(_default(f))}"
        if env_prefix is not None:
            extra += f"; env {env_prefix}{f.name.upper()}"
        help_text = f.metadata.get("help", "")
        help_text = (f"{help_text} ({extra})" if help_text else f"({extra})").replace("%", "%%")
        flag, dest = _flag(f.name, _flag_prefix), _dest_prefix + f.name
        kw: dict[str, Any] = {"metavar": f.metadata.get("metavar", f.name.upper())}
        if "choices" in f.metadata:
            kw["choices"] = f.metadata["choices"]
            kw.pop("metavar")   # argparse then shows the choices
        if _base_type(hints[f.name]) is bool:
            kw.update(nargs="?", const="true")
        elif "nargs" in f.metadata:
            kw["nargs"] = f.metadata["nargs"]
        parser.add_argument(flag, dest=dest, default=None, help=help_text, **kw)


def load_config(cls: type[T], args: argparse.Namespace | None = None, env_prefix: str | None = None,
                env: typing.Mapping[str, str] | None = None, **overrides: Any) -> T:
    """Build ``cls`` from defaults, env (``PREFIX`` + upper field name), flags and overrides.

    ``env_prefix`` defaults to the class's ``ENV_PREFIX``, else ``KVMESH_``.

    A nested dataclass field is built the same way from its own flags and env names
    (an override of the whole field replaces it).
    """
    env = os.environ if env is None else env
    prefix = env_prefix if env_prefix is not None else (env_prefix_of(cls) or "KVMESH_")
    return _load(cls, args, [prefix], env, "", "", overrides)


def _load(cls: type[T], args: argparse.Namespace | None, env_prefixes: list[str], env: typing.Mapping[str, str],
          flag_prefix: str, dest_prefix: str, overrides: dict[str, Any]) -> T:
    """``env_prefixes``: the canonical prefix last (it wins), older aliases before it."""
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if f.name in overrides and overrides[f.name] is not None:
            values[f.name] = overrides[f.name]
            continue
        sub = _nested(tp)
        if sub is not None:
            sub_flag, env_seg, aliases = _nested_prefixes(f)
            prefixes = [p + a for p in env_prefixes for a in aliases] + [p + env_seg for p in env_prefixes]
            values[f.name] = _load(sub, args, prefixes, env, flag_prefix + sub_flag, dest_prefix + f.name + ".", {})
            continue
        for prefix in env_prefixes:
            key = prefix + f.name.upper()
            if key in env:
                values[f.name] = _parse(f.name, tp, env[key], f"env {key}")
        dest = dest_prefix + f.name
        if args is not None and getattr(args, dest, None) is not None:
            values[f.name] = _parse(f.name, tp, getattr(args, dest), f"flag {_flag(f.name, flag_prefix)}")
        choices = f.metadata.get("choices")
        if choices is not None and f.name in values and values[f.name] not in choices:
            raise ConfigError(f"setting {f.name!r}: {values[f.name]!r} is not one of {list(choices)}")
    cfg = cls(**values)
    validate = getattr(cfg, "validate", None)
    if callable(validate):
        validate()
    return cfg
