"""Start and stop a real ``mooncake_master`` on loopback (tests, bench), without etcd.

``mooncake_master`` takes fixed ports (its RPC port and its admin/metrics port) and
exits when either is taken. A port picked before it binds can be taken in between
(no pick-then-bind is free of that race), so a start whose process dies is retried on
new ports; it is ready once *its own* process holds a listening socket on the RPC
port (checked through /proc, so a server someone else runs on that port never
passes for ours).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvmesh_tools.testing.ports import free_port
from kvmesh_tools.testing.stop import stop_process

ATTEMPTS = 4


def master_binary() -> str | None:
    """``mooncake_master`` of this environment (the venv's bin first), or None."""
    local = Path(sys.executable).with_name("mooncake_master")
    return str(local) if local.exists() else shutil.which("mooncake_master")


def _listen_inodes(port: int) -> set[str]:
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(cols[9])
    return inodes


def _holds(pid: int, inodes: set[str]) -> bool:
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:[") and target[8:-1] in inodes:
            return True
    return False


@dataclass
class MooncakeMaster:
    port: int = 0
    metrics_port: int = 0
    extra_args: list[str] = field(default_factory=list)
    proc: subprocess.Popen | None = None
    # None: master.log in a temporary directory, removed by stop() (each run left one in /tmp before).
    log_path: Path | None = None

    def __post_init__(self) -> None:
        self._own_dir = self.log_path is None
        if self.log_path is None:
            self.log_path = Path(tempfile.mkdtemp(prefix="kvmesh-mooncake-")) / "master.log"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 20.0) -> MooncakeMaster:
        exe = master_binary()
        if exe is None:
            raise RuntimeError("mooncake_master not found; run `make install-mooncake`")
        assert self.log_path is not None
        self.log_path.parent.mkdir(parents=True, exist_ok=True)   # again after a stop()
        for _ in range(ATTEMPTS):
            self.port = self.metrics_port = free_port()
            # Two picks can return the same port (each binds 0 and closes). The master then binds
            # its admin server on its RPC port and exits, after the readiness check, which looks at
            # both ports, has already passed.
            while self.metrics_port == self.port:
                self.metrics_port = free_port()
            if self._try(exe, timeout_s):
                return self
        raise RuntimeError(f"mooncake_master did not start; see {self.log_path}: "
                           + self.log_path.read_text(errors="replace")[-2000:])

    def _try(self, exe: str, timeout_s: float) -> bool:
        assert self.log_path is not None
        args = [exe, f"--rpc_port={self.port}", "--rpc_address=127.0.0.1", f"--metrics_port={self.metrics_port}",
                "--metrics_host=127.0.0.1", "--logtostderr", *self.extra_args]
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            inodes = _listen_inodes(self.port)
            # Its admin server starts after the RPC one and is where a taken metrics port shows.
            if inodes and _holds(self.proc.pid, inodes) and _holds(self.proc.pid, _listen_inodes(self.metrics_port)):
                return True
            time.sleep(0.05)
        stop_process(self.proc, 10, group=True)   # the log stays for start()'s error
        self.proc = None
        return False

    def stop(self) -> None:
        stop_process(self.proc, 10, group=True)
        self.proc = None
        if self._own_dir and self.log_path is not None:
            shutil.rmtree(self.log_path.parent, ignore_errors=True)

    def __enter__(self) -> MooncakeMaster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
