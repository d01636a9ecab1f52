"""Run kvmesh services as real child processes and wait for gRPC readiness.

Used by the integration tests, the benchmarks and ``kvmesh up``: each service
is started as ``python -m kvmesh_tools.cli.main serve NAME ...`` and is ready when its
gRPC health check answers SERVING.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def wait_for_serving(address: str, timeout_s: float = 60.0, service: str = "",
                     proc: subprocess.Popen | None = None) -> None:
    """Block until ``address`` reports SERVING for ``service``; raise on timeout or early exit."""
    deadline = time.monotonic() + timeout_s
    last: object = None
    with grpc.insecure_channel(address) as ch:
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


@dataclass
class ServiceProcess:
    """One ``kvmesh serve NAME`` child process."""

    name: str
    args: list[str]
    grpc_address: str
    env: dict[str, str] = field(default_factory=dict)
    log_path: Path | None = None
    proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 60.0, wait: bool = True) -> ServiceProcess:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvmesh_tools.cli.main", "serve", self.name, *self.args],
            env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )
        if wait:
            self.wait_ready(timeout_s)
        return self

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        try:
            wait_for_serving(self.grpc_address, timeout_s, proc=self.proc)
        except Exception:
            self.stop()
            if self.log_path and self.log_path.exists():
                tail = self.log_path.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{self.name} failed to become ready; log tail:\n{tail}") from None
            raise

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace_s: float = 10.0) -> int | None:
        """SIGTERM (graceful drain), then SIGKILL after ``grace_s``."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        rc = self.proc.returncode
        self.proc = None
        return rc

    def kill(self) -> None:
        """Hard kill, as a crash would."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)
