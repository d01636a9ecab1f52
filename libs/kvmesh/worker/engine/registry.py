"""The worker's engine backends by name (``--engine``): the one table of them.

Why it exists: a worker runs the engine its settings name. Each backend is an
``Engine`` subclass that builds itself from the worker's settings
(``from_worker_config``); its module is imported only when it is chosen, so a
sim worker never loads vLLM. Adding a backend: its module, plus one line here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvmesh.registry import LazyRegistry

if TYPE_CHECKING:
    from kvmesh.worker.engine.base import Engine

ENGINES: LazyRegistry[type[Engine]] = LazyRegistry("engine", {
    "sim": ("kvmesh.worker.engine.sim.engine", "SimEngine"),
    "vllm": ("kvmesh.worker.engine.vllm_engine", "VllmEngine"),
})
