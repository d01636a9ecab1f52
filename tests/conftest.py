"""Test configuration: every module in tests/fixtures/ is loaded as a pytest plugin,
so each area keeps its fixtures in its own file."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("KVMESH_LOG_FORMAT", "text")
# vLLM binds its engine's IPC sockets as <VLLM_RPC_BASE_PATH>/<uuid> (the system temp dir by
# default) and leaves them behind: a day of test runs left 2,233 socket files in /tmp. This
# run's go into one directory of its own (inherited by the vLLM processes it starts), removed
# at its end.
_VLLM_RPC_DIR = tempfile.mkdtemp(prefix="kvmesh-vllm-rpc-")
os.environ.setdefault("VLLM_RPC_BASE_PATH", _VLLM_RPC_DIR)

pytest_plugins = sorted(
    f"tests.fixtures.{p.stem}" for p in (Path(__file__).parent / "fixtures").glob("*.py") if p.stem != "__init__"
)


# Slow tests without vLLM that `make test` runs in the vLLM tier's process (marker
# alongside_vllm) rather than in the other tier's: the two tiers run side by side and the
# other one is the longer, so moving these balances the two and shortens `make test`.
# `make test-integration` (-m "not vllm") still runs them. Chosen for tolerating a busy
# machine: simulations (CPU only, virtual time), the connector wheel's fresh venv, `kvmesh up`
# and router replicas, whose checks wait on conditions. Not test_live.py, test_soak.py or
# test_faults.py, whose checks follow the wall clock. The sim engine's tests against vLLM's
# own classes import vLLM in-process: there, the other process never imports it.
ALONGSIDE_VLLM = (
    "libs/worker/engine/test_sim_block_manager.py",
    "libs/worker/engine/test_sim_engine.py",
    "tools/traffic/test_analyze.py",
    "tools/traffic/test_clustersim.py",
    "tools/traffic/test_mismatch.py",
    "tools/traffic/test_model_keys.py",
    "tools/traffic/test_readers.py",
    "tools/traffic/test_regimes.py",
    "tools/traffic/test_sim_offload.py",
    "tools/test_connector_dist.py",
    "tools/test_cmd_up.py",
    "tools/test_router_replicas.py",
)


def pytest_unconfigure(config) -> None:  # noqa: ARG001 (pytest's hook signature)
    shutil.rmtree(_VLLM_RPC_DIR, ignore_errors=True)


def pytest_collection_modifyitems(config, items) -> None:  # noqa: ARG001 (pytest's hook signature)
    root = Path(__file__).parent
    for item in items:
        rel = item.path.relative_to(root).as_posix() if item.path.is_relative_to(root) else ""
        if rel.startswith(ALONGSIDE_VLLM):
            item.add_marker("alongside_vllm")
    # Tests on the Python 3.12 vLLM venv go last: `make test` builds that venv in the background
    # (a download of several GB on a fresh machine) while everything else runs.
    items.sort(key=lambda item: item.get_closest_marker("py312_venv") is not None)
