"""Send random and mutated messages to every method of every gRPC service at some addresses.

Why: the services' contract is that hostile input gets a clear status (mostly
``INVALID_ARGUMENT``), never ``UNKNOWN`` (an unhandled exception), a crash or a
call that hangs. The services are found by server reflection, so a new method
or service is fuzzed without touching this file. Health and reflection
themselves are skipped (Health.Watch streams forever by design).

A call is a *hang* when it neither answers nor ends within ``call_timeout_s``
(streams are read up to ``max_stream_responses`` and then cancelled, which is
not a hang: the server is producing).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf import descriptor_pool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from kvmesh.rpc.tls import TlsConfig, plaintext, sync_channel
from kvmesh_tools.fuzz.messages import MessageGenerator, mutate

SKIP_SERVICES = ("grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection",
                 "grpc.reflection.v1.ServerReflection")


@dataclass(frozen=True)
class Method:
    address: str
    service: str
    name: str
    input_type: Any
    client_streaming: bool
    server_streaming: bool

    @property
    def path(self) -> str:
        return f"/{self.service}/{self.name}"


@dataclass
class FuzzReport:
    messages: int = 0
    calls: int = 0
    hangs: int = 0
    codes: Counter = field(default_factory=Counter)
    by_method: dict[str, Counter] = field(default_factory=dict)
    unknown_samples: list[str] = field(default_factory=list)
    unhealthy: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def unknown(self) -> int:
        return self.codes.get("UNKNOWN", 0)

    def to_json(self) -> dict[str, Any]:
        return {"messages": self.messages, "calls": self.calls, "hangs": self.hangs, "unknown": self.unknown,
                "unhealthy": self.unhealthy, "seconds": round(self.seconds, 1),
                "messages_per_s": round(self.messages / self.seconds, 1) if self.seconds else 0.0,
                "codes": dict(sorted(self.codes.items())),
                "methods": len(self.by_method),
                "by_method": {k: dict(sorted(v.items())) for k, v in sorted(self.by_method.items())},
                "unknown_samples": self.unknown_samples[:20]}


# The reflection client logs every file it loads at INFO.
logging.getLogger("grpc_reflection.v1alpha.proto_reflection_descriptor_database").setLevel(logging.WARNING)


def discover(address: str, channel: grpc.Channel) -> list[Method]:
    """Every method of every (non-infrastructure) service the server reflects."""
    db = ProtoReflectionDescriptorDatabase(channel)
    pool = descriptor_pool.DescriptorPool(db)
    out = []
    for name in db.get_services():
        if name in SKIP_SERVICES:
            continue
        svc = pool.FindServiceByName(name)
        for m in svc.methods:
            out.append(Method(address, name, m.name, m.input_type, m.client_streaming, m.server_streaming))
    return out


def healthy(address: str, tls: TlsConfig | None = None, timeout_s: float = 5.0) -> bool:
    """The server still answers its liveness check."""
    try:
        with sync_channel(address, tls or plaintext()) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="liveness"),
                                                        timeout=timeout_s)
            return resp.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


class Fuzzer:
    """Thread-safe fuzz loop over the methods of a set of addresses."""

    def __init__(self, addresses: list[str], seed: int = 0, call_timeout_s: float = 10.0,
                 max_stream_responses: int = 16, mutate_share: float = 0.4, max_bytes: int = 64 * 1024,
                 tls: TlsConfig | None = None) -> None:
        self.tls = tls or plaintext()
        self.addresses = addresses
        self.seed = seed
        self.call_timeout_s = call_timeout_s
        self.max_stream_responses = max_stream_responses
        self.mutate_share = mutate_share
        self.max_bytes = max_bytes
        opts = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
        self.channels = {a: sync_channel(a, self.tls, opts) for a in addresses}
        self.methods: list[Method] = []
        for a in addresses:
            self.methods.extend(discover(a, self.channels[a]))
        self.report = FuzzReport()
        self._lock = threading.Lock()

    def close(self) -> None:
        for ch in self.channels.values():
            ch.close()

    def __enter__(self) -> Fuzzer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _payload(self, m: Method, rng: random.Random, gen: MessageGenerator) -> bytes:
        raw = gen.message(m.input_type).SerializeToString()
        return mutate(raw, rng) if rng.random() < self.mutate_share else raw

    def call_once(self, m: Method, rng: random.Random) -> tuple[str, int]:
        """One call with fresh messages: (status code name, messages sent)."""
        gen = MessageGenerator(rng, max_bytes=self.max_bytes)
        ch = self.channels[m.address]
        timeout = self.call_timeout_s
        n_sent = 1
        try:
            if m.client_streaming:
                msgs = [self._payload(m, rng, gen) for _ in range(rng.randint(0, 4))]
                n_sent = len(msgs)
                req: Any = iter(msgs)
            else:
                req = self._payload(m, rng, gen)
            if not m.server_streaming:
                fn = (ch.stream_unary if m.client_streaming else ch.unary_unary)(m.path)
                fn(req, timeout=timeout)
                return "OK", n_sent
            fn = (ch.stream_stream if m.client_streaming else ch.unary_stream)(m.path)
            call = fn(req, timeout=timeout)
            got = 0
            for _ in call:
                got += 1
                if got >= self.max_stream_responses:
                    call.cancel()
                    return "OK_STREAMING", n_sent
            return "OK", n_sent
        except grpc.RpcError as exc:
            code = exc.code()
            name = code.name if code is not None else "NONE"
            if code == grpc.StatusCode.CANCELLED and m.server_streaming:
                return "OK_STREAMING", n_sent
            if code == grpc.StatusCode.UNKNOWN:
                with self._lock:
                    self.report.unknown_samples.append(f"{m.path}: {exc.details()}")
            return name, n_sent

    def _record(self, m: Method, code: str, sent: int, elapsed: float) -> None:
        with self._lock:
            r = self.report
            r.calls += 1
            r.messages += sent
            r.codes[code] += 1
            r.by_method.setdefault(m.path, Counter())[code] += 1
            if code == "DEADLINE_EXCEEDED" or elapsed > self.call_timeout_s * 1.5:
                r.hangs += 1

    def run(self, messages: int, concurrency: int = 8) -> FuzzReport:
        """Fuzz until ``messages`` messages were sent, cycling over the methods."""
        if not self.methods:
            raise RuntimeError(f"no gRPC methods found by reflection at {', '.join(self.addresses)}")
        t0 = time.monotonic()
        counter = iter(range(1 << 62))
        lock = threading.Lock()

        def worker(widx: int) -> None:
            rng = random.Random(self.seed * 1000 + widx)
            while True:
                with lock:
                    if self.report.messages >= messages:
                        return
                    i = next(counter)
                m = self.methods[i % len(self.methods)]
                start = time.monotonic()
                code, sent = self.call_once(m, rng)
                self._record(m, code, max(sent, 1), time.monotonic() - start)

        with ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(worker, range(concurrency)))
        self.report.seconds = time.monotonic() - t0
        self.report.unhealthy = [a for a in self.addresses if not healthy(a, self.tls)]
        return self.report


def methods_by_address(fuzzer: Fuzzer) -> Iterator[tuple[str, list[str]]]:
    for a in fuzzer.addresses:
        yield a, [m.path for m in fuzzer.methods if m.address == a]
