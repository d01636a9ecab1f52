"""KvEventPublisher: vLLM's wire behaviour (frames, seq, bind/connect, ROUTER replay)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import zmq

from kvmesh.events import (
    REPLAY_END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KvEventPublisher,
    decode_message,
    encode_batch,
)
from kvmesh.events.publisher import is_bind_endpoint, offset_endpoint_port
from tests.helpers.events import connect_when_ready

pytestmark = pytest.mark.timeout(60)
END = REPLAY_END_SEQ.to_bytes(8, "big")


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.term()


def _sub(ctx: zmq.Context, addr: str, bind: bool = False) -> zmq.Socket:
    """A SUB socket; when it connects, returned once the PUB can reach it (connect_when_ready)."""
    s = ctx.socket(zmq.SUB)
    s.setsockopt(zmq.SUBSCRIBE, b"")
    s.setsockopt(zmq.LINGER, 0)
    if bind:
        s.bind(addr)
    else:
        connect_when_ready(s, addr)
    return s


def _recv_all(sock: zmq.Socket, n: int, timeout_ms: int = 5000) -> list[list[bytes]]:
    out = []
    while len(out) < n:
        assert sock.poll(timeout_ms), f"timed out after {len(out)} of {n} messages"
        out.append(sock.recv_multipart())
    return out


def _replay(ctx: zmq.Context, addr: str, start: int, raw_start: bytes | None = None) -> list[list[bytes]]:
    d = ctx.socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    d.connect(addr)
    try:
        d.send_multipart([b"", raw_start if raw_start is not None else start.to_bytes(8, "big")])
        got = []
        while True:
            assert d.poll(5000), "replay timed out"
            frames = d.recv_multipart()
            got.append(frames)
            if frames[1:] == [b"", END, b""]:
                return got
    finally:
        d.close()


def _events(i: int) -> list:
    return [BlockStored([i, i + 1], None, list(range(64)), 32, None, "GPU", None, group_idx=0), BlockRemoved([i], "GPU")]


def _first_cleared(pub: KvEventPublisher, sub: zmq.Socket, timeout_s: float):
    """Publish ``AllBlocksCleared`` until ``sub`` receives one (ZMQ slow joiner: the first
    messages after a connect are dropped) or ``timeout_s`` passes; the decoded message or None."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pub.publish([AllBlocksCleared()])
        if sub.poll(100):
            return decode_message(sub.recv_multipart())
    return None


def test_endpoint_rules_match_vllm() -> None:
    assert is_bind_endpoint("tcp://*:5557") and is_bind_endpoint("ipc:///tmp/x") and is_bind_endpoint("tcp://[::]:1")
    assert not is_bind_endpoint("tcp://indexer:5557")
    assert offset_endpoint_port("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_endpoint_port("tcp://*:0", 2) == "tcp://*:0"
    assert offset_endpoint_port("inproc://x", 1) == "inproc://x_dp1"
    assert offset_endpoint_port("tcp://h:5557", 0) == "tcp://h:5557"
    with pytest.raises(ValueError):
        offset_endpoint_port("ipc:///x", 1)


def test_bind_publish_and_replay(ctx: zmq.Context, tmp_path: Path) -> None:
    ep = f"ipc://{tmp_path}/pub"
    with KvEventPublisher(ep, topic="kv@e1@m", replay_endpoint="tcp://127.0.0.1:0", buffer_steps=4) as pub:
        sub = _sub(ctx, ep)
        seqs = [pub.publish(_events(i), ts=100.0 + i) for i in range(6)]
        assert seqs == list(range(6))
        msgs = [decode_message(f) for f in _recv_all(sub, 5)]
        assert sub.poll(5000)
        msgs.append(decode_message(sub.recv_multipart(copy=False)))  # zmq.Frame objects too
        assert [m.seq for m in msgs] == seqs and {m.topic for m in msgs} == {"kv@e1@m"}
        assert msgs[3].batch == KVEventBatch(103.0, _events(3), 0)
        # buffer keeps the last 4 batches; replay from 1 returns 2..5 then the end marker
        rep = _replay(ctx, pub.replay_endpoint, 1)
        assert [int.from_bytes(f[2], "big") for f in rep[:-1]] == [2, 3, 4, 5]
        assert all(f[0] == b"" and f[1] == b"kv@e1@m" for f in rep[:-1])
        assert rep[2][3] == encode_batch(KVEventBatch(104.0, _events(4), 0))
        assert _replay(ctx, pub.replay_endpoint, 99) == [[b"", b"", END, b""]]
        # a malformed request is ignored and the service keeps working
        d = ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.LINGER, 0)
        d.connect(pub.replay_endpoint)
        d.send_multipart([b"", b"\x01"])
        d.send_multipart([b"only-one-frame"])
        d.close()
        assert len(_replay(ctx, pub.replay_endpoint, 5)) == 2
        sub.close()
    with pytest.raises(RuntimeError):
        pub.publish([AllBlocksCleared()])


def test_connect_mode_reaches_a_bound_subscriber(ctx: zmq.Context) -> None:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    with KvEventPublisher(f"tcp://127.0.0.1:{port}", topic="t") as pub:
        assert pub.endpoint == f"tcp://127.0.0.1:{port}"
        got = _first_cleared(pub, sub, 5)
        assert got is not None and isinstance(got.batch.events[0], AllBlocksCleared)
    sub.close()


