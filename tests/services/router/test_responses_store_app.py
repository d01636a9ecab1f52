"""Stored Responses through the router's real app and the official ``openai`` client: a chained turn
(``previous_response_id``) renders the conversation a client sending its whole history renders,
``item_reference``, retrieval, deletion and ``input_items`` pages, tenants that cannot see each other's
responses, ``store: false``, a stream whose response is kept before its last event, the store off, and
two router replicas sharing a real Redis. The service below ``generate`` is the stand-in of
``test_responses_app.py`` (it answers every turn with text and two tool calls)."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path
from typing import Any

import httpx2
import openai
import pytest

from kvmesh.api_keys import ApiKeys
from kvmesh.tokenization import load_tokenizer
from kvmesh_router.http_api import build_app
from kvmesh_router.request_scope import RequestScopes
from tests.helpers.served_app import served
from tests.services.router.test_responses_app import TOOLS, _RoutedService


def _client(app: Any, key: str = "k") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url="http://router/v1", api_key=key, max_retries=0,
                              http_client=httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app)))


def _service(tiny_model_dir: Path, **cfg: Any) -> _RoutedService:
    service = _RoutedService(load_tokenizer(tiny_model_dir))
    for k, v in cfg.items():
        setattr(service.cfg, k, v)
    return service


@pytest.fixture
def routed(tiny_model_dir):
    service = _service(tiny_model_dir)
    return service, _client(build_app(service))  # type: ignore[arg-type]


async def test_a_chained_turn_renders_what_the_whole_history_renders(routed):
    service, client = routed
    r1 = await client.responses.create(model="m", instructions="Be brief.", input="Read a.py and b.py.", tools=TOOLS)
    assert r1.store is True and r1.previous_response_id is None
    outputs = [{"type": "function_call_output", "call_id": o.call_id, "output": f"contents of {o.call_id}"}
               for o in r1.output if o.type == "function_call"]
    assert len(outputs) == 2
    r2 = await client.responses.create(model="m", instructions="Be brief.", previous_response_id=r1.id,
                                       input=outputs, tools=TOOLS)
    chained = service.rendered
    assert r2.previous_response_id == r1.id
    # The same conversation sent whole, as a client keeping its own history sends it.
    history = [{"role": "user", "content": "Read a.py and b.py."},
               *[o.model_dump(exclude_none=True) for o in r1.output], *outputs]
    r3 = await client.responses.create(model="m", instructions="Be brief.", input=history, tools=TOOLS, store=False)
    assert service.rendered == chained
    assert 'contents of call_7' in chained and '"path": "b.py"' in chained and r3.store is False
    # Instructions do not carry over (OpenAI's rule, and vLLM's).
    await client.responses.create(model="m", previous_response_id=r1.id, input=outputs, tools=TOOLS)
    assert "Be brief." not in service.rendered
    # A chain of chains: the third turn sees the first turn's question.
    r4 = await client.responses.create(model="m", previous_response_id=r2.id, input="Thanks.", tools=TOOLS)
    assert "Read a.py and b.py." in service.rendered and "Thanks." in service.rendered
    items = [i async for i in client.responses.input_items.list(r4.id, order="asc", limit=2)]
    assert [i.type for i in items[:2]] == ["message", "message"] and items[0].content[0].text == "Read a.py and b.py."
    assert items[-1].content[0].text == "Thanks." and len({i.id for i in items}) == len(items)


async def test_retrieve_delete_and_item_references(routed):
    service, client = routed
    r1 = await client.responses.create(model="m", input="Read a.py.", tools=TOOLS)
    got = await client.responses.retrieve(r1.id)
    assert got.model_dump() == r1.model_dump()
    msg = next(o for o in r1.output if o.type == "message")
    await client.responses.create(model="m", input=[{"type": "item_reference", "id": msg.id},
                                                    {"role": "user", "content": "Go on."}])
    assert service.seen[-1].chat_request.messages[0] == {"role": "assistant", "content": "Let me read them."}
    page = await client.responses.input_items.list(r1.id)
    assert page.data[0].content[0].text == "Read a.py." and page.has_more is False
    await client.responses.delete(r1.id)
    for call in (client.responses.retrieve(r1.id),
                 client.responses.create(model="m", previous_response_id=r1.id, input="x"),
                 client.responses.input_items.list(r1.id)):
        with pytest.raises(openai.NotFoundError):
            await call
    with pytest.raises(openai.NotFoundError):
        await client.responses.delete(r1.id)


async def test_store_false_keeps_nothing(routed):
    service, client = routed
    r = await client.responses.create(model="m", input="hi", store=False)
    assert r.store is False
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(r.id)


async def test_a_streamed_response_is_kept_before_its_last_event(routed):
    service, client = routed
    stream = await client.responses.create(model="m", input="Read a.py.", tools=TOOLS, stream=True)
    async for ev in stream:
        if ev.type == "response.completed":
            # The client may chain the moment it sees this event: the response is already there.
            got = await client.responses.retrieve(ev.response.id)
            assert ev.response.store is True and got.output == ev.response.output
    r2 = await client.responses.create(model="m", previous_response_id=got.id, input="ok")
    assert r2.previous_response_id == got.id


@pytest.mark.parametrize("path,params,param", [
    ("/responses/resp_1/input_items", {"limit": 0}, "limit"),
    ("/responses/resp_1/input_items", {"limit": "ten"}, "limit"),
    ("/responses/resp_1/input_items", {"order": "sideways"}, "order"),
])
async def test_bad_queries_are_400s(routed, path, params, param):
    _, client = routed
    with pytest.raises(openai.BadRequestError) as e:
        await client.get(path, options={"params": params}, cast_to=dict)
    assert e.value.body["param"] == param


async def test_bad_store_values_and_ids(routed):
    service, client = routed
    with pytest.raises(openai.BadRequestError) as e:
        await client.post("/responses", body={"model": "m", "input": "hi", "store": "yes"}, cast_to=dict)
    assert e.value.body["param"] == "store"
    n = len(service.seen)
    with pytest.raises(openai.BadRequestError):
        await client.responses.create(model="m", input="hi", previous_response_id="resp_1/../../x")
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve("r" * 300)
    assert len(service.seen) == n   # nothing was generated


async def test_tenants_do_not_see_each_others_responses(tiny_model_dir, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("team-a KEY-A\nteam-b KEY-B\n")
    service = _service(tiny_model_dir)
    app = build_app(service, RequestScopes("keys", ApiKeys(keys)))  # type: ignore[arg-type]
    a, b = _client(app, "KEY-A"), _client(app, "KEY-B")
    r = await a.responses.create(model="m", input="secret source code")
    assert (await a.responses.retrieve(r.id)).id == r.id
    for call in (b.responses.retrieve(r.id), b.responses.input_items.list(r.id), b.responses.delete(r.id),
                 b.responses.create(model="m", previous_response_id=r.id, input="what did they say?"),
                 b.responses.create(model="m", input=[{"type": "item_reference", "id": r.output[0].id}])):
        with pytest.raises(openai.NotFoundError):
            await call
    assert (await a.responses.retrieve(r.id)).id == r.id   # b's delete did nothing


async def test_with_the_store_off_state_is_refused_as_before(tiny_model_dir):
    service = _service(tiny_model_dir, responses_store="off")
    client = _client(build_app(service))  # type: ignore[arg-type]
    r = await client.responses.create(model="m", input="hi")
    assert r.store is False
    with pytest.raises(openai.BadRequestError) as e:
        await client.responses.create(model="m", input="hi", previous_response_id=r.id)
    assert e.value.body["param"] == "previous_response_id" and "not stored" in e.value.body["message"]
    with pytest.raises(openai.NotFoundError) as e:
        await client.responses.retrieve(r.id)
    assert "does not store" in e.value.body["message"]


@pytest.mark.redis
async def test_two_router_replicas_share_a_redis_store(tiny_model_dir, redis_server):
    url = redis_server.url.rsplit("/", 1)[0] + "/3"   # a database of its own, as deployments should
    apps = []
    for _ in range(2):
        service = _service(tiny_model_dir, responses_store=url, responses_store_ttl_s=60.0)
        apps.append((service, _client(build_app(service))))  # type: ignore[arg-type]
    (s1, c1), (s2, c2) = apps
    tag = uuid.uuid4().hex
    r1 = await c1.responses.create(model="m", input=f"Remember {tag}.")
    r2 = await c2.responses.create(model="m", previous_response_id=r1.id, input="What did I ask?")
    assert r2.previous_response_id == r1.id and tag in s2.rendered
    assert (await c1.responses.retrieve(r2.id)).id == r2.id


@pytest.mark.redis
async def test_turns_of_one_conversation_at_once_on_two_replicas_keep_every_item(tiny_model_dir, redis_server):
    """Parallel turns in one conversation (sub-agents sharing it), answered by two replicas at the same
    moment: each adds its input and output to the conversation as it is then, so none is lost."""
    url = redis_server.url.rsplit("/", 1)[0] + "/3"
    c1, c2 = (_client(build_app(_service(tiny_model_dir, responses_store=url)))  # type: ignore[arg-type]
              for _ in range(2))
    c = await c1.conversations.create()
    answers = await asyncio.gather(*[(c1, c2)[i % 2].responses.create(model="m", conversation=c.id, input=f"task {i}")
                                     for i in range(12)])
    items = [i async for i in c2.conversations.items.list(c.id, limit=100)]
    texts = {i.content[0].text for i in items if i.type == "message" and i.role == "user"}
    assert texts == {f"task {i}" for i in range(12)}
    assert {o.id for r in answers for o in r.output} <= {i.id for i in items}


async def test_a_store_that_cannot_answer_is_a_503_and_never_costs_an_answer(tiny_model_dir):
    """A Redis store whose server is gone: what needs the store is a 503 saying so; a plain request is
    still answered (its response is not kept, and the metric counts the error)."""
    import socket

    from kvmesh_router import metrics

    with socket.socket() as dead:   # bound, never listening: every connection is refused
        dead.bind(("127.0.0.1", 0))
        url = f"redis://127.0.0.1:{dead.getsockname()[1]}/0"
        service = _service(tiny_model_dir, responses_store=url)
        client = _client(build_app(service))  # type: ignore[arg-type]
        errors = metrics.RESPONSES_STORED.labels(outcome="error")._value.get()
        r = await client.responses.create(model="m", input="hi")
        assert r.output_text and metrics.RESPONSES_STORED.labels(outcome="error")._value.get() == errors + 1
        for call in (client.responses.create(model="m", input="more", previous_response_id=r.id),
                     client.responses.retrieve(r.id), client.responses.delete(r.id)):
            with pytest.raises(openai.InternalServerError) as e:
                await call
            assert e.value.status_code == 503 and "response store is unavailable" in e.value.body["message"]


# -- the Conversations API -----------------------------------------------------------------
async def test_a_conversation_collects_each_responses_input_and_output(routed):
    service, client = routed
    c = await client.conversations.create(items=[{"type": "message", "role": "developer", "content": "Repo: kvmesh."}],
                                          metadata={"team": "infra"})
    assert c.object == "conversation" and c.metadata == {"team": "infra"}
    r1 = await client.responses.create(model="m", conversation=c.id, input="Read a.py.", tools=TOOLS)
    assert r1.conversation.id == c.id
    assert "Repo: kvmesh." in service.rendered and "Read a.py." in service.rendered
    outputs = [{"type": "function_call_output", "call_id": o.call_id, "output": "x = 1"}
               for o in r1.output if o.type == "function_call"]
    r2 = await client.responses.create(model="m", conversation={"id": c.id}, input=outputs, tools=TOOLS, store=False)
    # The second turn saw the first one's input and output, as a client sending them would render them.
    chained = service.rendered
    whole = [{"type": "message", "role": "developer", "content": "Repo: kvmesh."},
             {"role": "user", "content": "Read a.py."}, *[o.model_dump(exclude_none=True) for o in r1.output],
             *outputs]
    await client.responses.create(model="m", input=whole, tools=TOOLS, store=False)
    assert service.rendered == chained and r2.conversation.id == c.id and r2.store is False
    items = [i async for i in client.conversations.items.list(c.id, order="asc")]
    assert [i.type for i in items] == ["message", "message", *[o.type for o in r1.output],
                                       *["function_call_output"] * len(outputs), *[o.type for o in r2.output]]
    assert items[1].content[0].text == "Read a.py." and items[2].id == r1.output[0].id
    got = await client.conversations.items.retrieve(items[1].id, conversation_id=c.id)
    assert got.id == items[1].id
    after = await client.conversations.items.delete(items[1].id, conversation_id=c.id)
    assert after.id == c.id
    assert len([i async for i in client.conversations.items.list(c.id)]) == len(items) - 1
    added = await client.conversations.items.create(c.id, items=[{"role": "user", "content": "One more thing."}])
    assert [i.content[0].text for i in added.data] == ["One more thing."]
    updated = await client.conversations.update(c.id, metadata={"team": "serving"})
    assert updated.metadata == {"team": "serving"} and (await client.conversations.retrieve(c.id)).metadata == {
        "team": "serving"}
    deleted = await client.conversations.delete(c.id)
    assert deleted.deleted is True and deleted.object == "conversation.deleted"
    for call in (client.conversations.retrieve(c.id), client.responses.create(model="m", conversation=c.id,
                                                                              input="hi")):
        with pytest.raises(openai.NotFoundError):
            await call


async def test_conversations_are_checked_and_kept_apart(routed, tiny_model_dir, tmp_path):
    service, client = routed
    c = await client.conversations.create()
    r = await client.responses.create(model="m", input="hi")
    with pytest.raises(openai.BadRequestError) as e:
        await client.responses.create(model="m", input="x", conversation=c.id, previous_response_id=r.id)
    assert e.value.body["param"] == "conversation" and "Mutually exclusive" in e.value.body["message"]
    for bad in ([{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/a.png"}]}],
                [{"role": "user", "content": "x"}] * 21, [{"type": "item_reference", "id": "msg_1"}], "text"):
        with pytest.raises(openai.BadRequestError) as e:
            await client.conversations.items.create(c.id, items=bad)   # type: ignore[arg-type]
        assert e.value.body["param"] == "items"
    with pytest.raises(openai.BadRequestError):
        await client.conversations.create(metadata={"k": "v" * 600})
    # A response id is not a conversation, nor the other way round.
    with pytest.raises(openai.NotFoundError):
        await client.responses.create(model="m", input="x", conversation=r.id)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(c.id)
    with pytest.raises(openai.NotFoundError):
        await client.conversations.retrieve(r.id)
    # Another tenant sees none of it.
    keys = tmp_path / "keys"
    keys.write_text("team-a KEY-A\nteam-b KEY-B\n")
    app = build_app(_service(tiny_model_dir), RequestScopes("keys", ApiKeys(keys)))  # type: ignore[arg-type]
    a, b = _client(app, "KEY-A"), _client(app, "KEY-B")
    ca = await a.conversations.create(items=[{"role": "user", "content": "secret"}])
    for call in (b.conversations.retrieve(ca.id), b.conversations.items.list(ca.id), b.conversations.delete(ca.id),
                 b.conversations.items.create(ca.id, items=[{"role": "user", "content": "x"}]),
                 b.responses.create(model="m", conversation=ca.id, input="what was it?")):
        with pytest.raises(openai.NotFoundError):
            await call
    assert [i.content[0].text for i in (await a.conversations.items.list(ca.id)).data] == ["secret"]


async def test_with_the_store_off_conversations_are_refused(tiny_model_dir):
    client = _client(build_app(_service(tiny_model_dir, responses_store="off")))  # type: ignore[arg-type]
    with pytest.raises(openai.NotFoundError) as e:
        await client.conversations.create()
    assert "not stored" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        await client.responses.create(model="m", input="x", conversation="conv_1")
    assert e.value.body["param"] == "conversation"


# -- background responses --------------------------------------------------------------------
class _Held(_RoutedService):
    """The stand-in whose answer waits for ``release``; ``closed`` counts generations stopped early."""

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(tokenizer)
        self.release = asyncio.Event()
        self.closed = 0

    async def generate(self, inp: Any) -> Any:
        finished = False
        try:
            await self.release.wait()
            async for item in super().generate(inp):
                yield item
            finished = True
        finally:
            self.closed += not finished


def _held(tiny_model_dir: Path, **cfg: Any) -> _Held:
    service = _Held(load_tokenizer(tiny_model_dir))
    for k, v in cfg.items():
        setattr(service.cfg, k, v)
    return service


async def _until(client: openai.AsyncOpenAI, rid: str, statuses: set[str], timeout_s: float = 10.0) -> Any:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        r = await client.responses.retrieve(rid)
        if r.status in statuses or asyncio.get_running_loop().time() > deadline:
            return r
        await asyncio.sleep(0.05)


async def test_a_background_response_is_queued_then_polled_to_its_answer(tiny_model_dir):
    service = _held(tiny_model_dir)
    client = _client(build_app(service))  # type: ignore[arg-type]
    r = await client.responses.create(model="m", input="Read a.py.", tools=TOOLS, background=True)
    assert r.status == "queued" and r.background is True and r.output == [] and r.store is True
    with pytest.raises(openai.BadRequestError) as e:   # nothing to chain from yet
        await client.responses.create(model="m", previous_response_id=r.id, input="Go on.")
    assert "has not finished" in e.value.body["message"]
    assert (await client.responses.retrieve(r.id)).status in ("queued", "in_progress")
    service.release.set()
    done = await _until(client, r.id, {"completed"})
    assert done.status == "completed" and done.background is True
    assert [o.type for o in done.output] == ["message", "function_call", "function_call"]
    assert done.usage.input_tokens == 50
    # It chains like any stored response.
    nxt = await client.responses.create(model="m", previous_response_id=r.id, input="Go on.")
    assert nxt.previous_response_id == r.id and "Read a.py." in service.rendered
    with pytest.raises(openai.BadRequestError) as e:
        await client.responses.cancel(r.id)
    assert "already completed" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        await client.responses.cancel(nxt.id)
    assert e.value.body["message"] == "Cannot cancel a synchronous response."


async def test_a_cancelled_background_response_stops_and_stays_cancelled(tiny_model_dir):
    service = _held(tiny_model_dir)
    client = _client(build_app(service))  # type: ignore[arg-type]
    r = await client.responses.create(model="m", input="A long job.", background=True)
    await _until(client, r.id, {"in_progress"})
    cancelled = await client.responses.cancel(r.id)
    assert cancelled.status == "cancelled" and cancelled.id == r.id
    for _ in range(100):
        if service.closed:
            break
        await asyncio.sleep(0.02)
    assert service.closed == 1   # the generation was stopped, not left to run
    service.release.set()
    await asyncio.sleep(0.1)
    assert (await client.responses.retrieve(r.id)).status == "cancelled"
    with pytest.raises(openai.NotFoundError):
        await client.responses.cancel("resp_nope")


async def test_a_failed_background_response_says_why(tiny_model_dir):
    service = _service(tiny_model_dir)
    service.fail_after_first = True
    client = _client(build_app(service))  # type: ignore[arg-type]
    r = await client.responses.create(model="m", input="hi", background=True)
    failed = await _until(client, r.id, {"failed"})
    assert failed.status == "failed" and "every endpoint is down" in failed.error.message


@pytest.mark.parametrize("kw, says", [
    (dict(store=False), "needs store: true"),
    (dict(extra_body={"background": "yes"}), "must be a boolean"),
])
async def test_background_requests_that_cannot_be_honoured_are_400s(routed, kw, says):
    _, client = routed
    with pytest.raises(openai.BadRequestError) as e:
        await client.responses.create(model="m", input="hi", **({"background": True} | kw))
    assert e.value.body["param"] == "background" and says in e.value.body["message"]
    with pytest.raises(openai.NotFoundError) as e:   # refused now, as a plain request would be, not later
        await client.responses.create(model="gpt-9", input="hi", background=True)
    assert e.value.body["param"] == "model"


async def test_a_background_response_whose_replica_stopped_reads_as_failed(tiny_model_dir):
    """A record left running past the request deadline lost the replica that ran it."""
    from kvmesh_router.responses_background import STALE_GRACE_S, BackgroundResponses

    bg = BackgroundResponses(None, None, deadline_s=600.0)  # type: ignore[arg-type]
    running = {"id": "resp_1", "status": "in_progress", "created_at": 0}
    assert bg.as_read(running)["status"] == "failed"
    fresh = {**running, "created_at": int(time.time()) - 600 - STALE_GRACE_S + 5}
    assert bg.as_read(fresh)["status"] == "in_progress"
    assert bg.as_read({**running, "status": "completed"})["status"] == "completed"


@pytest.mark.redis
async def test_a_background_response_is_cancelled_from_another_replica(tiny_model_dir, redis_server):
    url = redis_server.url.rsplit("/", 1)[0] + "/3"
    runner = _held(tiny_model_dir, responses_store=url)
    c1 = _client(build_app(runner))  # type: ignore[arg-type]
    c2 = _client(build_app(_service(tiny_model_dir, responses_store=url)))  # type: ignore[arg-type]
    r = await c1.responses.create(model="m", input="A long job.", background=True)
    assert (await _until(c2, r.id, {"in_progress"})).status == "in_progress"   # any replica answers the poll
    assert (await c2.responses.cancel(r.id)).status == "cancelled"
    for _ in range(150):   # the runner reads its record every second
        if runner.closed:
            break
        await asyncio.sleep(0.02)
    assert runner.closed == 1
    runner.release.set()
    await asyncio.sleep(0.1)
    assert (await c1.responses.retrieve(r.id)).status == "cancelled"


async def test_background_responses_are_bounded_per_replica_and_tenant(tiny_model_dir, tmp_path):
    """They outlive their connections, so a client cannot start them without end: past the bounds, 429s;
    a finished one frees its place."""
    keys = tmp_path / "keys"
    keys.write_text("team-a KEY-A\nteam-b KEY-B\n")
    service = _held(tiny_model_dir, responses_background_max=3, responses_background_tenant_max=2)
    app = build_app(service, RequestScopes("keys", ApiKeys(keys)))  # type: ignore[arg-type]
    a, b = _client(app, "KEY-A"), _client(app, "KEY-B")
    started = [await a.responses.create(model="m", input="job", background=True) for _ in range(2)]
    with pytest.raises(openai.RateLimitError) as e:
        await a.responses.create(model="m", input="one more", background=True)
    assert "of this tenant" in e.value.body["message"]
    await b.responses.create(model="m", input="job", background=True)   # another tenant still may
    with pytest.raises(openai.RateLimitError) as e:
        await b.responses.create(model="m", input="one more", background=True)
    assert "on this server (3)" in e.value.body["message"]
    service.release.set()
    for r in started:
        assert (await _until(a, r.id, {"completed"})).status == "completed"
    await asyncio.sleep(0.05)   # the runner's last step after its record is written
    assert (await a.responses.create(model="m", input="again", background=True)).status == "queued"


async def test_a_store_that_stops_answering_for_a_while_does_not_stop_a_background_response(tiny_model_dir):
    from kvmesh.responses_api.store.base import StoreError
    from kvmesh.responses_api.store.memory import MemoryResponseStore

    class Flaky(MemoryResponseStore):
        down = False

        async def get(self, tenant: str, response_id: str) -> Any:
            if self.down:
                raise StoreError("ConnectionError: down")
            return await super().get(tenant, response_id)

    store = Flaky(60, 1 << 20, 1 << 20)
    service = _held(tiny_model_dir)
    client = _client(build_app(service, store=store))  # type: ignore[arg-type]
    r = await client.responses.create(model="m", input="A long job.", background=True)
    store.down = True
    await asyncio.sleep(1.3)   # the runner's poll meets the outage
    store.down = False
    service.release.set()
    assert (await _until(client, r.id, {"completed"})).status == "completed" and service.closed == 0


async def test_a_streamed_background_response_resumes_where_its_client_left(tiny_model_dir):
    """background + stream: the events come as they are made; a client whose connection broke resumes
    with retrieve(stream=True, starting_after=N) and gets the rest, numbered on, to response.completed."""
    service = _held(tiny_model_dir)
    async with served(build_app(service)) as base:  # type: ignore[arg-type]
        async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="k", max_retries=0) as client:
            await _resumes(service, client)


async def _resumes(service: _Held, client: openai.AsyncOpenAI) -> None:
    stream = await client.responses.create(model="m", input="Read a.py.", tools=TOOLS, background=True, stream=True)
    seen = []
    async for event in stream:
        seen.append(event)
        if event.type == "response.in_progress":
            break   # the client goes away before the answer
    await stream.close()
    rid = seen[0].response.id
    assert [e.sequence_number for e in seen] == [0, 1] and seen[0].response.background is True
    service.release.set()
    rest = [e async for e in await client.responses.retrieve(rid, stream=True, starting_after=1)]
    assert [e.sequence_number for e in rest] == list(range(2, 2 + len(rest)))
    assert rest[-1].type == "response.completed" and service.closed == 0   # it ran on without its client
    done = await client.responses.retrieve(rid)
    assert done.status == "completed" and [o.id for o in done.output] == [o.id for o in rest[-1].response.output]
    again = [e async for e in await client.responses.retrieve(rid, stream=True)]   # from the start
    assert [e.sequence_number for e in again] == list(range(len(again))) and again[2:] == rest
    # A response whose events are not kept (not a streamed background one), and a bad starting_after.
    plain = await client.responses.create(model="m", input="hi")
    for params, param in (({"stream": "true"}, "stream"), ({"stream": "true", "starting_after": "x"}, "starting_after")):
        with pytest.raises(openai.BadRequestError) as e:
            await client.get(f"/responses/{plain.id if param == 'stream' else rid}", options={"params": params},
                             cast_to=dict)
        assert e.value.body["param"] == param


async def test_a_cancelled_streamed_background_response_ends_its_stream(tiny_model_dir):
    service = _held(tiny_model_dir)
    async with served(build_app(service)) as base:  # type: ignore[arg-type]
        async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="k", max_retries=0) as client:
            stream = await client.responses.create(model="m", input="A long job.", background=True, stream=True)
            await _cancel_ends(service, client, stream)


async def _cancel_ends(service: _Held, client: openai.AsyncOpenAI, stream: Any) -> None:
    first = await stream.__anext__()
    await client.responses.cancel(first.response.id)
    rest = [e async for e in stream]   # the stream ends rather than hanging
    assert all(e.type != "response.completed" for e in rest) and service.closed == 1
    assert (await client.responses.retrieve(first.response.id)).status == "cancelled"


async def test_ended_event_logs_are_bounded():
    """Streamed background responses' events outlive them only within a byte budget, oldest first."""
    from kvmesh_router import responses_background as rb

    bg = rb.BackgroundResponses(None, None, deadline_s=600.0)  # type: ignore[arg-type]
    budget, rb.LOGS_MAX_BYTES = rb.LOGS_MAX_BYTES, 1000
    try:
        for i in range(5):
            log = rb.EventLog()
            log.add(b"event: x\ndata: " + b"y" * 380 + b"\n\n")
            log.close()
            bg._logs[("t", f"resp_{i}")] = log
            bg._retire(("t", f"resp_{i}"), log.size)
        assert [k[1] for k in bg._logs] == ["resp_3", "resp_4"] and bg._ended_bytes <= 1000
        assert [e async for e in bg.events_of("t", "resp_4").follow(-1)] == bg._logs[("t", "resp_4")].events
        assert bg.events_of("u", "resp_4") is None   # another tenant's is not found
    finally:
        rb.LOGS_MAX_BYTES = budget


