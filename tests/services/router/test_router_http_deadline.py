"""Every OpenAI HTTP request through the router has a total deadline (``--http-deadline-s``).

The only worker is stopped with SIGSTOP and the router's first-token timeout is off, so
nothing but the deadline can end a request: the official ``openai`` client gets a clean 504
error document, streamed or not. A stream still going at its deadline ends with an SSE error
event. The Anthropic Messages API has the same deadline (the shared request scope).
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator

import anthropic
import httpx
import openai
import pytest

from kvmesh_router.config import RouterConfig
from kvmesh_tools.testing.ports import free_port
from kvmesh_tools.testing.procs import ServiceProcess
from tests.fixtures.router import MODEL, rand_tokens, start_router, start_workers

pytestmark = pytest.mark.timeout(180)

DEADLINE_S = 2.0
MARGIN_S = 10.0     # slack for a loaded machine; without a deadline these requests never end


def _pause(w: ServiceProcess, on: bool) -> None:
    assert w.proc is not None
    os.killpg(w.proc.pid, signal.SIGSTOP if on else signal.SIGCONT)


@pytest.fixture(scope="module")
def hung_stack(tmp_path_factory, tiny_model_dir) -> Iterator[tuple[str, ServiceProcess]]:
    tmp_path = tmp_path_factory.mktemp("http-deadline")
    workers = start_workers(tmp_path, ["h1"])
    (w,) = workers.values()
    router = None
    try:
        router, http = start_router(tmp_path, [("h1", w.grpc_address)], indexer=f"127.0.0.1:{free_port()}",
                                    extra=["--load-poll-s", "60", "--policy", "round_robin",
                                           "--first-token-timeout-s", "0", "--stream-idle-timeout-s", "0",
                                           "--http-deadline-s", str(DEADLINE_S),
                                           "--tokenizer-path", str(tiny_model_dir)])
        yield f"http://127.0.0.1:{http}", w
    finally:
        if w.alive():
            _pause(w, False)
        if router is not None:
            router.stop(grace_s=3)
        w.stop(grace_s=3)


@pytest.fixture
def hung(hung_stack) -> Iterator[tuple[str, ServiceProcess]]:
    """The router and its one worker, shared by the module (their start-up is most of each test's
    time): each test may pause the worker, and it runs again for the next test."""
    yield hung_stack
    _pause(hung_stack[1], False)


def test_the_deadline_is_a_checked_setting_with_a_generous_default() -> None:
    assert RouterConfig().http_deadline_s >= 300
    with pytest.raises(Exception, match="http_deadline_s"):
        RouterConfig(http_deadline_s=-1).validate()


def test_idle_connections_outlive_the_clients_own_keepalive() -> None:
    """A server that closes an idle connection before its client stops reusing it loses the
    request the client sends in that moment (a ReadError at the client)."""
    assert RouterConfig().http_keepalive_s > httpx.Limits().keepalive_expiry
    with pytest.raises(Exception, match="http_keepalive_s"):
        RouterConfig(http_keepalive_s=-1).validate()


def _http_get(sock, path: str) -> bytes:  # noqa: ANN001
    sock.sendall(f"GET {path} HTTP/1.1\r\nhost: router\r\n\r\n".encode())
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed by the router after {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    n = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
    while len(body) < n:
        body += sock.recv(65536)
    return head


def test_an_idle_connection_is_kept_past_the_clients_reuse_window(hung) -> None:
    """The running router applies --http-keepalive-s: a connection idle for 6 s, past httpx's
    5 s reuse window (and uvicorn's 5 s default), still serves the next request."""
    import socket
    from urllib.parse import urlsplit

    base, _worker = hung
    u = urlsplit(base)
    with socket.create_connection((u.hostname, u.port), timeout=10) as sock:
        assert _http_get(sock, "/health").startswith(b"HTTP/1.1 ")
        time.sleep(httpx.Limits().keepalive_expiry + 1.0)
        assert _http_get(sock, "/health").startswith(b"HTTP/1.1 ")


def test_requests_to_a_hung_worker_end_at_the_deadline_with_504(hung) -> None:
    base, worker = hung
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)
    # Served while the worker runs: the deadline is a bound, not a cut.
    ok = client.completions.create(model=MODEL, prompt=rand_tokens(50, 1), max_tokens=2)
    assert ok.usage.completion_tokens == 2
    _pause(worker, True)
    for stream in (False, True):
        t0 = time.monotonic()
        with pytest.raises(openai.APIStatusError) as err:
            client.completions.create(model=MODEL, prompt=rand_tokens(80, 2 + stream), max_tokens=4,
                                      stream=stream)
        took = time.monotonic() - t0
        assert err.value.status_code == 504, err.value
        body = err.value.response.json()["error"]
        assert body["code"] == 504 and body["type"] == "timeout" and "deadline" in body["message"]
        assert DEADLINE_S <= took < DEADLINE_S + MARGIN_S, (stream, took)


def test_a_stream_still_going_at_its_deadline_ends_with_an_error_event(hung) -> None:
    """The deadline bounds the whole request: a generation still streaming is cut there."""
    base, _ = hung
    t0 = time.monotonic()
    with httpx.Client(timeout=60) as c, c.stream(
            "POST", f"{base}/v1/completions",
            json={"model": MODEL, "prompt": rand_tokens(60, 9), "max_tokens": 100_000, "stream": True,
                  "ignore_eos": True}) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        first = next(x for x in lines if x.startswith("data: "))
        assert '"choices"' in first
        rest = [x for x in lines if x.startswith("data: ")]
        took = time.monotonic() - t0
    assert rest[-1] == "data: [DONE]"
    err = json.loads(rest[-2][6:])["error"]
    assert err["code"] == 504 and "deadline" in err["message"], rest[-3:]
    assert len(rest) > 2      # tokens were streamed before the cut
    assert DEADLINE_S <= took < DEADLINE_S + MARGIN_S


def test_messages_requests_have_the_same_deadline(hung) -> None:
    """/v1/messages takes its deadline from the same request scope as the OpenAI endpoints."""
    base, worker = hung
    client = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0, timeout=60)
    _pause(worker, True)
    for stream in (False, True):
        t0 = time.monotonic()
        if stream:   # no token came: the router answers the stream request with the 504 itself
            with pytest.raises(anthropic.APIStatusError) as err, client.messages.stream(
                    model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "stuck " * 20}]) as s:
                s.get_final_message()
        else:
            with pytest.raises(anthropic.APIStatusError) as err:
                client.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "stuck"}])
        took = time.monotonic() - t0
        assert err.value.status_code == 504, err.value
        assert "deadline" in str(err.value.message), err.value
        assert DEADLINE_S <= took < DEADLINE_S + MARGIN_S, (stream, took)
