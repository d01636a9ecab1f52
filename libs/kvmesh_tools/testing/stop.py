"""Stop a child process the one way every test server and launcher does: ask, wait, then force.

Why one helper: the Redis, Redis Cluster, Mooncake master, Envoy and ``kvmesh serve`` children
each had their own copy of "SIGTERM, wait, SIGKILL, wait", and the copies drifted (one never
reaped the killed process, leaving a zombie holding its port until the test ended). Children
started with ``start_new_session=True`` are signalled as a process group (``group``), so
whatever they spawned goes too.
"""

from __future__ import annotations

import os
import signal
import subprocess


def _signal(proc: subprocess.Popen, sig: int, group: bool) -> None:
    try:
        if group:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
    except ProcessLookupError:
        pass


def stop_process(proc: subprocess.Popen | None, grace_s: float = 10.0, group: bool = False) -> int | None:
    """SIGTERM (a graceful exit), SIGKILL after ``grace_s``; reaped either way. The exit code, or None."""
    if proc is None:
        return None
    if proc.poll() is None:
        _signal(proc, signal.SIGTERM, group)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            kill_process(proc, group)
    return proc.returncode


def kill_process(proc: subprocess.Popen | None, group: bool = False) -> None:
    """SIGKILL, as a crash would, and reap it."""
    if proc is not None and proc.poll() is None:
        _signal(proc, signal.SIGKILL, group)
        proc.wait(5)
