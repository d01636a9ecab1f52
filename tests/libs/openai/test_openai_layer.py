"""The shared OpenAI layer: request validation, the error shape, SSE framing, response builders."""

from __future__ import annotations

import json

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from kvmesh.openai import sse
from kvmesh.openai.errors import BadRequest, OpenAIError, error_body, install_error_handlers
from kvmesh.openai.requests import parse_chat, parse_completion, read_json
from kvmesh.openai.responses import Answer
from kvmesh.openai.usage import usage

OK = {"model": "m", "prompt": "hi"}


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": "x"}, "model"),
    ({"model": "", "prompt": "x"}, "model"),
    ({"model": 3, "prompt": "x"}, "model"),
    ({"model": "m"}, "prompt"),
    ({"model": "m", "prompt": ""}, "prompt"),
    ({"model": "m", "prompt": []}, "prompt"),
    ({"model": "m", "prompt": [[1, 2], [3]]}, "prompt"),
    ({"model": "m", "prompt": [1, True]}, "prompt"),
    ({**OK, "echo": True}, "echo"),
    ({**OK, "max_tokens": 0}, "max_tokens"),
    ({**OK, "max_tokens": "3"}, "max_tokens"),
    ({**OK, "max_tokens": 2.5}, "max_tokens"),
    ({**OK, "max_completion_tokens": 0}, "max_completion_tokens"),
    ({**OK, "temperature": -1}, "temperature"),
    ({**OK, "temperature": 2.1}, "temperature"),
    ({**OK, "temperature": True}, "temperature"),
    ({**OK, "top_p": 0}, "top_p"),
    ({**OK, "top_p": 1.5}, "top_p"),
    ({**OK, "n": 2}, "n"),
    ({**OK, "seed": 1.5}, "seed"),
    ({**OK, "stop": 3}, "stop"),
    ({**OK, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({**OK, "stop_token_ids": ["x"]}, "stop_token_ids"),
    ({**OK, "ignore_eos": "yes"}, "ignore_eos"),
    ({**OK, "stream": "yes"}, "stream"),
    ({**OK, "stream_options": []}, "stream_options"),
    ({**OK, "cache_salt": 5}, "cache_salt"),
])
def test_bad_completion_fields_name_the_param(body, param) -> None:
    with pytest.raises(BadRequest) as ei:
        parse_completion(body, {})
    assert ei.value.param == param and ei.value.status == 400 and ei.value.message


def test_completion_parsing() -> None:
    r = parse_completion({"model": "m", "prompt": [[5, 6]], "max_completion_tokens": 3, "max_tokens": 9,
                          "temperature": 0, "top_p": 1, "stop": ["", "x"], "stream": True,
                          "stream_options": {"include_usage": True}, "session_id": "s1"}, {"x-session-id": "h"})
    assert r.prompt_ids == [5, 6] and r.prompt_text is None and r.max_tokens == 3
    assert r.temperature == 0 and r.top_p == 1 and r.stop == ["x"] and r.stream and r.include_usage
    assert r.session_id == "s1"
    r = parse_completion({"model": "m", "prompt": ["text"], "user": "u"}, {})
    assert r.prompt_text == "text" and r.max_tokens is None and r.temperature is None and r.session_id == "u"
    assert parse_completion({**OK, "user": "u"}, {"x-session-id": "h"}).session_id == "h"


@pytest.mark.parametrize(("messages", "param"), [
    (None, "messages"),
    ([], "messages"),
    ("hi", "messages"),
    ([{"content": "no role"}], "messages[0]"),
    ([{"role": "user", "content": 5}], "messages[0].content"),
    ([{"role": "user", "content": [{"type": "image_url"}]}], "messages[0].content"),
])
def test_bad_chat_messages(messages, param) -> None:
    body = {"model": "m"} if messages is None else {"model": "m", "messages": messages}
    with pytest.raises(BadRequest) as ei:
        parse_chat(body, {})
    assert ei.value.param == param


def test_chat_parsing_joins_text_parts_as_vllm() -> None:
    from kvmesh.tokenization.chat_render import conversation

    r = parse_chat({"model": "m", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "name": "x"},
        {"role": "assistant"}], "add_generation_prompt": False}, {})
    assert r.chat_request is not None
    # vLLM joins text parts with a newline for a template that reads content as a string.
    assert conversation(r.chat_request.messages, "string") == [
        {"role": "user", "name": "x", "content": "a\nb"}, {"role": "assistant", "content": ""}]
    assert r.chat and r.add_generation_prompt is False and r.prompt_ids is None
    with pytest.raises(BadRequest):
        parse_chat({"model": "m", "messages": [{"role": "user"}], "tools": {}}, {})


def _app() -> FastAPI:
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request) -> dict:
        return await read_json(request, 100)

    @app.get("/boom")
    async def boom() -> None:
        raise OpenAIError("engine down", status=503)

    install_error_handlers(app, headers={"x-test": "1"})
    return app