def test_a_kernel_picked_port_on_one_interface_is_bound_and_named(ctx: zmq.Context) -> None:
    """``tcp://127.0.0.1:*`` binds (vLLM's rule: it has a '*') on loopback only, on a port the
    kernel picks at the bind; ``endpoint`` names that port, which is what gets advertised."""
    assert is_bind_endpoint("tcp://127.0.0.1:*")
    with KvEventPublisher("tcp://127.0.0.1:*", topic="t") as pub:
        host, port = pub.endpoint.removeprefix("tcp://").rsplit(":", 1)
        assert host == "127.0.0.1" and port.isdigit() and int(port) > 0
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.LINGER, 0)
        sub.connect(pub.endpoint)
        got = _first_cleared(pub, sub, 30)
        sub.close()
        assert got is not None and got.topic == "t"


def test_concurrent_publishers_get_unique_ordered_seqs(ctx: zmq.Context, tmp_path: Path) -> None:
    ep = f"ipc://{tmp_path}/pub"
    with KvEventPublisher(ep, topic="t") as pub:
        sub = _sub(ctx, ep)
        seqs: list[int] = []
        lock = threading.Lock()

        def worker() -> None:
            for i in range(50):
                s = pub.publish(_events(i))
                with lock:
                    seqs.append(s)

        threads = [threading.Thread(target=worker) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(seqs) == list(range(200))
        got = [int.from_bytes(f[1], "big") for f in _recv_all(sub, 200)]
        assert got == list(range(200))  # wire order == seq order
        sub.close()


def test_bad_endpoint_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="cannot"):
        KvEventPublisher("tcp://*:notaport")
    with pytest.raises(ValueError):
        KvEventPublisher("ipc:///tmp/x", buffer_steps=0)


@pytest.mark.vllm
@pytest.mark.timeout(120)
def test_frames_and_replay_identical_to_vllm_publisher(ctx: zmq.Context, tmp_path: Path) -> None:
    """Same batches through vLLM's ZmqEventPublisher and ours: byte-identical live and replay frames."""
    from vllm.distributed import kv_events as V

    def vllm_batch(i: int):
        return V.KVEventBatch(
            ts=100.0 + i,
            events=[
                V.BlockStored(
                    block_hashes=[i, i + 1], parent_block_hash=None, token_ids=list(range(64)), block_size=32,
                    lora_id=None, medium="GPU", lora_name=None, group_idx=0,
                ),
                V.BlockRemoved(block_hashes=[i], medium="GPU"),
            ],
        )  # fmt: skip

    frames = {}
    replays = {}
    for name in ("vllm", "kvmesh"):
        ep, rep = f"ipc://{tmp_path}/{name}", f"ipc://{tmp_path}/{name}-replay"
        if name == "vllm":
            pub = V.ZmqEventPublisher(0, endpoint=ep, replay_endpoint=rep, topic="kv@e@m", buffer_steps=100)
            send, close = pub.publish, pub.shutdown
        else:
            pub = KvEventPublisher(ep, topic="kv@e@m", replay_endpoint=rep, buffer_steps=100)
            send, close = (lambda b, p=pub: p.publish(b)), pub.close
        sub = _sub(ctx, ep)
        for i in range(5):
            send(vllm_batch(i) if name == "vllm" else KVEventBatch(100.0 + i, _events(i)))
        frames[name] = _recv_all(sub, 5)
        replays[name] = _replay(ctx, rep, 2)
        sub.close()
        close()
    assert frames["kvmesh"] == frames["vllm"]
    assert replays["kvmesh"] == replays["vllm"]


def test_replay_buffer_is_bounded_in_bytes(ctx: zmq.Context, tmp_path: Path) -> None:
    """Batches of long prompts carry their token ids: the buffer keeps what fits, newest first."""
    one = len(encode_batch(KVEventBatch(100.0, _events(0), 0)))
    with KvEventPublisher(f"ipc://{tmp_path}/pub", topic="kv@e1@m", replay_endpoint="tcp://127.0.0.1:0",
                          buffer_steps=1000, buffer_bytes=3 * one) as pub:
        for i in range(20):
            pub.publish(_events(i), ts=100.0 + i)
        assert pub.buffer_bytes <= 3 * one + 8
        rep = _replay(ctx, pub.replay_endpoint, 0)
        got = [int.from_bytes(f[2], "big") for f in rep[:-1]]
        assert got and got == list(range(20 - len(got), 20)) and len(got) <= 3


def test_replay_buffer_is_bounded_in_age(ctx: zmq.Context, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A publisher with few events keeps minutes of them, not everything until the byte bound."""
    from kvmesh.events import publisher

    now = [1000.0]
    monkeypatch.setattr(publisher, "_clock", lambda: now[0])
    with KvEventPublisher(f"ipc://{tmp_path}/pub", topic="kv@e1@m", replay_endpoint="tcp://127.0.0.1:0",
                          buffer_steps=1000, buffer_age_s=60.0) as pub:
        for i in range(10):
            pub.publish(_events(i), ts=100.0 + i)
            now[0] += 10.0   # one batch every 10 s
        # Published at 1000, 1010, ..., 1090; at the last one (1090) those before 1030 are gone.
        rep = _replay(ctx, pub.replay_endpoint, 0)
        got = [int.from_bytes(f[2], "big") for f in rep[:-1]]
        assert got == list(range(3, 10))
        now[0] += 3600.0
        pub.publish(_events(10), ts=200.0)
        rep = _replay(ctx, pub.replay_endpoint, 0)
        assert [int.from_bytes(f[2], "big") for f in rep[:-1]] == [10]   # the newest always stays
