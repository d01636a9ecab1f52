"""Faults during a steady stream, real processes (``kvmesh up``'s stack): indexer, store, Redis.

Issue 21's targets for each fault: no request that had not produced a token is lost, and
routing recovers within 3 s. Four client threads send requests back to back through the
router's HTTP front door while one service is SIGKILLed and started again at its address.
Recovery is the first moment a warm prefix is routed by ``precise`` on the index again: no
fallback, and a prediction that holds.
"""

from __future__ import annotations

import random
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvmesh_tools.stack.launcher import LocalStack, StackConfig

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    cfg = StackConfig(decode_workers=2, prefill_workers=0, time_scale=20.0, num_blocks=1024,
                      redis="on" if shutil.which("redis-server") else "off",
                      log_dir=str(tmp_path_factory.mktemp("faults")), offload_ram_bytes=128 << 20)
    with LocalStack(cfg) as s:
        yield s


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 30000) for _ in range(n)]


def _complete(c: httpx.Client, stack: LocalStack, tokens: list[int]) -> httpx.Response:
    return c.post(f"{stack.http_address}/v1/completions", headers=stack.auth_headers(),
                  json={"model": stack.cfg.model, "prompt": tokens, "max_tokens": 4})


class _Stream:
    """Client threads sending requests back to back; every failure is kept."""

    def __init__(self, stack: LocalStack, clients: int = 4) -> None:
        self.stack = stack
        self.stop = threading.Event()
        self.ok = 0
        self.failures: list[str] = []
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(clients)]

    def _run(self, i: int) -> None:
        base = _tokens(1200, 500 + i)
        n = 0
        with httpx.Client(timeout=60) as c:
            while not self.stop.is_set():
                n += 1
                try:
                    r = _complete(c, self.stack, base + _tokens(30, 10_000 * i + n))
                    if r.status_code == 200:
                        self.ok += 1
                    else:
                        self.failures.append(f"{r.status_code} {r.text[:200]}")
                except httpx.HTTPError as exc:
                    self.failures.append(repr(exc))

    def __enter__(self) -> _Stream:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(90)


def _recovered(stack: LocalStack, timeout: float = 30.0) -> float:
    """Seconds until a warm prefix is routed on the index again (no fallback, exact prediction)."""
    warm = _tokens(1500, 77)
    t0 = time.monotonic()
    with httpx.Client(timeout=60) as c:
        n = 0
        while time.monotonic() - t0 < timeout:
            n += 1
            r = _complete(c, stack, warm + _tokens(20, 900_000 + n))
            if r.status_code == 200:
                k = r.json()["kvmesh"]
                cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
                if "fallback" not in k["reason"] and k["predicted_cached_tokens"] == cached > 0:
                    return time.monotonic() - t0
            time.sleep(0.05)
    raise AssertionError("routing did not recover")


def _restart(stack: LocalStack, name: str) -> None:
    if name == "redis":
        assert stack.redis is not None
        stack.redis.stop()
        stack.redis.start()
        return
    (sp,) = [p for p in stack.procs if p.log_path is not None and Path(p.log_path).stem == name]
    sp.kill()
    time.sleep(0.5)
    sp.start(timeout_s=60)


@pytest.mark.parametrize("fault", ["indexer", "offload", "redis"])
def test_a_restart_during_a_steady_stream_loses_nothing(stack: LocalStack, fault: str) -> None:
    if fault == "redis" and stack.redis is None:
        pytest.skip("redis-server is not installed")
    with httpx.Client(timeout=60) as c:
        assert _complete(c, stack, _tokens(1500, 77)).status_code == 200   # the warm prefix
    _recovered(stack)
    with _Stream(stack) as s:
        time.sleep(1.0)
        _restart(stack, fault)
        took = _recovered(stack)
        time.sleep(1.0)
    print(f"{fault}: {s.ok} requests during the fault, routing recovered {took:.2f} s after the restart")
    assert s.ok > 0 and s.failures == [], s.failures[:5]
    # About a second on a quiet machine: seconds, not the minutes a lost subscription or an
    # uncapped reconnect backoff would cost. The slack is for a loaded CI machine.
    assert took <= 10.0
