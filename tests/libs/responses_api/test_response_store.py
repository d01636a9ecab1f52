"""The response stores (memory, and redis against a real redis-server) and the resolution of
``previous_response_id`` / ``item_reference`` into a stateless request."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest

from kvmesh.openai.errors import OpenAIError
from kvmesh.responses_api.conversations import with_items, without_item
from kvmesh.responses_api.history import MAX_REFERENCES, conversation_items, resolve
from kvmesh.responses_api.store.base import StoredResponse, TooLarge
from kvmesh.responses_api.store.memory import MemoryResponseStore
from kvmesh.responses_api.store.redis_store import RedisResponseStore
from kvmesh.responses_api.store.registry import open_store, store_name


def record(rid: str, text: str = "hi", inp: list[dict[str, Any]] | None = None, pad: int = 0) -> StoredResponse:
    out = [{"type": "message", "id": f"msg_{rid}", "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": text + "x" * pad, "annotations": []}]}]
    return StoredResponse({"id": rid, "object": "response", "status": "completed", "output": out},
                          inp if inp is not None else [{"type": "message", "id": f"in_{rid}", "role": "user",
                                                        "content": "q"}])


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


# -- memory ------------------------------------------------------------------------------
async def test_memory_store_keeps_per_tenant_and_forgets_after_its_ttl():
    clock = Clock()
    st = MemoryResponseStore(ttl_s=10.0, max_bytes=1 << 20, tenant_max_bytes=1 << 20, clock=clock)
    assert await st.put("a", record("resp_1"))
    assert (await st.get("a", "resp_1")).response["id"] == "resp_1"
    assert await st.get("b", "resp_1") is None           # another tenant's id is not found
    assert await st.item_owner("a", "msg_resp_1") == "resp_1"
    assert await st.item_owner("a", "in_resp_1") == "resp_1"
    assert await st.item_owner("b", "msg_resp_1") is None
    assert not await st.delete("b", "resp_1")
    clock.t = 10.5
    assert await st.get("a", "resp_1") is None and await st.item_owner("a", "msg_resp_1") is None
    assert st.bytes == 0 and len(st) == 0


async def test_memory_store_evicts_a_tenants_own_oldest_before_anyone_elses():
    one = len(record("resp_a0", pad=1000).encode())
    st = MemoryResponseStore(ttl_s=1e9, max_bytes=10 * one, tenant_max_bytes=3 * one)
    assert await st.put("quiet", record("resp_q0", pad=1000))
    for i in range(6):   # a busy tenant goes past its share: only its own oldest go
        assert await st.put("busy", record(f"resp_a{i}", pad=1000))
    assert await st.get("quiet", "resp_q0") is not None
    kept = [i for i in range(6) if await st.get("busy", f"resp_a{i}") is not None]
    assert kept == [3, 4, 5]
    assert st.bytes <= 10 * one
    # The whole budget: the oldest of anyone's goes first.
    for t in ("t1", "t2", "t3"):
        for i in range(3):
            assert await st.put(t, record(f"resp_{t}{i}", pad=1000))
    assert st.bytes <= 10 * one
    assert await st.get("quiet", "resp_q0") is None
    assert await st.get("t3", "resp_t32") is not None


async def test_memory_store_refuses_a_response_larger_than_a_tenant_may_keep():
    st = MemoryResponseStore(ttl_s=60, max_bytes=1 << 20, tenant_max_bytes=2000)
    assert not await st.put("a", record("resp_big", pad=5000))
    assert await st.get("a", "resp_big") is None and st.bytes == 0


async def test_an_item_names_the_newest_response_that_holds_it_and_survives_an_older_ones_deletion():
    st = MemoryResponseStore(ttl_s=60, max_bytes=1 << 20, tenant_max_bytes=1 << 20)
    r1 = record("resp_1")
    r2 = record("resp_2", inp=r1.input + r1.response["output"])   # a chained turn repeats the conversation
    await st.put("a", r1)
    await st.put("a", r2)
    assert await st.item_owner("a", "msg_resp_1") == "resp_2"
    assert await st.delete("a", "resp_1")
    assert await st.item_owner("a", "msg_resp_1") == "resp_2"
    assert await st.delete("a", "resp_2")
    assert await st.item_owner("a", "msg_resp_1") is None


def test_store_names_and_bad_specs():
    assert store_name("off") == store_name("") == "off"
    assert store_name("memory") == "memory"
    assert store_name("redis://127.0.0.1:6379/1") == "redis"
    for bad in ("redis", "postgres", "memroy"):
        with pytest.raises(ValueError):
            store_name(bad)
    assert open_store("off", 1, 1, 1) is None
    assert isinstance(open_store("memory", 1, 100, 10), MemoryResponseStore)


# -- redis -------------------------------------------------------------------------------
@pytest.mark.redis
async def test_redis_store_against_a_real_server(redis_server):
    prefix = f"test:{uuid.uuid4().hex}"
    st = RedisResponseStore(redis_server.url, ttl_s=0.5, max_record_bytes=4000, prefix=prefix)
    other = RedisResponseStore(redis_server.url, ttl_s=60, max_record_bytes=4000, prefix=prefix)   # a 2nd replica
    try:
        assert await st.put("team:a", record("resp_1"))
        got = await other.get("team:a", "resp_1")
        assert got is not None and got.response == record("resp_1").response
        assert await other.item_owner("team:a", "msg_resp_1") == "resp_1"
        # Tenant names are escaped: "team" cannot reach "team:a"'s keys through its own.
        assert await other.get("team", "a:resp_1") is None and await other.get("team:b", "resp_1") is None
        assert not await st.put("team:a", record("resp_big", pad=5000))
        assert await other.delete("team:a", "resp_1") and await st.get("team:a", "resp_1") is None
        assert await st.put("team:a", record("resp_2"))
        await asyncio.sleep(0.7)   # the time to live is Redis's own
        assert await other.get("team:a", "resp_2") is None and await other.item_owner("team:a", "msg_resp_2") is None
    finally:
        await st.close()
        await other.close()


def thread(cid: str = "conv_1") -> StoredResponse:
    return StoredResponse({"id": cid, "object": "conversation", "created_at": 0, "metadata": {}}, [])


def said(i: int) -> list[dict[str, Any]]:
    return [{"type": "message", "id": f"msg_{i}", "role": "user", "content": f"turn {i}"}]


async def check_updates(st: Any, other: Any) -> None:
    """``update`` on any store: absent is None; a change that raises writes nothing; too large writes
    nothing; and many writers at once (two replicas) keep every item."""
    assert await st.update("a", "conv_1", with_items(said(0))) is None
    assert await st.put("a", thread())
    assert await st.update("b", "conv_1", with_items(said(0))) is None   # another tenant's
    with pytest.raises(OpenAIError):   # not there: nothing written
        await st.update("a", "conv_1", without_item("msg_9"))
    with pytest.raises(TooLarge):
        await st.update("a", "conv_1", with_items([{**said(0)[0], "content": "x" * 9000}]))
    assert (await other.get("a", "conv_1")).input == []
    assert await st.put("a", record("resp_1"))
    with pytest.raises(OpenAIError):   # a response is not a conversation
        await st.update("a", "resp_1", with_items(said(0)))
    # Sixty turns added at once through two stores (two router replicas): none is lost.
    await asyncio.gather(*[(st, other)[i % 2].update("a", "conv_1", with_items(said(i))) for i in range(60)])
    got = await st.get("a", "conv_1")
    assert sorted(i["id"] for i in got.input) == sorted(f"msg_{i}" for i in range(60))
    assert await other.item_owner("a", "msg_59") == "conv_1"


async def test_memory_store_updates_in_one_step():
    st = MemoryResponseStore(ttl_s=60, max_bytes=1 << 20, tenant_max_bytes=8000)
    await check_updates(st, st)


@pytest.mark.redis
async def test_redis_store_updates_from_two_replicas_lose_nothing(redis_server):
    prefix = f"test:{uuid.uuid4().hex}"
    st, other = (RedisResponseStore(redis_server.url, ttl_s=60, max_record_bytes=8000, prefix=prefix)
                 for _ in range(2))
    try:
        await check_updates(st, other)
    finally:
        await st.close()
        await other.close()


# -- resolution --------------------------------------------------------------------------
async def test_previous_response_id_puts_the_conversation_back_before_the_new_input():
    st = MemoryResponseStore(ttl_s=60, max_bytes=1 << 20, tenant_max_bytes=1 << 20)
    first = conversation_items("My name is Ada.")
    await st.put("a", record("resp_1", text="Hello Ada.", inp=first))
    res = await resolve({"model": "m", "previous_response_id": "resp_1", "input": "What is my name?",
                         "instructions": "Be brief."}, st, "a")
    body = res.body
    assert "previous_response_id" not in body and body["instructions"] == "Be brief."
    assert [i.get("role") for i in body["input"]] == ["user", "assistant", "user"]
    assert body["input"][0]["content"] == "My name is Ada." and body["input"][2]["content"] == "What is my name?"
    assert res.previous is not None and res.conversation == body["input"]
    assert all(i["id"] for i in res.conversation)
    with pytest.raises(OpenAIError) as e:
        await resolve({"previous_response_id": "resp_1", "input": "x"}, st, "b")
    assert e.value.status == 404 and e.value.param == "previous_response_id"


async def test_item_references_are_the_stored_items():
    st = MemoryResponseStore(ttl_s=60, max_bytes=1 << 20, tenant_max_bytes=1 << 20)
    await st.put("a", record("resp_1", text="Hello."))
    res = await resolve({"input": [{"type": "item_reference", "id": "msg_resp_1"},
                                   {"role": "user", "content": "and?"}]}, st, "a")
    assert res.body["input"][0]["role"] == "assistant" and res.body["input"][0]["id"] == "msg_resp_1"
    for bad, status in (({"type": "item_reference", "id": "msg_nope"}, 404),
                        ({"type": "item_reference", "id": "../../etc"}, 400),
                        ({"type": "item_reference"}, 400)):
        with pytest.raises(OpenAIError) as e:
            await resolve({"input": [bad]}, st, "a")
        assert e.value.status == status and e.value.param == "input[0]"
    with pytest.raises(OpenAIError) as e:
        await resolve({"input": [{"type": "item_reference", "id": "msg_resp_1"}] * (MAX_REFERENCES + 1)}, st, "a")
    assert e.value.status == 400


@pytest.mark.parametrize("body,param", [
    ({"previous_response_id": "resp_1", "input": "x"}, "previous_response_id"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]"),
])
async def test_without_a_store_state_is_a_400_naming_the_field(body, param):
    with pytest.raises(OpenAIError) as e:
        await resolve(body, None, "a")
    assert e.value.status == 400 and e.value.param == param and "not stored" in e.value.message


@pytest.mark.parametrize("prev", ["x" * 129, "resp 1", "resp_1\n", 7, "", "résumé"])
async def test_a_malformed_previous_response_id_is_a_400(prev):
    st = MemoryResponseStore(ttl_s=60, max_bytes=1 << 20, tenant_max_bytes=1 << 20)
    with pytest.raises(OpenAIError) as e:
        await resolve({"previous_response_id": prev, "input": "x"}, st, "a")
    assert e.value.status == 400 and e.value.param == "previous_response_id"


def test_kept_items_have_ids_and_types_as_openai_lists_them():
    bare, typed = {"role": "user", "content": "x"}, {"type": "function_call_output", "call_id": "c", "output": "o",
                                                     "id": "fco_client_1"}
    a, b = conversation_items([bare, typed])
    assert a["type"] == "message" and a["id"].startswith("msg_") and a["content"] == "x"
    assert b is typed   # already typed and named: kept as sent
    (one,) = conversation_items("hi")
    assert {k: one[k] for k in ("type", "role", "content")} == {"type": "message", "role": "user", "content": "hi"}


async def test_memory_store_accounting_holds_under_a_random_workload():
    import random

    rng = random.Random(5)
    one = len(record("resp_x", pad=500).encode())
    st = MemoryResponseStore(ttl_s=1e9, max_bytes=20 * one, tenant_max_bytes=6 * one)
    live: set[tuple[str, str]] = set()
    for i in range(2000):
        t = rng.choice("abcde")
        if rng.random() < 0.2 and live:
            k = rng.choice(sorted(live))
            assert await st.delete(*k)
            live.discard(k)
        else:
            assert await st.put(t, record(f"resp_{i}", pad=rng.randrange(0, 1000)))
            live.add((t, f"resp_{i}"))
            live = {k for k in live if await st.get(*k) is not None}
        assert st.bytes <= 20 * one and st.bytes == sum(st._used.values())
        assert all(v <= 6 * one for v in st._used.values())
        assert len(st) == len(live)
