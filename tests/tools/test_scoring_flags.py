"""The router, the cluster simulator and ``kvmesh simulate`` take the same scoring flags and env names."""

from __future__ import annotations

import argparse
import dataclasses

from kvmesh.config import add_dataclass_args, load_config
from kvmesh.routing.scoring import ScoringConfig
from kvmesh_router.config import RouterConfig
from kvmesh_tools.cli import cmd_simulate
from kvmesh_tools.clustersim.config import SimConfig

SCORING_FLAGS = {"--" + f.name.replace("_", "-") for f in dataclasses.fields(ScoringConfig)}


def _scoring_flags(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Flag -> argparse dest of every scoring setting the parser takes."""
    return {opt: a.dest for a in parser._actions for opt in a.option_strings if a.dest.startswith("scoring.")}


def _simulate_parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser()
    cmd_simulate.register(top.add_subparsers())
    (sub,) = [a for a in top._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices["simulate"]


def _parser(cls: type, prefix: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_dataclass_args(p, cls, env_prefix=prefix)
    return p


def test_same_scoring_flags_everywhere() -> None:
    router = _scoring_flags(_parser(RouterConfig, "KVMESH_ROUTER_"))
    sim = _scoring_flags(_parser(SimConfig, "KVMESH_SIM_"))
    cli = _scoring_flags(_simulate_parser())
    assert set(router) == SCORING_FLAGS
    assert router == sim == cli


# The router refuses to start with keys on and no key file; scoring is what is tested here.
OFF = {"KVMESH_ROUTER_AUTH": "off"}


def test_scoring_env_names_and_old_router_env() -> None:
    for cls, prefix in ((RouterConfig, "KVMESH_ROUTER_"), (SimConfig, "KVMESH_SIM_")):
        args = _parser(cls, prefix).parse_args(["--queue-weight", "0.5"])
        cfg = load_config(cls, args, env_prefix=prefix, env={prefix + "SCORING_DECODE_HORIZON_STEPS": "8", **OFF})
        assert cfg.scoring == ScoringConfig(queue_weight=0.5, decode_horizon_steps=8.0)
    # The router's flat env names from before the nesting still work (lower precedence).
    env = {"KVMESH_ROUTER_QUEUE_WEIGHT": "2", "KVMESH_ROUTER_PREFILL_S_PER_TOKEN": "1e-4",
           "KVMESH_ROUTER_SCORING_PREFILL_S_PER_TOKEN": "2e-4", **OFF}
    cfg = load_config(RouterConfig, None, env_prefix="KVMESH_ROUTER_", env=env)
    assert cfg.scoring.queue_weight == 2.0 and cfg.scoring.prefill_s_per_token == 2e-4
    assert load_config(RouterConfig, None, env_prefix="KVMESH_ROUTER_", env=OFF).scoring == ScoringConfig()


def test_help_shows_scoring_default_and_env() -> None:
    text = " ".join(_simulate_parser().format_help().split())
    assert "(default: 1.0; env KVMESH_SIM_SCORING_QUEUE_WEIGHT)" in text
    text = " ".join(_parser(RouterConfig, "KVMESH_ROUTER_").format_help().split())
    assert "(default: 64.0; env KVMESH_ROUTER_SCORING_DECODE_HORIZON_STEPS)" in text


def test_a_router_told_there_is_no_store_scores_as_the_simulator_without_one() -> None:
    """``--offload-enabled false`` reaches the routing core, which then takes the no-store weight
    and the LRU cliff, as ``kvmesh simulate --offload-capacity-tokens 0`` does."""
    from kvmesh_router.main import core_config

    default = load_config(RouterConfig, None, env_prefix="KVMESH_ROUTER_", env=OFF)
    # auto: with an indexer, no store until its registry lists one (test_router_store_detection.py);
    # without one, a store is assumed, since nothing could list it.
    assert default.offload_enabled == "auto" and not default.indexer and core_config(default).offload_enabled
    with_indexer = load_config(RouterConfig, None, env_prefix="KVMESH_ROUTER_",
                               env={"KVMESH_ROUTER_INDEXER": "127.0.0.1:1", **OFF})
    assert core_config(with_indexer).offload_enabled is False
    args = _parser(RouterConfig, "KVMESH_ROUTER_").parse_args(["--offload-enabled", "false"])
    for cfg in (load_config(RouterConfig, args, env_prefix="KVMESH_ROUTER_", env=OFF),
                load_config(RouterConfig, None, env_prefix="KVMESH_ROUTER_",
                            env={"KVMESH_ROUTER_OFFLOAD_ENABLED": "false", **OFF})):
        core = core_config(cfg)
        assert core.offload_enabled is False
        assert core.scoring.blocking_w(core.offload_enabled) == cfg.scoring.blocking_weight
        assert core.scoring.cliff(core.offload_enabled)


def test_split_survival_flags_match_and_are_checked(capsys) -> None:
    """The survival rule of the P/D split (kvmesh.routing.survival): one flag pair, one help text and
    one check for the router and the simulator."""
    from kvmesh.config import ConfigError
    from kvmesh.routing.pd_split import SplitConfig

    for cls, prefix in ((RouterConfig, "KVMESH_ROUTER_"), (SimConfig, "KVMESH_SIM_")):
        text = " ".join(_parser(cls, prefix).format_help().split())
        assert f"(default: 0.9; env {prefix}SPLIT_SURVIVAL_FLOOR)" in text
        assert f"(default: 0.95; env {prefix}SPLIT_SURVIVAL_DECAY)" in text
        cfg = load_config(cls, _parser(cls, prefix).parse_args(["--split-survival-floor", "0.5"]),
                          env_prefix=prefix, env=OFF)
        assert cfg.split_survival_floor == 0.5 and cfg.split_survival_decay == SplitConfig.survival_decay
    for bad in ({"split_survival_floor": 1.5}, {"split_survival_decay": 1.0}, {"split_survival_floor": -0.1}):
        try:
            RouterConfig(**bad).validate()
        except ConfigError as exc:
            assert next(iter(bad)) in str(exc)
        else:
            raise AssertionError(f"{bad} accepted")
    sim = _simulate_parser()
    args = sim.parse_args(["--trace", "x", "--split-survival-decay", "1.5"])
    assert args.func(args) == 2 and "'split_survival_decay' must be in [0, 1)" in capsys.readouterr().out
