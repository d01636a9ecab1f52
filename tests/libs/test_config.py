"""Configuration precedence: flag > env > default, typed parsing."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import ClassVar

import pytest

from kvmesh.config import ConfigError, add_dataclass_args, load_config


@dataclass
class Demo:
    port: int = field(default=50051, metadata={"help": "port"})
    ratio: float = 0.5
    verbose: bool = False
    names: list[str] = field(default_factory=list)
    url: str | None = None


def test_defaults_env_flags_precedence() -> None:
    p = argparse.ArgumentParser()
    add_dataclass_args(p, Demo)
    assert load_config(Demo, p.parse_args([]), env={}) == Demo()
    env = {"X_PORT": "7", "X_RATIO": "0.25", "X_VERBOSE": "true", "X_NAMES": "a,b", "X_URL": "redis://h"}
    cfg = load_config(Demo, p.parse_args([]), env_prefix="X_", env=env)
    assert cfg == Demo(port=7, ratio=0.25, verbose=True, names=["a", "b"], url="redis://h")
    cfg = load_config(Demo, p.parse_args(["--port", "9", "--verbose", "false"]), env_prefix="X_", env=env)
    assert cfg.port == 9 and cfg.verbose is False and cfg.ratio == 0.25


@dataclass
class Inner:
    credit: float = field(default=0.5, metadata={"help": "credit per block"})
    cap: int = 0


@dataclass
class Outer:
    port: int = 1
    inner: Inner = field(default_factory=Inner)
    bare: Inner = field(default_factory=Inner, metadata={"flag_prefix": "b-", "env_prefix": "B_", "env_aliases": [""]})


def test_nested_dataclass_flags_env_and_help() -> None:
    p = argparse.ArgumentParser()
    add_dataclass_args(p, Outer, env_prefix="X_")
    assert load_config(Outer, p.parse_args([]), env={}) == Outer()
    # env: PREFIX + field + nested field; aliases read at a lower precedence
    env = {"X_INNER_CREDIT": "0.25", "X_CAP": "3", "X_B_CAP": "4", "X_CREDIT": "9"}
    cfg = load_config(Outer, p.parse_args([]), env_prefix="X_", env=env)
    assert cfg.inner == Inner(credit=0.25) and cfg.bare == Inner(credit=9.0, cap=4)
    cfg = load_config(Outer, p.parse_args(["--inner-cap", "7", "--b-credit", "2"]), env_prefix="X_", env=env)
    assert cfg.inner == Inner(credit=0.25, cap=7) and cfg.bare == Inner(credit=2.0, cap=4)
    assert load_config(Outer, None, env={}, inner=Inner(cap=5)).inner == Inner(cap=5)
    text = " ".join(p.format_help().split())
    assert "--inner-credit CREDIT credit per block (default: 0.5; env X_INNER_CREDIT)" in text
    assert "--b-cap CAP (default: 0; env X_B_CAP)" in text
    assert "--port PORT (default: 1; env X_PORT)" in text


def test_help_shows_defaults_without_env_prefix() -> None:
    p = argparse.ArgumentParser()
    add_dataclass_args(p, Demo)
    text = " ".join(p.format_help().split())
    assert "--port PORT port (default: 50051)" in text and "env" not in text


@dataclass
class Owned:
    """A config that declares its env prefix, as every service's and tool's config does."""

    ENV_PREFIX: ClassVar[str] = "OWN_"

    port: int = field(default=1, metadata={"help": "port"})
    fmt: str = field(default="a", metadata={"help": "format", "choices": ("a", "b")})
    paths: list[str] = field(default_factory=list, metadata={"help": "inputs", "nargs": "+", "metavar": "PATH"})


def test_the_class_env_prefix_is_shown_and_read() -> None:
    p = argparse.ArgumentParser()
    add_dataclass_args(p, Owned)
    text = " ".join(p.format_help().split())
    assert "--port PORT port (default: 1; env OWN_PORT)" in text
    assert "--fmt {a,b} format (default: a; env OWN_FMT)" in text
    assert "--paths PATH [PATH ...] inputs (default: ''; env OWN_PATHS)" in text
    # The name --help shows is the name load_config reads (no prefix passed to either).
    assert load_config(Owned, p.parse_args([]), env={"OWN_PORT": "7", "OWN_PATHS": "x,y"}) == \
        Owned(port=7, paths=["x", "y"])
    assert load_config(Owned, p.parse_args(["--paths", "a", "b", "--port", "9"]), env={"OWN_PORT": "7"}) == \
        Owned(port=9, paths=["a", "b"])
    # An explicit prefix still wins over the class's.
    assert load_config(Owned, None, env_prefix="X_", env={"OWN_PORT": "7", "X_PORT": "8"}).port == 8


def test_choices_are_checked_for_env_values_too() -> None:
    p = argparse.ArgumentParser()
    add_dataclass_args(p, Owned)
    with pytest.raises(SystemExit):   # argparse refuses a bad flag value itself
        p.parse_args(["--fmt", "c"])
    with pytest.raises(ConfigError, match=r"setting 'fmt': 'c' is not one of \['a', 'b'\]"):
        load_config(Owned, p.parse_args([]), env={"OWN_FMT": "c"})
