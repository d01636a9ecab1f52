"""An offload store's index entries survive the indexer's re-sync (real store, indexer and Redis).

In the 30-minute soak Redis answered none of the indexer's calls for a moment; the indexer
marked every endpoint for re-sync. The store had no replay socket, so its ~30k blocks were
cleared from the index and every restore was mispredicted for the rest of the run. With the
store's replay socket (``--events-replay-endpoint``, as ``kvmesh up``, compose and Kubernetes
start it) the batch lost to the stall is replayed and nothing is cleared; after a Redis
restart that lost the index, the store's buffered batches rebuild its entries.
"""

from __future__ import annotations

import os
import random
import signal

import pytest

from kvmesh.kvstore.client_async import OffloadClient
from kvmesh_api.indexer.v1 import indexer_pb2
from kvmesh_tools.testing.redis_server import RedisProcess
from tests.fixtures.indexer import awaits, wait_until

pytestmark = pytest.mark.timeout(120)

BS = 16
MODEL = "tiny"
STORE = "offload-0"


def _chain(seed: int, n: int) -> tuple[list[int], list[list[int]]]:
    rng = random.Random(seed)
    return [rng.getrandbits(63) for _ in range(n)], [[rng.randrange(1, 30000) for _ in range(BS)] for _ in range(n)]


async def _store_blocks(ix, keys: list[int]) -> int:  # noqa: ANN001
    """Leading blocks of ``keys`` the index holds for the store (0 when it cannot answer)."""
    try:
        resp = await ix.stub.Lookup(indexer_pb2.LookupRequest(model=MODEL, chain=indexer_pb2.BlockChain(keys=keys)),
                                    timeout=5)
    except Exception:  # noqa: BLE001 - Redis down or busy: not there yet
        return 0
    return next((m.combined_blocks for m in resp.matches if m.endpoint_id == STORE), 0)


@pytest.mark.parametrize("replay", [True, False], ids=["replay", "no_replay"])
async def test_store_entries_survive_a_redis_stall_and_restart(start_indexer, offload_process, replay: bool) -> None:
    redis = RedisProcess().start()
    try:
        ix = await start_indexer(models=f"{MODEL}@{BS}@sha256_cbor", backend="redis", redis_url=redis.url,
                                 redis_timeout_s=0.3, lookup_timeout_s=1.0)
        flags = ["--advertise-host", "127.0.0.1", "--indexer-address", ix.address, "--endpoint-id", STORE,
                 "--events-endpoint", "tcp://*:0", "--ram-capacity-bytes", str(64 << 20)]
        if replay:
            flags += ["--events-replay-endpoint", "tcp://127.0.0.1:0"]
        proc = offload_process(*flags)
        async with OffloadClient(proc.grpc_address, use_shm=False) as client:
            async def put(keys: list[int], toks: list[list[int]]) -> None:
                await client.put("ns", [(k, bytes([i % 251]) * 256) for i, k in enumerate(keys)], token_ids=toks,
                                 block_size=BS)

            # Events sent before the indexer's subscription took hold are lost (ZMQ's slow
            # joiner): put fresh one-block chains until one is indexed.
            warm = iter(range(1000, 2000))

            async def subscribed() -> bool:
                keys, toks = _chain(next(warm), 1)
                await put(keys, toks)
                return await wait_for_blocks(keys, 1, 0.5)

            async def wait_for_blocks(keys: list[int], n: int, timeout_s: float) -> bool:
                try:
                    await wait_until(lambda: awaits(_store_blocks(ix, keys), n), timeout_s=timeout_s, interval_s=0.05)
                except AssertionError:
                    return False
                return True

            await wait_until(subscribed, timeout_s=30, interval_s=0.01, what="the store's events reach the indexer")
            a, b, c = _chain(1, 6), _chain(2, 5), _chain(3, 4)
            await put(*a)
            await wait_until(lambda: awaits(_store_blocks(ix, a[0]), 6), timeout_s=20, what="chain A indexed")
            st = ix.app.servicer.ingestor.endpoints[STORE]
            before = {k: v for k, v in st.counters.items() if k.startswith("clear_")}   # the store's start
            replayed = st.counters.get("replay_complete", 0)

            # 1. Redis stalls: the batch of chain B cannot be applied and the store is marked for re-sync.
            os.kill(redis.proc.pid, signal.SIGSTOP)
            try:
                await put(*b)
                await wait_until(lambda: st.needs_resync, timeout_s=20, what="the store marked for re-sync")
            finally:
                os.kill(redis.proc.pid, signal.SIGCONT)
            await put(*c)   # its batch follows the lost one: the re-sync runs before it is applied
            await wait_until(lambda: awaits(_store_blocks(ix, c[0]), 4), timeout_s=20, what="chain C indexed")
            await wait_until(lambda: not st.needs_resync, timeout_s=20, what="the re-sync done")
            cleared = {k: v for k, v in st.counters.items() if k.startswith("clear_") and v != before.get(k)}
            if not replay:
                # The control: without a replay socket the lost batch cannot be repaired, so the
                # store's entries are cleared, chain A's included.
                assert cleared and await _store_blocks(ix, a[0]) == 0
                return
            assert cleared == {} and st.counters.get("replay_complete", 0) > replayed
            assert await _store_blocks(ix, a[0]) == 6     # kept
            assert await _store_blocks(ix, b[0]) == 5     # the lost batch, replayed
            assert await _store_blocks(ix, c[0]) == 4

            # 2. Redis restarts empty: the store's buffered batches rebuild its entries.
            redis.stop()
            redis.start()
            for (keys, _), n in ((a, 6), (b, 5), (c, 4)):
                await wait_until(lambda keys=keys, n=n: awaits(_store_blocks(ix, keys), n), timeout_s=30,
                                 interval_s=0.1, what="the store's entries rebuilt after the Redis restart")
    finally:
        redis.stop()
