"""The trace a command reads (``--trace``, ``--format``, ``--limit-sessions``), as settings.

Why it exists: ``kvmesh simulate`` and ``kvmesh replay`` read traces the same
way; each subclasses this with its own outputs and its own ``ENV_PREFIX``, so
the flags, defaults and env names come from ``kvmesh.config`` like every other
setting.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvmesh_tools.traffic.readers import FORMATS


@dataclass
class TraceArgs:
    trace: list[str] = field(default_factory=list, metadata={
        "help": "trace files or directories", "nargs": "+", "metavar": "PATH"})
    format: str = field(default="weka", metadata={"help": "trace format", "choices": FORMATS})
    limit_sessions: int = field(default=0, metadata={"help": "use only the first N sessions (0 = all)"})