@pytest.mark.redis
async def test_a_streamed_background_response_resumes_on_another_replica(tiny_model_dir, redis_server):
    """With a shared (Redis) store the events are there too: a client that lost its connection to the
    replica running the response resumes on the other one."""
    url = redis_server.url.rsplit("/", 1)[0] + "/3"
    runner = _held(tiny_model_dir, responses_store=url)
    other = _client(build_app(_service(tiny_model_dir, responses_store=url)))  # type: ignore[arg-type]
    async with served(build_app(runner)) as base:  # type: ignore[arg-type]
        async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="k", max_retries=0) as client:
            stream = await client.responses.create(model="m", input="Read a.py.", tools=TOOLS, background=True,
                                                   stream=True)
            first = await stream.__anext__()
            await stream.close()
            runner.release.set()
            rest = [e async for e in await other.responses.retrieve(first.response.id, stream=True, starting_after=0)]
    assert [e.sequence_number for e in rest] == list(range(1, 1 + len(rest)))
    assert rest[0].type == "response.in_progress" and rest[-1].type == "response.completed"
    assert (await other.responses.retrieve(first.response.id)).status == "completed"


@pytest.mark.redis
async def test_background_bounds_hold_for_requests_that_arrive_together(tiny_model_dir, redis_server):
    """The place is taken before the (Redis) store is awaited: requests arriving together cannot all pass
    the count before any of them is running."""
    url = redis_server.url.rsplit("/", 1)[0] + "/3"
    service = _held(tiny_model_dir, responses_store=url, responses_background_max=2)
    client = _client(build_app(service))  # type: ignore[arg-type]
    got = await asyncio.gather(*[client.responses.create(model="m", input=f"job {i}", background=True)
                                 for i in range(6)], return_exceptions=True)
    assert sum(not isinstance(r, Exception) for r in got) == 2
    assert all(isinstance(r, openai.RateLimitError) for r in got if isinstance(r, Exception))
    service.release.set()


