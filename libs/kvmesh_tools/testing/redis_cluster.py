"""Start a real Redis Cluster (N masters, ``redis-server --cluster-enabled yes``) on loopback.

Why its own helper: a cluster node listens on two ports, the client port P and the
cluster bus P+10000, and cannot be told "port 0" for either, so a picked port can
collide on either side. Each node is started on a picked port and picked again when
it exits or does not answer (a taken port or bus port), then ``redis-cli --cluster
create`` joins them. Tests also restart a master and move slots
(``redis-cli --cluster reshard``) while a client is writing.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis

from kvmesh_tools.testing.ports import free_port
from kvmesh_tools.testing.stop import stop_process


@dataclass
class ClusterNode:
    port: int
    workdir: Path
    proc: subprocess.Popen | None = None

    def client(self, timeout_s: float = 1.0) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=timeout_s)

    def node_id(self) -> str:
        return self.client().execute_command("CLUSTER MYID").decode()


@dataclass
class RedisClusterProcess:
    masters: int = 3
    node_timeout_ms: int = 2000
    nodes: list[ClusterNode] = field(default_factory=list)
    root: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="kvmesh-rcluster-")))

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def start(self, timeout_s: float = 20.0, attempts: int = 6) -> RedisClusterProcess:
        exe = shutil.which("redis-server")
        cli = shutil.which("redis-cli")
        if exe is None or cli is None:
            raise RuntimeError("redis-server/redis-cli not found; run `make install` (apt-get install -y redis-server)")
        try:
            for i in range(self.masters):
                node = None
                for _ in range(attempts):
                    port = free_port()
                    if port > 55000:   # the bus port (P + 10000) must exist too
                        continue
                    cand = ClusterNode(port, self.root / f"n{i}")
                    cand.workdir.mkdir(parents=True, exist_ok=True)
                    if self._spawn(exe, cand, timeout_s / 2):
                        node = cand
                        break
                if node is None:
                    raise RuntimeError("no redis cluster node started (ports kept colliding)")
                self.nodes.append(node)
            out = subprocess.run([cli, "--cluster", "create", *[f"127.0.0.1:{n.port}" for n in self.nodes],
                                  "--cluster-replicas", "0", "--cluster-yes"],
                                 capture_output=True, text=True, timeout=timeout_s)
            if out.returncode != 0:
                raise RuntimeError(f"redis-cli --cluster create failed: {out.stdout[-500:]} {out.stderr[-500:]}")
            self.wait_ok(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _spawn(self, exe: str, node: ClusterNode, timeout_s: float) -> bool:
        args = [exe, "--port", str(node.port), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
                "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", str(self.node_timeout_ms),
                "--save", "", "--appendonly", "no", "--dir", str(node.workdir), "--protected-mode", "no"]
        node.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and node.proc.poll() is None:
            try:
                node.client(0.5).ping()
                time.sleep(0.05)   # a bus port clash makes the server exit right after it listens
                if node.proc.poll() is None:
                    return True
            except redis.RedisError:
                time.sleep(0.05)
        self._kill(node)
        return False

    def wait_ok(self, timeout_s: float = 20.0) -> None:
        """Until every node reports ``cluster_state:ok`` and agrees on the slot map."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                states = [n.client().execute_command("CLUSTER INFO") for n in self.nodes]
                if all(str(s.get("cluster_state")) == "ok" for s in states):   # redis-py parses it to a dict
                    return
            except redis.RedisError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("redis cluster did not reach cluster_state:ok")
            time.sleep(0.1)

    def restart(self, i: int, down_s: float = 0.0, timeout_s: float = 20.0) -> None:
        """Stop master ``i`` (its data is lost: no persistence) and start it again on its port."""
        node = self.nodes[i]
        self._kill(node)
        time.sleep(down_s)
        exe = shutil.which("redis-server")
        assert exe is not None
        if not self._spawn(exe, node, timeout_s):
            raise RuntimeError(f"redis cluster node {i} did not restart on port {node.port}")
        self.wait_ok(timeout_s)

    def stop_node(self, i: int) -> None:
        self._kill(self.nodes[i])

    def reshard(self, src: int, dst: int, slots: int, timeout_s: float = 120.0) -> None:
        """Move ``slots`` slots (and their keys) from master ``src`` to master ``dst``."""
        cli = shutil.which("redis-cli")
        assert cli is not None
        out = subprocess.run([cli, "--cluster", "reshard", f"127.0.0.1:{self.nodes[src].port}",
                              "--cluster-from", self.nodes[src].node_id(), "--cluster-to", self.nodes[dst].node_id(),
                              "--cluster-slots", str(slots), "--cluster-yes", "--cluster-pipeline", "100"],
                             capture_output=True, text=True, timeout=timeout_s)
        if out.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster reshard failed: {out.stdout[-500:]} {out.stderr[-500:]}")
        self.wait_ok()

    def slots_of(self, i: int) -> int:
        """How many slots master ``i`` serves."""
        nid = self.nodes[i].node_id()
        total = 0
        for s in self.nodes[i].client().execute_command("CLUSTER SLOTS"):
            if s[2][2].decode() == nid:
                total += int(s[1]) - int(s[0]) + 1
        return total

    @staticmethod
    def _kill(node: ClusterNode) -> None:
        stop_process(node.proc, 5)
        node.proc = None

    def stop(self) -> None:
        for n in self.nodes:
            self._kill(n)
        shutil.rmtree(self.root, ignore_errors=True)
