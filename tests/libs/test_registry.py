"""Every name-to-class table (routing policies, eviction policies, engines) loads what it names.

One registry shape (``kvmesh.registry.LazyRegistry``) for every kind: a name maps to
``(module, class)``, imported on first use. These tests load every entry of every
table, check it is the class that carries that ``name``, and check that an unknown
name is refused with the choices, and that the policy interface imports no policy.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvmesh.config import ConfigError
from kvmesh.kvstore.eviction_registry import EVICTION_POLICIES, is_timed, make_eviction_policy
from kvmesh.registry import LazyRegistry
from kvmesh.routing.policy import Policy
from kvmesh.routing.registry import POLICIES, available_policies, make_policy
from kvmesh.routing.scoring import ScoringConfig
from kvmesh.worker.config import WorkerConfig
from kvmesh.worker.engine.base import Engine
from kvmesh.worker.engine.registry import ENGINES


def test_lazy_registry_loads_on_first_use_and_names_choices() -> None:
    reg: LazyRegistry[type] = LazyRegistry("widget", {"b": ("collections", "OrderedDict"),
                                                     "a": ("fractions", "Fraction")})
    assert reg.names() == ["a", "b"] and list(reg) == ["a", "b"] and len(reg) == 2
    assert "a" in reg and "c" not in reg and ["a"] not in reg
    from collections import OrderedDict
    from fractions import Fraction

    assert reg.load("b") is OrderedDict and reg.load("a") is Fraction
    assert reg.create("a", 1, 2) == Fraction(1, 2)
    for bad in ("c", ["a"], None):   # e.g. a policy field of a JSON request body
        with pytest.raises(ValueError, match=r"unknown widget .*; choose one of a, b"):
            reg.load(bad)  # type: ignore[arg-type]


def test_lazy_registry_imports_nothing_until_a_name_is_used() -> None:
    code = ("import sys\nfrom kvmesh.registry import LazyRegistry\n"
            "r = LazyRegistry('x', {'w': ('wave', 'open')})\n"
            "assert r.names() == ['w'] and 'wave' not in sys.modules\n"
            "r.load('w')\nassert 'wave' in sys.modules\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_a_missing_module_is_an_import_error() -> None:
    reg: LazyRegistry[type] = LazyRegistry("widget", {"gone": ("kvmesh.no_such_module", "X")})
    with pytest.raises(ImportError):
        reg.load("gone")


@pytest.mark.parametrize("name", POLICIES.names())
def test_every_routing_policy_name_is_its_class(name: str) -> None:
    cls = POLICIES.load(name)
    assert issubclass(cls, Policy) and cls.name == name
    p = make_policy(name, ScoringConfig(queue_weight=2.0))
    assert type(p) is cls and p.scoring.queue_weight == 2.0


def test_unknown_routing_policy_names_the_choices() -> None:
    with pytest.raises(ValueError) as e:
        make_policy("nope")
    assert "unknown routing policy 'nope'" in str(e.value)
    assert all(n in str(e.value) for n in available_policies())


def test_policy_interface_imports_no_policy() -> None:
    """The interface and the table load; no implementation until one is asked for."""
    impls = sorted({mod for mod, _ in (POLICIES.location(n) for n in POLICIES)})
    code = ("import sys\nimport kvmesh.routing.policy, kvmesh.routing.registry, kvmesh.routing\n"
            f"loaded = [m for m in {impls!r} if m in sys.modules]\n"
            "assert not loaded, loaded\n"
            "kvmesh.routing.registry.make_policy('session')\n"
            "assert 'kvmesh.routing.session' in sys.modules\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize("name", EVICTION_POLICIES.names())
def test_every_eviction_name_is_its_class(name: str) -> None:
    cls = EVICTION_POLICIES.load(name)
    pol = make_eviction_policy(name)
    assert cls.name == name and type(pol) is cls
    assert is_timed(name) is cls.timed
    # The policy works: one insert is the one victim.
    pol.new_batch()
    pol.insert(("ns", 1), 0, "s")
    assert pol.victim() == ("ns", 1) and len(pol) == 1


def test_unknown_eviction_policy_names_the_choices() -> None:
    with pytest.raises(ValueError, match="unknown eviction policy 'mru'; choose one of agent, greedy-dual"):
        make_eviction_policy("mru")


@pytest.mark.parametrize("name", ENGINES.names())
def test_every_engine_name_is_its_class(name: str) -> None:
    cls = ENGINES.load(name)
    assert issubclass(cls, Engine) and cls.name == name


def test_worker_config_takes_the_engine_names_and_refuses_others() -> None:
    for name in ENGINES:
        WorkerConfig(engine=name).validate()
    with pytest.raises(ConfigError, match=r"setting 'engine': expected one of \['sim', 'vllm'\], got 'tgi'"):
        WorkerConfig(engine="tgi").validate()


def test_sim_engine_builds_from_worker_settings() -> None:
    from kvmesh.worker.run import build_engine

    eng = build_engine(WorkerConfig(engine="sim", role="decode", block_size=32, num_blocks=100), "d-1")
    assert type(eng) is ENGINES.load("sim")
    info = eng.info()
    assert info.engine == "sim" and info.block_size == 32 and info.num_blocks == 100
    assert info.kv_events_topic.startswith("kv@d-1@")
