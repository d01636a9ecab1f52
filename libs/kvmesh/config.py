"""Configuration as dataclasses: defaults in code, overridden by env, then flags.

A service declares ``@dataclass class FooConfig`` with typed, documented fields.
``add_dataclass_args`` turns the fields into ``--field-name`` flags and
``load_config`` resolves precedence: flag > ``PREFIX_FIELD_NAME`` env > default.
A value that does not parse raises ``ConfigError`` naming the setting.
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


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type) -> None:
    """Add one flag per field; help text comes from field metadata ``help``."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        help_text = f.metadata.get("help", "")
        if _base_type(hints[f.name]) is bool:
            parser.add_argument(_flag(f.name), dest=f.name, default=None, nargs="?", const="true", help=help_text)
        else:
            parser.add_argument(_flag(f.name), dest=f.name, default=None, help=help_text)


def load_config(cls: type[T], args: argparse.Namespace | None = None, env_prefix: str = "KVMESH_",
                env: typing.Mapping[str, str] | None = None, **overrides: Any) -> T:
    """Build ``cls`` from defaults, env (``PREFIX`` + upper field name), flags and overrides."""
    env = os.environ if env is None else env
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        key = env_prefix + f.name.upper()
        if key in env:
            values[f.name] = _parse(f.name, tp, env[key], f"env {key}")
        if args is not None and getattr(args, f.name, None) is not None:
            values[f.name] = _parse(f.name, tp, getattr(args, f.name), f"flag {_flag(f.name)}")
        if f.name in overrides and overrides[f.name] is not None:
            values[f.name] = overrides[f.name]
    cfg = cls(**values)
    validate = getattr(cfg, "validate", None)
    if callable(validate):
        validate()
    return cfg
