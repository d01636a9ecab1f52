"""Run kvmesh services as real child processes and wait for gRPC readiness.

Used by the integration tests, the benchmarks and ``kvmesh up``: each service
is started as ``python -m kvmesh_tools.cli.main serve NAME ...`` and is ready when its
gRPC health check answers SERVING.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.rpc.ports import free_port
from kvmesh.rpc.tls import TlsConfig, plaintext, sync_channel
from kvmesh_tools.testing.stop import kill_process, stop_process


def wait_for_serving(address: str, timeout_s: float = 60.0, service: str = "",
                     proc: subprocess.Popen | None = None, tls: TlsConfig | None = None) -> None:
    """Block until ``address`` reports SERVING for ``service``; raise on timeout or early exit.

    ``tls``: the identity to probe with when the service runs mutual TLS (default: plaintext).
    """
    deadline = time.monotonic() + timeout_s
    last: object = None
    with sync_channel(address, tls or plaintext()) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"process for {address} exited with {proc.returncode} before SERVING")
            try:
                resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1.0)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return
                last = resp.status
            except grpc.RpcError as exc:
                last = exc.code()
            time.sleep(0.1)
    raise TimeoutError(f"{address} not SERVING after {timeout_s}s (last: {last})")


# What a child prints when a port it was handed is taken: gRPC, uvicorn, ZMQ and Redis say it so.
BIND_FAILURES = ("address already in use", "failed to bind", "errno 98", "eaddrinuse")
BIND_ATTEMPTS = 4


def bind_failed(log_text: str) -> bool:
    low = log_text.lower()
    return any(s in low for s in BIND_FAILURES)


@dataclass
class ServiceProcess:
    """One ``kvmesh serve NAME`` child process.

    A port picked for a child before the child binds it can be taken in between by any other
    process on the machine; no pick-then-bind is free of that race. So a service started with
    ``ports`` (a function that picks fresh ports and returns ``(args, grpc_address)``) is
    restarted on new ports when it dies of a bind failure, up to ``BIND_ATTEMPTS`` times; read
    ``args``/``grpc_address`` after ``start``/``wait_ready`` for what it really listens on.
    """

    name: str
    args: list[str]
    grpc_address: str
    env: dict[str, str] = field(default_factory=dict)
    log_path: Path | None = None
    proc: subprocess.Popen | None = None
    ports: Callable[[], tuple[list[str], str]] | None = None
    tls: TlsConfig | None = None   # the identity readiness probes use, when the service runs mTLS
    _log_offset: int = 0

    @classmethod
    def on_fresh_ports(cls, name: str, ports: Callable[[], tuple[list[str], str]], **kw: object) -> ServiceProcess:
        args, address = ports()
        return cls(name, args, address, ports=ports, **kw)  # type: ignore[arg-type]

    @classmethod
    def with_ports(cls, name: str, build: Callable[..., list[str]], count: int = 1, host: str = "127.0.0.1",
                   **kw: object) -> ServiceProcess:
        """``build(p1, ..., p<count>)`` -> the args on ``count`` freshly picked ports, ``p1`` the gRPC
        port; picked again on a bind failure. Read ports back with ``port`` / ``flag_port``."""
        def ports() -> tuple[list[str], str]:
            picked = [free_port(host) for _ in range(count)]
            return build(*picked), f"{host}:{picked[0]}"
        return cls.on_fresh_ports(name, ports, **kw)

    @property
    def port(self) -> int:
        """The gRPC port it was started on (after a retry, the last one)."""
        return int(self.grpc_address.rsplit(":", 1)[1])

    def flag_port(self, flag: str) -> int:
        """The port in the value of ``flag`` (``--http-port 8080`` or ``--x tcp://h:5557``)."""
        return int(self.args[self.args.index(flag) + 1].rsplit(":", 1)[-1])

    def flag_value(self, flag: str) -> str:
        return self.args[self.args.index(flag) + 1]

    def start(self, timeout_s: float = 60.0, wait: bool = True) -> ServiceProcess:
        self._spawn()
        if wait:
            self.wait_ready(timeout_s)
        return self

    def _spawn(self) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        if self.log_path is None:  # the log is how a bind failure is recognised
            fd, name = tempfile.mkstemp(prefix=f"kvmesh-{self.name}-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        self._log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvmesh_tools.cli.main", "serve", self.name, *self.args],
                env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            )

    def _log_since_spawn(self) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        with open(self.log_path, "rb") as f:
            f.seek(self._log_offset)
            return f.read().decode(errors="replace")

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        for attempt in range(1, BIND_ATTEMPTS + 1):
            try:
                wait_for_serving(self.grpc_address, timeout_s, proc=self.proc, tls=self.tls)
                # SERVING may have come from whoever took the port first; ours must still run.
                if self.proc is not None and self.proc.poll() is not None:
                    raise RuntimeError(f"{self.name} exited with {self.proc.returncode} while another "
                                       f"server answered on {self.grpc_address}")
                return
            except Exception:
                exited = self.proc is not None and self.proc.poll() is not None
                self.stop()
                text = self._log_since_spawn()
                if exited and self.ports is not None and attempt < BIND_ATTEMPTS and bind_failed(text):
                    self.args, self.grpc_address = self.ports()
                    self._spawn()
                    continue
                if text:
                    raise RuntimeError(f"{self.name} failed to become ready; log tail:\n{text[-3000:]}") from None
                raise

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace_s: float = 10.0) -> int | None:
        """SIGTERM (graceful drain), then SIGKILL after ``grace_s``."""
        rc = stop_process(self.proc, grace_s, group=True)
        self.proc = None
        return rc

    def kill(self) -> None:
        """Hard kill, as a crash would."""
        kill_process(self.proc, group=True)
