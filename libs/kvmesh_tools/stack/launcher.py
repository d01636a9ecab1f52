"""Start the whole kvmesh stack on this machine as child processes, and stop it cleanly.

Why it exists: ``kvmesh up``, ``kvmesh demo`` and the live end-to-end tests need
the same topology — router; indexer on Redis when ``redis-server`` is available,
else its embedded index; prefill and decode sim workers; the offload store —
wired together the same way. Each service runs as ``kvmesh serve NAME`` in its
own process group (``ServiceProcess``), so a Ctrl-C in the terminal reaches only
this launcher, which then drains every child with SIGTERM (SIGKILL after a grace).
"""

from __future__ import annotations

import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvmesh_tools.testing.ports import free_port
from kvmesh_tools.testing.procs import ServiceProcess
from kvmesh_tools.testing.redis_server import RedisProcess

log = logging.getLogger(__name__)


@dataclass
class StackConfig:
    decode_workers: int = field(default=4, metadata={"help": "decode sim workers"})
    prefill_workers: int = field(default=2, metadata={"help": "prefill sim workers"})
    redis: str = field(default="auto", metadata={"help": "indexer backend: auto (redis if installed) | on | off"})
    model: str = field(default="sim-model", metadata={"help": "served model name"})
    block_size: int = field(default=64, metadata={"help": "KV block size (tokens)"})
    num_blocks: int = field(default=2048, metadata={"help": "KV capacity per worker (blocks)"})
    vocab_size: int = field(default=32000, metadata={"help": "sim vocabulary size"})
    time_scale: float = field(default=1.0, metadata={"help": "sim workers run this many times faster than an H100"})
    offload_ram_bytes: int = field(default=1 << 30, metadata={"help": "offload store RAM tier (bytes)"})
    policy: str = field(default="precise", metadata={"help": "router's default routing policy"})
    split: bool = field(default=True, metadata={"help": "allow the prefill/decode split"})
    host: str = field(default="127.0.0.1", metadata={"help": "listen/advertise host"})
    router_port: int = field(default=0, metadata={"help": "router gRPC port (0 = free port)"})
    http_port: int = field(default=0, metadata={"help": "router OpenAI HTTP port (0 = free port)"})
    log_dir: str = field(default="out/stack", metadata={"help": "service logs go here"})
    start_timeout_s: float = field(default=120.0, metadata={"help": "max wait for a service to be SERVING"})


