"""Test configuration: every module in tests/fixtures/ is loaded as a pytest plugin,
so each area keeps its fixtures in its own file."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("KVMESH_LOG_FORMAT", "text")

pytest_plugins = sorted(
    f"tests.fixtures.{p.stem}" for p in (Path(__file__).parent / "fixtures").glob("*.py") if p.stem != "__init__"
)


def pytest_collection_modifyitems(config, items) -> None:  # noqa: ARG001 (pytest's hook signature)
    # Tests on the Python 3.12 vLLM venv go last: `make test` builds that venv in the background
    # (a download of several GB on a fresh machine) while everything else runs.
    items.sort(key=lambda item: item.get_closest_marker("py312_venv") is not None)