async def test_deleting_a_running_background_response_stops_it(tiny_model_dir):
    service = _held(tiny_model_dir)
    client = _client(build_app(service))  # type: ignore[arg-type]
    r = await client.responses.create(model="m", input="A long job.", background=True)
    await _until(client, r.id, {"in_progress"})
    await client.responses.delete(r.id)
    for _ in range(100):
        if service.closed:
            break
        await asyncio.sleep(0.02)
    assert service.closed == 1
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(r.id)


@pytest.mark.redis
@pytest.mark.parametrize("ending", ["cancelled", "replica_stopped", "log_expired"])
async def test_a_resumption_on_another_replica_ends_when_its_response_cannot_go_on(redis_server, ending,
                                                                                    monkeypatch):
    """A reader following the shared store's events of a response with no last event yet ends (it does
    not wait for ever) once the response was cancelled, its replica stopped (past its deadline) or its log
    expired; meanwhile it reads the whole record only now and then."""
    from kvmesh.responses_api.store.base import StoredResponse
    from kvmesh.responses_api.store.redis_store import RedisResponseStore
    from kvmesh_router import responses_background as rb

    monkeypatch.setattr(rb, "SHARED_POLL_S", 0.01)
    monkeypatch.setattr(rb, "SHARED_CANCEL_LOOKS_PER_RECORD", 4)
    store = RedisResponseStore(redis_server.url, ttl_s=60, max_record_bytes=8000, prefix=f"t{uuid.uuid4().hex}:")
    reads = 0
    get = store.get

    async def counted(tenant: str, rid: str) -> Any:
        nonlocal reads
        reads += 1
        return await get(tenant, rid)

    monkeypatch.setattr(store, "get", counted)
    created = 0 if ending == "replica_stopped" else int(time.time())
    await store.put("t", StoredResponse({"id": "resp_1", "object": "response", "status": "in_progress",
                                         "background": True, "created_at": created}, []))
    await store.add_events("t", "resp_1", [b"event: response.created\n\n"], ttl_s=0.3 if ending == "log_expired" else 60)
    bg = rb.BackgroundResponses(store, None, deadline_s=600.0)  # type: ignore[arg-type]
    reader = await bg.follow("t", "resp_1", -1)
    assert reader is not None
    got = [await reader.__anext__()]
    if ending == "cancelled":
        await store.mark_cancelled("t", "resp_1", 60)
    got += [e async for e in reader]   # ends, and without an event it never had
    assert got == [b"event: response.created\n\n"]
    if ending == "cancelled":
        assert reads == 0   # a cancel is seen by its marker, not by reading the record
    if ending == "replica_stopped":
        assert reads == 1
    await store.close()