@dataclass
class LocalStack:
    cfg: StackConfig
    procs: list[ServiceProcess] = field(default_factory=list)
    redis: RedisProcess | None = None
    router_address: str = ""
    http_address: str = ""
    indexer_address: str = ""
    offload_address: str = ""
    decode_addresses: dict[str, str] = field(default_factory=dict)
    prefill_addresses: dict[str, str] = field(default_factory=dict)

    # ------------------------------------------------------------------ helpers
    def _svc(self, name: str, tag: str, args: list[str], port: int) -> ServiceProcess:
        logs = Path(self.cfg.log_dir)
        logs.mkdir(parents=True, exist_ok=True)
        sp = ServiceProcess(name=name, args=args, grpc_address=f"{self.cfg.host}:{port}",
                            log_path=logs / f"{tag}.log", env={"KVMESH_LOG_FORMAT": "text"})
        self.procs.append(sp)
        return sp

    def _use_redis(self) -> bool:
        mode = self.cfg.redis
        if mode not in ("auto", "on", "off"):
            raise ValueError(f"redis must be auto, on or off, got {mode!r}")
        have = shutil.which("redis-server") is not None
        if mode == "on" and not have:
            raise RuntimeError("redis=on but redis-server is not installed (make install-redis)")
        return mode == "on" or (mode == "auto" and have)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> LocalStack:
        c = self.cfg
        t0 = time.monotonic()
        try:
            self._start(c)
        except BaseException:
            self.stop()
            raise
        log.info("stack up", extra={"seconds": round(time.monotonic() - t0, 1), "router": self.router_address})
        return self

    def _start(self, c: StackConfig) -> None:
        h = c.host
        idx_port = free_port()
        idx_args = ["--host", h, "--port", str(idx_port), "--default-block-size", str(c.block_size),
                    "--default-model", c.model]
        if self._use_redis():
            self.redis = RedisProcess().start()
            idx_args += ["--backend", "redis", "--redis-url", self.redis.url]
        self.indexer_address = f"{h}:{idx_port}"
        self._svc("indexer", "indexer", idx_args, idx_port).start(c.start_timeout_s)

        off_port = free_port()
        self.offload_address = f"{h}:{off_port}"
        self._svc("offload", "offload", ["--host", h, "--port", str(off_port), "--advertise-host", h,
                                         "--ram-capacity-bytes", str(c.offload_ram_bytes),
                                         "--indexer-address", self.indexer_address,
                                         "--events-endpoint", f"tcp://{h}:{free_port()}"],
                  off_port).start(c.start_timeout_s)

        workers: list[ServiceProcess] = []
        for role, n, book in (("decode", c.decode_workers, self.decode_addresses),
                              ("prefill", c.prefill_workers, self.prefill_addresses)):
            for i in range(n):
                port = free_port()
                ep = f"{role}-{i}"
                book[ep] = f"{h}:{port}"
                args = ["--host", h, "--port", str(port), "--advertise-host", h, "--endpoint-id", ep,
                        "--model", c.model, "--block-size", str(c.block_size), "--num-blocks", str(c.num_blocks),
                        "--vocab-size", str(c.vocab_size), "--time-scale", str(c.time_scale),
                        "--indexer-address", self.indexer_address, "--offload-address", self.offload_address,
                        "--kv-events-endpoint", f"tcp://{h}:{free_port()}",
                        "--kv-events-replay-endpoint", f"tcp://{h}:{free_port()}"]
                workers.append(self._svc(role, ep, args, port).start(wait=False))
        for w in workers:
            w.wait_ready(c.start_timeout_s)

        r_port = c.router_port or free_port()
        http_port = c.http_port or free_port()
        self.router_address = f"{h}:{r_port}"
        self.http_address = f"http://{h}:{http_port}"
        args = ["--host", h, "--port", str(r_port), "--http-port", str(http_port), "--model", c.model,
                "--block-size", str(c.block_size), "--vocab-size", str(c.vocab_size), "--policy", c.policy,
                # approx, the baseline, is told the workers' real capacity (fair to it).
                "--approx-capacity-blocks", str(c.num_blocks),
                "--indexer", self.indexer_address,
                "--endpoints", ",".join(f"{k}={v}" for k, v in self.decode_addresses.items())]
        if self.prefill_addresses:
            args += ["--prefill-endpoints", ",".join(f"{k}={v}" for k, v in self.prefill_addresses.items())]
        if c.split and self.prefill_addresses:
            args += ["--split-enabled", "true"]
        self._svc("router", "router", args, r_port).start(c.start_timeout_s)

    def stop(self) -> None:
        """Stop everything, router first (so no new work reaches stopping workers). Idempotent."""
        for sp in reversed(self.procs):
            try:
                sp.stop(grace_s=5.0)
            except Exception:  # noqa: BLE001 - keep stopping the others
                log.exception("stopping service failed", extra={"service": sp.name})
        self.procs.clear()
        if self.redis is not None:
            self.redis.stop()
            self.redis = None

    def alive(self) -> list[str]:
        return [sp.name for sp in self.procs if sp.alive()]

    def describe(self) -> dict[str, object]:
        return {"router_grpc": self.router_address, "router_http": self.http_address,
                "indexer": self.indexer_address, "indexer_backend": "redis" if self.redis else "memory",
                "redis": self.redis.url if self.redis else "", "offload": self.offload_address,
                "decode": dict(self.decode_addresses), "prefill": dict(self.prefill_addresses),
                "logs": str(Path(self.cfg.log_dir).resolve())}

    def __enter__(self) -> LocalStack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
