"""A port taken between picking it and the child binding it costs a retry, not a failed start.

``make demo`` once failed with "Address already in use" on a busy machine: every pick-then-bind
has that race, so the launchers restart a child on fresh ports when it dies of a bind failure.
"""

from __future__ import annotations

import socket

import pytest

import kvmesh_tools.testing.redis_server as rs
from kvmesh_tools.testing.ports import free_port
from kvmesh_tools.testing.procs import ServiceProcess, bind_failed
from kvmesh_tools.testing.redis_server import RedisProcess

pytestmark = pytest.mark.timeout(120)


def _held_port() -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", free_port()))
    s.listen()
    return s


def test_bind_failure_messages_are_recognised() -> None:
    assert bind_failed("RuntimeError: Failed to bind to address 127.0.0.1:5")
    assert bind_failed("OSError: [Errno 98] Address already in use")
    assert bind_failed("zmq.error.ZMQError: Address already in use (addr='tcp://127.0.0.1:1')")
    assert not bind_failed("ValueError: --port must be an integer")


def test_a_service_whose_port_was_taken_restarts_on_fresh_ports(tmp_path) -> None:
    held = _held_port()
    taken = held.getsockname()[1]
    picks: list[int] = []

    def ports() -> tuple[list[str], str]:
        port = taken if not picks else free_port()   # the first pick loses the race
        picks.append(port)
        return ["--host", "127.0.0.1", "--port", str(port)], f"127.0.0.1:{port}"

    sp = ServiceProcess.on_fresh_ports("indexer", ports, log_path=tmp_path / "indexer.log")
    try:
        sp.start(timeout_s=60)
        assert len(picks) >= 2 and picks[0] == taken
        assert sp.grpc_address == f"127.0.0.1:{picks[-1]}" and sp.alive()
        assert bind_failed((tmp_path / "indexer.log").read_text())
    finally:
        sp.stop()
        held.close()


def test_a_service_without_fresh_ports_reports_the_bind_failure(tmp_path) -> None:
    held = _held_port()
    port = held.getsockname()[1]
    sp = ServiceProcess("indexer", ["--host", "127.0.0.1", "--port", str(port)], f"127.0.0.1:{port}",
                        log_path=tmp_path / "indexer.log")
    try:
        with pytest.raises(RuntimeError, match="failed to become ready"):
            sp.start(timeout_s=30)
    finally:
        sp.stop()
        held.close()


def test_redis_on_a_taken_port_is_started_on_another() -> None:
    held = _held_port()
    taken = held.getsockname()[1]
    r = RedisProcess()
    real, calls = rs.free_port, []

    def first_taken() -> int:
        calls.append(1)
        return taken if len(calls) == 1 else real()

    rs.free_port = first_taken
    try:
        r.start()
        assert r.port != taken and len(calls) >= 2
    finally:
        rs.free_port = real
        r.stop()
        held.close()


def test_a_stopped_redis_leaves_no_directory_and_starts_again() -> None:
    """Its temporary --dir goes with stop() (every stack and test run left one in /tmp), and a test
    that restarts Redis (stop, then start) gets it back."""
    r = RedisProcess().start()
    workdir = r.workdir
    assert workdir is not None and workdir.is_dir()
    r.stop()
    assert not workdir.exists()
    try:
        r.start()
        assert workdir.is_dir()
    finally:
        r.stop()
    assert not workdir.exists()


def test_with_ports_restarts_on_fresh_ports_and_reads_them_back(tmp_path, monkeypatch) -> None:
    import urllib.request

    import kvmesh_tools.testing.procs as procs

    held = _held_port()
    taken = held.getsockname()[1]
    real, calls = procs.free_port, []

    def first_taken(host: str = "127.0.0.1") -> int:
        calls.append(host)
        return taken if len(calls) == 1 else real(host)

    monkeypatch.setattr(procs, "free_port", first_taken)
    sp = ServiceProcess.with_ports("indexer", lambda port, metrics: [
        "--host", "127.0.0.1", "--port", str(port), "--metrics-port", str(metrics)], count=2,
        log_path=tmp_path / "indexer.log")
    try:
        sp.start(timeout_s=60)
        assert sp.alive() and sp.port != taken and len(calls) >= 4
        mport = sp.flag_port("--metrics-port")
        assert urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=10).status == 200
    finally:
        sp.stop()
        held.close()


def test_stop_kills_and_reaps_a_child_that_ignores_sigterm() -> None:
    import subprocess
    import sys

    from kvmesh_tools.testing.stop import stop_process

    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "up"      # the handler is installed
    assert stop_process(proc, grace_s=0.5) == -9
    assert proc.poll() == -9
    assert stop_process(proc) == -9                     # stopping a stopped child is a no-op