def test_error_shape_and_mapping() -> None:
    c = TestClient(_app())
    assert c.post("/echo", json={"a": 1}).json() == {"a": 1}
    for content, words, status in [(b"{not json", "malformed", 400), (b"[1]", "JSON object", 400),
                                   (b"\xff\xfe", "malformed", 400), (b"x" * 200, "over 100 bytes", 413)]:
        r = c.post("/echo", content=content)
        assert r.status_code == status and r.headers["x-test"] == "1"
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert words in err["message"] and err["param"] == "body" and err["type"] == "invalid_request_error"
        assert err["code"] == status
    r = c.get("/boom")
    assert r.status_code == 503 and r.json() == error_body(503, "engine down", "server_error")
    r = c.get("/nowhere")
    assert r.status_code == 404 and r.json()["error"]["message"] == "no route /nowhere"
    r = c.delete("/echo")
    assert r.status_code == 405 and "not allowed" in r.json()["error"]["message"]


def test_sse_framing() -> None:
    assert sse.event({"a": "é"}) == b'data: {"a": "\\u00e9"}\n\n'
    assert sse.DONE == b"data: [DONE]\n\n"

    async def events():
        yield sse.event({"n": 1})
        yield sse.DONE

    app = FastAPI()
    app.add_api_route("/s", lambda: sse.sse_response(events(), headers={"x-e": "w"}), methods=["GET"])
    r = TestClient(app).get("/s")
    assert r.headers["content-type"].startswith("text/event-stream")
    assert r.headers["cache-control"] == "no-cache" and r.headers["x-accel-buffering"] == "no"
    assert r.headers["x-e"] == "w"
    assert r.text == 'data: {"n": 1}\n\ndata: [DONE]\n\n'


def test_usage_and_builders() -> None:
    u = usage(10, 3, 8, cached_tokens_gpu=8)
    assert u == {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13,
                 "prompt_tokens_details": {"cached_tokens": 8, "cached_tokens_gpu": 8}}
    chat = Answer(chat=True, model="m")
    assert chat.id.startswith("chatcmpl-") and Answer(chat=False, model="m").id.startswith("cmpl-")
    first, second = chat.chunk("a", [1], None, True), chat.chunk("b", [2], "stop", False)
    assert first["object"] == "chat.completion.chunk" and first["choices"][0]["delta"] == {"role": "assistant",
                                                                                          "content": "a"}
    assert second["choices"][0]["delta"] == {"content": "b"} and second["choices"][0]["finish_reason"] == "stop"
    assert chat.usage_chunk(u) == {"id": chat.id, "object": "chat.completion.chunk", "created": chat.created,
                                   "model": "m", "choices": [], "usage": u}
    resp = chat.response("hi", [1, 2], "length", u, kvmesh={"endpoint": "w"})
    assert resp["object"] == "chat.completion" and resp["choices"][0]["message"] == {"role": "assistant",
                                                                                     "content": "hi"}
    assert resp["choices"][0]["token_ids"] == [1, 2] and resp["kvmesh"] == {"endpoint": "w"}
    text = Answer(chat=False, model="m", id="r1")
    assert text.id == "r1" and text.chunk("t", None, "stop", True)["choices"][0] == {
        "index": 0, "finish_reason": "stop", "logprobs": None, "text": "t"}
    assert json.loads(sse.event(text.response("t", [], "stop", u))[6:])["object"] == "text_completion"


def test_json_depth_limit_counts_containers_not_brackets_in_strings() -> None:
    from kvmesh.openai.requests import parse_json_body

    def nested(n: int) -> bytes:   # an object whose "a" nests n - 1 lists: n levels in all
        return b'{"a": ' + b"[" * (n - 1) + b"]" * (n - 1) + b"}"

    assert isinstance(parse_json_body(nested(64), 64)["a"], list)
    for raw in (nested(65), nested(100_000), b"[" * 5_000_000):
        with pytest.raises(BadRequest) as ei:
            parse_json_body(raw, 64)
        assert ei.value.param == "body" and "nested deeper than 64" in ei.value.message
    text = "{[" * 5000 + '\\"' + "]}" * 5000      # brackets and an escaped quote inside a string
    body = parse_json_body(json.dumps({"model": "m", "messages": [{"role": "user", "content": text}]}).encode(), 64)
    assert body["messages"][0]["content"] == text


def test_json_body_parse_equals_json_and_refuses_what_json_rfc_does_not_allow() -> None:
    """The body parser (msgspec) gives what ``json.loads`` gives for valid JSON (unicode escapes, big
    integers, duplicate keys: last wins) and a 400 for what is not JSON."""
    from kvmesh.openai.requests import parse_json_body

    doc = {"model": "m", "n": 123456789012345678901234567890, "f": -1.5e300, "s": "caf\u00e9 \U0001F600 \\ \"q\"",
           "l": [None, True, False, {"k": []}]}
    for raw in (json.dumps(doc).encode(), json.dumps(doc, ensure_ascii=False).encode(), b'{"a": 1, "a": 2}'):
        assert parse_json_body(raw) == json.loads(raw)
    for raw in (b'{"a": NaN}', b'{"a": Infinity}', b'{"a": 1e400}', b'{"a": "\\ud800"}', b'{"a": 1} x', b""):
        with pytest.raises(BadRequest) as ei:
            parse_json_body(raw)
        assert ei.value.param == "body" and ei.value.status == 400
