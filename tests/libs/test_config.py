"""Configuration precedence: flag > env > default, typed parsing."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from kvmesh.config import add_dataclass_args, load_config


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
