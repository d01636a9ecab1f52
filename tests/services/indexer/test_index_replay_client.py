"""The DEALER side of vLLM's replay protocol against kvmesh's ROUTER publisher."""

from __future__ import annotations

import time

import pytest
import zmq

from kvmesh.events.codec import AllBlocksCleared, decode_batch
from kvmesh.events.publisher import KvEventPublisher
from kvmesh_indexer.replay_client import ReplayError, fetch_replay
from kvmesh_tools.testing.ports import free_port

pytestmark = pytest.mark.timeout(30)


def test_fetch_replay_returns_buffered_batches_from_start() -> None:
    # The replay socket binds port 0 and reports it; the PUB connects (nothing needs to listen).
    with KvEventPublisher(f"tcp://127.0.0.1:{free_port()}", topic="kv@e@m", replay_endpoint="tcp://127.0.0.1:0",
                          buffer_steps=3) as pub:
        replay = pub.replay_endpoint
        for _ in range(5):
            pub.publish([AllBlocksCleared()])
        got = fetch_replay(replay, 0, timeout_s=5)          # buffer keeps the last 3
        assert [s for s, _ in got] == [2, 3, 4]
        assert isinstance(decode_batch(got[0][1]).batch.events[0], AllBlocksCleared)
        assert [s for s, _ in fetch_replay(replay, 4, timeout_s=5)] == [4]
        assert fetch_replay(replay, 9, timeout_s=5) == []


def test_fetch_replay_times_out_on_a_silent_router() -> None:
    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    try:
        t0 = time.monotonic()
        with pytest.raises(ReplayError, match="timed out"):
            fetch_replay(f"tcp://127.0.0.1:{port}", 0, timeout_s=0.3)
        assert time.monotonic() - t0 < 10   # 0.3 s bound; without one it never returns
    finally:
        router.close(linger=0)
