"""Stop a foreground local stack on SIGTERM or SIGINT, once.

``kvmesh up`` and ``kvmesh demo`` tear their ``LocalStack`` down when interrupted. An orchestrator,
or a user pressing Ctrl-C again, may signal more than once; a second ``KeyboardInterrupt`` raised
inside the teardown would abandon it and leave the services running, orphaned. The teardown is
bounded (each service is killed after its grace), so the signals after the first are ignored.
"""

from __future__ import annotations

import signal

_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def _interrupt_once(signum: int, frame: object) -> None:
    for sig in _SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    raise KeyboardInterrupt


def stop_on_signals() -> None:
    """The first SIGTERM or SIGINT raises ``KeyboardInterrupt`` in the main thread; later ones do nothing."""
    for sig in _SIGNALS:
        signal.signal(sig, _interrupt_once)
