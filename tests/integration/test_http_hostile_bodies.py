"""Hostile request bodies on the OpenAI-compatible HTTP front: every one gets a 4xx in OpenAI's error shape
(never a 500, never plain text), and the server answers a normal request right after."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import openai
import pytest
from http_front_harness import MAX_BODY_BYTES, MODEL, TOKEN, Front, chat, data_url
from sample_images import random_png
from vlkv.services.openai_schema import MAX_JSON_DEPTH


@pytest.fixture(scope="module")
def front(tiny_model_dirs):
    f = Front(tiny_model_dirs("llava-gqa"))
    yield f
    f.close()


def _post(front, body: bytes, path: str = "/chat/completions", headers: dict | None = None):
    """(status, parsed JSON body) of a raw POST."""
    head = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json", **(headers or {})}
    req = urllib.request.Request(front.http.url + path, data=body, method="POST", headers=head)
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        raw = err.read()
        try:
            return err.code, json.loads(raw)
        except ValueError:
            return err.code, raw  # not JSON: the assertions below report it


def _nested(depth: int, open_: str, close: str, inner: str = "1") -> bytes:
    return (open_ * depth + inner + close * depth).encode()


def _chat_body(**extra) -> dict:
    return {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "red ?"}], **extra}


def _deep_but_valid(depth: int) -> bytes:
    """A valid chat request whose ``logit_bias`` (any dict) nests ``depth`` levels in all."""
    inner: object = 1
    for _ in range(depth - 2):  # the body itself and logit_bias are two levels
        inner = {"a": inner}
    return json.dumps(_chat_body(logit_bias=inner)).encode()


BODIES = {
    "5,000 nested arrays": (_nested(5000, "[", "]"), 400, "nested deeper"),
    "5,000 nested objects": (_nested(5000, '{"a":', "}"), 400, "nested deeper"),
    "nested past the limit, under the parser's": (_deep_but_valid(MAX_JSON_DEPTH + 2), 400, "nested deeper"),
    "invalid UTF-8": (b'{"model": "\xff\xfe", "messages": []}', 400, "not valid JSON"),
    "lone surrogate escape": (
        json.dumps(_chat_body(stop=["\ud800"])).encode(),  # json.dumps escapes it as \ud800
        400,
        "not valid JSON",
    ),
    "integer of 5,000 digits": (b'{"model": "m", "seed": ' + b"9" * 5000 + b"}", 400, "not valid JSON"),
    "truncated": (b'{"model": "tiny-llava", "messages": [', 400, "not valid JSON"),
    "empty": (b"", 400, "not valid JSON"),
    "UTF-16": ('{"model": "x"}'.encode("utf-16"), 400, "not valid JSON"),
    "not an object": (b"[1, 2, 3]", 400, "JSON object"),
    "NaN temperature": (b'{"model": "tiny-llava", "temperature": NaN, "messages": []}', 400, ""),
    "messages not a list": (json.dumps(_chat_body(messages={"a": 1})).encode(), 400, "messages"),
    "over the body limit": (b"[" + b"1," * (MAX_BODY_BYTES // 2) + b"1]", 413, "body"),
}


@pytest.mark.parametrize("case", list(BODIES))
def test_hostile_body_gets_an_openai_shaped_4xx(front, case):
    body, status, needle = BODIES[case]
    got, answer = _post(front, body)
    assert got == status, (case, got, answer)
    assert isinstance(answer, dict) and set(answer) == {"error"}, answer
    error = answer["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and needle in error["message"]


def test_a_deep_but_allowed_body_is_served(front):
    got, answer = _post(front, _deep_but_valid(MAX_JSON_DEPTH))
    assert got == 400 and "logit_bias is not supported" in answer["error"]["message"]  # parsed, then refused


def test_hostile_completions_body(front):
    got, answer = _post(front, _nested(5000, "[", "]"), path="/completions")
    assert got == 400 and "nested deeper" in answer["error"]["message"]
    got, answer = _post(front, b'{"model": "tiny-llava", "prompt": "\xff"}', path="/completions")
    assert got == 400 and answer["error"]["type"] == "invalid_request_error"


def test_server_keeps_serving_after_hostile_bodies(front):
    free = front.cluster.pool.num_free
    for body, _, _ in BODIES.values():
        _post(front, body)
    out = front.client.chat.completions.create(
        model=MODEL, messages=chat(data_url(random_png(2))), max_tokens=3
    )
    assert out.usage.completion_tokens == 3 and front.cluster.pool.num_free == free
    deep: list = []
    for _ in range(MAX_JSON_DEPTH):
        deep = [deep]
    with pytest.raises(openai.BadRequestError) as err:  # the official client gets the same 400
        front.client.chat.completions.create(
            model=MODEL, messages=chat(data_url(random_png(2))), max_tokens=2, extra_body={"x": deep}
        )
    assert "nested deeper" in err.value.message


def _faulty_stream(tokens: int):
    from vlkv.v1 import generate_pb2

    async def stream(pb, **kwargs):
        for _ in range(tokens):
            yield generate_pb2.GenerateResponse(token=generate_pb2.TokenChunk(token_ids=[1], text="a"))
        raise RuntimeError("a bug in the server")

    return stream


def test_a_server_fault_is_an_openai_shaped_500_not_plain_text(front, monkeypatch):
    servicer = front.cluster.gateway.servicer
    monkeypatch.setattr(servicer, "stream", _faulty_stream(0))
    got, answer = _post(front, json.dumps(_chat_body()).encode())
    assert got == 500 and answer["error"]["type"] == "server_error"
    assert "a bug" not in answer["error"]["message"]  # no internals to the client
    monkeypatch.setattr(servicer, "stream", _faulty_stream(2))  # mid-stream: the stream ends with an error
    stream = front.client.chat.completions.create(
        model=MODEL, messages=chat(data_url(random_png(2))), stream=True
    )
    with pytest.raises(openai.APIError) as err:
        for _ in stream:
            pass
    assert "internal error" in err.value.message
