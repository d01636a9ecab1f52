"""Attacks 7 and 8, router HTTP side: bodies, slow requests, connection floods, hostile JSON.

A real router (``--auth keys``, 1 MiB body limit, 2 s header and 3 s body timeouts) is
sent a 400 MB chunked body, 300 half-sent requests, more connections than its cap,
100k-deep JSON and out-of-range integers. Each gets a JSON error with a 4xx status and the
connection is closed where the request was never complete; the router's RSS stays under
2x its idle RSS and it serves normally afterwards.
"""

from __future__ import annotations

import json
import select
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.fixtures.router import MODEL, start_workers
from tests.fixtures.security import SecureStack, bearer, start_secure_router

pytestmark = pytest.mark.timeout(240)
LIMIT = 1 << 20   # the fixture's --max-text-bytes


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


class RssSampler:
    """The peak RSS of a process while the ``with`` block runs (sampled every 20 ms)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes(self.pid))
            time.sleep(0.02)

    def __enter__(self) -> RssSampler:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()


def _head(path: str, key: str, extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {key}\r\n"
            f"content-type: application/json\r\n{extra}").encode()


def _response(s: socket.socket, timeout: float = 10.0) -> tuple[int, dict, bytes]:
    """Read one response (until the server closes or the JSON body is complete)."""
    s.settimeout(timeout)
    data = b""
    while True:
        try:
            chunk = s.recv(65536)
        except (ConnectionResetError, TimeoutError):
            break
        if not chunk:
            break
        data += chunk
        head, sep, body = data.partition(b"\r\n\r\n")
        if sep and b"content-length:" in head.lower():
            n = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
            if len(body) >= n:
                break
    head, _, body = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ")[1]) if head.startswith(b"HTTP/1.1 ") else 0
    return status, json.loads(body) if body else {}, head.lower()


def _closed(s: socket.socket, timeout: float = 10.0) -> bool:
    s.settimeout(timeout)
    try:
        while s.recv(65536):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def _healthy(st: SecureStack) -> None:
    r = httpx.post(st.http_base + "/v1/completions", headers=bearer(st.key_a), timeout=30,
                   json={"model": MODEL, "prompt": [1, 2, 3, 4], "max_tokens": 2})
    assert r.status_code == 200, r.text


def _chunked_flood(st: SecureStack, total: int) -> tuple[int, int, dict]:
    """Send up to ``total`` bytes of chunked body, reading the answer as soon as there is one."""
    piece = b"9" * (1 << 20)
    frame = f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
    sent = 0
    with socket.create_connection(("127.0.0.1", st.http_port), timeout=30) as s:
        s.sendall(_head("/v1/completions", st.key_a, "transfer-encoding: chunked\r\n\r\n") +
                  b"1\r\n[\r\n")
        while sent < total:
            if select.select([s], [], [], 0)[0]:
                break
            try:
                s.sendall(frame)
            except (BrokenPipeError, ConnectionResetError):
                break
            sent += len(piece)
        status, doc, _ = _response(s)
    return sent, status, doc


def test_a_400mb_chunked_body_is_cut_at_the_limit_and_rss_stays_bounded(secure_stack):
    _healthy(secure_stack)
    idle = rss_bytes(secure_stack.pid)
    with RssSampler(secure_stack.pid) as rss:
        sent, status, doc = _chunked_flood(secure_stack, 400 << 20)
    print(f"\nchunked flood: idle RSS {idle >> 20} MiB, peak {rss.peak >> 20} MiB, sent {sent >> 20} MiB")
    assert status == 413 and doc["error"]["param"] == "body", (status, doc)
    assert sent < 100 << 20, f"the router read {sent >> 20} MiB of a body over its {LIMIT >> 20} MiB limit"
    assert rss.peak < 2 * idle, (idle, rss.peak)
    _healthy(secure_stack)


@pytest.mark.parametrize("chunked", [False, True])
def test_413_exactly_past_the_limit(secure_stack, chunked):
    doc = json.dumps({"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 1}).encode()
    at_limit = doc + b" " * (LIMIT - len(doc))
    for body, want in ((at_limit, 200), (at_limit + b" ", 413)):
        with socket.create_connection(("127.0.0.1", secure_stack.http_port), timeout=30) as s:
            if chunked:
                half = len(body) // 2
                frames = b"".join(f"{len(p):x}\r\n".encode() + p + b"\r\n" for p in (body[:half], body[half:]))
                s.sendall(_head("/v1/completions", secure_stack.key_a, "transfer-encoding: chunked\r\n\r\n")
                          + frames + b"0\r\n\r\n")
            else:
                s.sendall(_head("/v1/completions", secure_stack.key_a, f"content-length: {len(body)}\r\n\r\n")
                          + body)
            status, answer, head = _response(s, 30)
        assert status == want, (len(body), status, answer)
        if want == 413:
            assert answer["error"]["code"] == 413 and b"connection: close" in head


def test_half_sent_headers_and_bodies_get_408_and_are_closed(secure_stack):
    with socket.create_connection(("127.0.0.1", secure_stack.http_port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bear")
        status, doc, _ = _response(s, 10)
        assert status == 408 and doc["error"]["code"] == 408 and _closed(s)
    with socket.create_connection(("127.0.0.1", secure_stack.http_port), timeout=10) as s:
        s.sendall(_head("/v1/completions", secure_stack.key_a, "content-length: 5000\r\n\r\n") + b'{"model"')
        status, doc, _ = _response(s, 15)
        assert status == 408 and doc["error"]["param"] == "body"


def test_the_header_deadline_starts_at_the_requests_first_byte(secure_stack):
    """A client slow to send its first byte after connecting (a loaded client) is served: the
    2 s header deadline counts from the first byte, not from the accept. Counted from the
    accept, such requests got 408 and a reset in 200-session soaks (ReadError, errno 32)."""
    body = json.dumps({"model": MODEL, "prompt": [1, 2, 3, 4], "max_tokens": 2}).encode()
    with socket.create_connection(("127.0.0.1", secure_stack.http_port), timeout=10) as s:
        time.sleep(3.0)
        s.sendall(_head("/v1/completions", secure_stack.key_a, f"content-length: {len(body)}\r\n\r\n") + body)
        status, doc, _ = _response(s, 30)
    assert status == 200, doc


def test_300_half_sent_requests_are_all_dropped_and_rss_stays_bounded(secure_stack):
    _healthy(secure_stack)
    idle = rss_bytes(secure_stack.pid)
    socks: list[socket.socket] = []
    try:
        with RssSampler(secure_stack.pid) as rss:
            for i in range(300):
                s = socket.create_connection(("127.0.0.1", secure_stack.http_port), timeout=10)
                if i % 2:
                    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-le")
                else:
                    s.sendall(_head("/v1/chat/completions", secure_stack.key_a, "content-length: 100000\r\n\r\n")
                              + b'{"model": "' + b"x" * 5000)
                socks.append(s)
            _healthy(secure_stack)     # served while the 300 hang
            deadline = time.monotonic() + 30
            closed = 0
            for s in socks:
                if _closed(s, max(0.1, deadline - time.monotonic())):
                    closed += 1
        print(f"\n300 half-sent: idle RSS {idle >> 20} MiB, peak {rss.peak >> 20} MiB")
        assert closed == 300, f"{300 - closed} half-sent requests still open"
        assert rss.peak < 2 * idle, (idle, rss.peak)
    finally:
        for s in socks:
            s.close()
    _healthy(secure_stack)


HOSTILE = {
    "100k-deep JSON": b'{"model": "m", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "max_tokens 2^32": json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2**32}).encode(),
    "seed 2^64": json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2, "seed": 2**64}).encode(),
    "negative stop token": json.dumps({"model": MODEL, "prompt": "hi", "stop_token_ids": [-1]}).encode(),
    "not an object": b"[1, 2]",
    "not JSON": b"\xff\xfe{",
}


@pytest.mark.parametrize("case", list(HOSTILE))
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_hostile_json_gets_an_openai_400(secure_stack, case, path):
    body = HOSTILE[case]
    if path.endswith("chat/completions"):
        body = body.replace(b'"prompt": "hi"', b'"messages": [{"role": "user", "content": "hi"}]')
    r = httpx.post(secure_stack.http_base + path, content=body, timeout=30,
                   headers={**bearer(secure_stack.key_a), "content-type": "application/json"})
    assert r.status_code == 400, (case, r.status_code, r.text[:300])
    assert r.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("case", ["100k-deep JSON", "max_tokens 2^32"])
def test_hostile_json_gets_an_anthropic_400(secure_stack, case):
    body = HOSTILE[case].replace(b'"prompt": "hi"', b'"messages": [{"role": "user", "content": "hi"}]')
    r = httpx.post(secure_stack.http_base + "/v1/messages", content=body, timeout=30,
                   headers={"x-api-key": secure_stack.key_a, "content-type": "application/json"})
    assert r.status_code == 400, r.text[:300]
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("raw", [b"\x16\x03\x01\x02\x00garbage\r\n\r\n", b"GET / HTTP/9.9\r\n\r\n",
                                 b"POST /v1/completions HTTP/1.1\r\ncontent-length: -5\r\n\r\n"])
def test_bytes_that_are_not_http_get_a_json_400(secure_stack, raw):
    with socket.create_connection(("127.0.0.1", secure_stack.http_port), timeout=10) as s:
        s.sendall(raw)
        status, doc, _ = _response(s)
    assert status == 400 and doc["error"]["code"] == 400 and "malformed HTTP" in doc["error"]["message"]
    _healthy(secure_stack)


def test_oversized_headers_get_431(secure_stack):
    with socket.create_connection(("127.0.0.1", secure_stack.http_port), timeout=10) as s:
        s.sendall(b"GET /v1/models HTTP/1.1\r\nhost: x\r\nx-junk: " + b"a" * 200_000 + b"\r\n\r\n")
        status, doc, _ = _response(s)
    assert status == 431 and doc["error"]["code"] == 431


@pytest.fixture(scope="module")
def capped(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir) -> Iterator[SecureStack]:
    tmp = tmp_path_factory.mktemp("capped")
    workers = start_workers(tmp, ["c1"])
    st = None
    try:
        st = start_secure_router(tmp, workers, tiny_model_dir, ["--http-max-connections", "20"])
        yield st
    finally:
        if st is not None:
            st.router.stop(grace_s=3)
        for w in workers.values():
            w.stop(grace_s=3)


def test_connections_over_the_cap_get_503_and_the_rest_are_served(capped):
    socks = [socket.create_connection(("127.0.0.1", capped.http_port), timeout=10) for _ in range(30)]
    try:
        time.sleep(1.0)    # well within the 10 s header timeout of the connections that were let in
        answered = select.select(socks, [], [], 0)[0]
        for s in answered:
            status, doc, _ = _response(s, 2)
            assert status == 503 and doc["error"]["code"] == 503
        assert len(answered) >= 10
    finally:
        for s in socks:
            s.close()
    time.sleep(0.2)
    _healthy(capped)
