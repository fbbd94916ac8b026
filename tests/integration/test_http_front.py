"""The OpenAI-compatible HTTP front, driven by the official ``openai`` client: same tokens as the gRPC API,
usage with vlkv's KV figures, every error status, and a disconnect that frees the KV at once."""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request
from dataclasses import replace

import openai
import pytest
from http_front_harness import MAX_BODY_BYTES, MAX_IMAGE_BYTES, MODEL, Front, Q, chat, data_url
from sample_images import random_png
from vlkv.common.config import TransferConfig
from vlkv.deploy.client import build_request, generate
from vlkv.deploy.servers import start_gateway


@pytest.fixture(scope="module")
def front(tiny_model_dirs):
    f = Front(tiny_model_dirs("llava-gqa"))
    yield f
    f.close()


def _grpc(front, request):
    return generate(front.stub, request, timeout=60)


def test_models_and_health(front):
    assert [m.id for m in front.client.models.list().data] == [MODEL]
    base = front.http.url.removesuffix("/v1")
    with urllib.request.urlopen(base + "/health", timeout=10) as resp:  # no token needed
        assert resp.status == 200 and json.loads(resp.read())["status"] == "ok"


def test_chat_with_image_equals_grpc_and_reports_usage(front):
    png = random_png(3)
    ref = _grpc(front, build_request(images=[png], question=Q, max_new_tokens=12, budget=0.5))
    out = front.client.chat.completions.create(
        model=MODEL,
        messages=chat(data_url(png)),
        max_completion_tokens=12,
        temperature=0,
        extra_body={"vlkv": {"budget": 0.5, "return_token_ids": True}},
    )
    choice = out.choices[0]
    assert choice.message.content == ref.text and choice.token_ids == ref.token_ids
    assert choice.finish_reason == "length" and out.model == MODEL and out.object == "chat.completion"
    u, r = out.usage, ref.finished.usage
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (
        r.prompt_tokens,
        12,
        r.prompt_tokens + 12,
    )
    v = u.vlkv
    assert (
        v["kv_bytes_kept"] == r.kv_bytes_kept > 0 and v["kv_bytes_full"] == r.kv_bytes_full > r.kv_bytes_kept
    )
    assert v["vision_tokens"] == r.vision_tokens > 0 and v["layer_budgets"] == list(r.layer_budgets)
    assert v["policy"] == r.policy and 0 < v["compression_ratio"] <= 1 and v["ttft_ms"] > 0
    # a request that names no policy is verified (the server's default, floor); usage says what happened
    w = v["verification"]
    assert w["mode"] == "floor" == r.verify and w["candidate"] == r.verified_candidate != ""
    assert w["agreement"] == pytest.approx(r.verified_agreement) and w["draft_tokens"] == r.draft_tokens > 0
    assert (
        w["budget"] >= 0.5 - 1e-6 and w["floor_met"] == r.floor_met and w["budget_raises"] == r.budget_raises
    )


def test_streaming_chat_with_image_and_usage_chunk(front):
    png = random_png(4)
    ref = _grpc(front, build_request(images=[png], question=Q, max_new_tokens=10, policy="full"))
    stream = front.client.chat.completions.create(
        model=MODEL,
        messages=chat(data_url(png)),
        max_tokens=10,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"vlkv": {"policy": "full", "return_token_ids": True}},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    ids = [i for c in chunks if c.choices for i in (c.choices[0].model_extra.get("token_ids") or [])]
    assert text == ref.text and ids == ref.token_ids
    assert chunks[-2].choices[0].finish_reason == "length"
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 10
    assert last.usage.vlkv["compression_ratio"] == pytest.approx(1.0)
    assert last.usage.prompt_tokens == ref.finished.usage.prompt_tokens


def test_completions_plain_prompt_equals_grpc(front):
    prompt = "USER : what shape is red ? ASSISTANT :"
    ref = _grpc(front, build_request(prompt=prompt, max_new_tokens=6, stop=["zzz"]))
    out = front.client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, stop="zzz")
    assert out.choices[0].text == ref.text and out.object == "text_completion"
    assert out.usage.completion_tokens == ref.finished.usage.generated_tokens
    streamed = front.client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == ref.text


def _not_image() -> str:
    return data_url(b"not an image")


ERRORS = {
    "undecodable image": (dict(messages=chat(_not_image())), openai.BadRequestError, "cannot be decoded"),
    "gif data URL": (
        dict(messages=chat(data_url(b"GIF89a", "image/gif"))),
        openai.BadRequestError,
        "data:image/png",
    ),
    "remote image URL": (
        dict(messages=chat("https://example.com/cat.png")),
        openai.BadRequestError,
        "remote image URLs are not fetched",
    ),
    "bad temperature": (
        dict(messages=chat(data_url(random_png(1))), temperature=-1),
        openai.BadRequestError,
        "temperature",
    ),
    "n > 1": (dict(messages=chat(data_url(random_png(1))), n=2), openai.BadRequestError, "n=1"),
    "unknown role": (dict(messages=[{"role": "tool", "content": "x"}]), openai.BadRequestError, "messages.0"),
    "unknown vlkv field": (
        dict(messages=[{"role": "user", "content": Q}], extra_body={"vlkv": {"budgett": 0.1}}),
        openai.BadRequestError,
        "budgett",
    ),
    "unknown policy": (
        dict(messages=[{"role": "user", "content": Q}], extra_body={"vlkv": {"policy": "magic"}}),
        openai.BadRequestError,
        "unknown compression policy",
    ),
    "fidelity floor out of range": (
        dict(messages=[{"role": "user", "content": Q}], extra_body={"vlkv": {"fidelity_floor": 1.5}}),
        openai.BadRequestError,
        "fidelity_floor",
    ),
    "unknown model": (
        dict(messages=[{"role": "user", "content": Q}], model="gpt-5"),
        openai.NotFoundError,
        "gpt-5",
    ),
    "image over the limit": (
        dict(messages=chat(data_url(b"x" * (MAX_IMAGE_BYTES + 10)))),
        openai.APIStatusError,
        "image",
    ),
    "body over the limit": (
        dict(messages=[{"role": "user", "content": "red " * (MAX_BODY_BYTES // 4)}]),
        openai.APIStatusError,
        "body",
    ),
}
STATUS = {openai.BadRequestError: 400, openai.NotFoundError: 404, openai.APIStatusError: 413}


@pytest.mark.parametrize("case", list(ERRORS))
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(front, case):
    kwargs, exc_type, needle = ERRORS[case]
    free = front.cluster.pool.num_free
    kwargs = {"model": MODEL, "max_tokens": 4, **kwargs}
    with pytest.raises(exc_type) as err:
        front.client.chat.completions.create(**kwargs)
    assert err.value.status_code == STATUS[exc_type] and needle in err.value.message
    assert err.value.type in ("invalid_request_error", "not_found_error")
    good = front.client.chat.completions.create(
        model=MODEL, messages=chat(data_url(random_png(2))), max_tokens=3
    )
    assert good.usage.completion_tokens == 3 and front.cluster.pool.num_free == free


def test_missing_or_wrong_token_is_401(front):
    with pytest.raises(openai.AuthenticationError) as err:
        front.openai(front.http.url, key="wrong").models.list()
    assert err.value.status_code == 401 and "bearer token" in err.value.message
    req = urllib.request.Request(front.http.url + "/chat/completions", data=b"{}", method="POST")
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=10)
    body = json.loads(err.value.read())
    assert err.value.code == 401 and body["error"]["type"] == "authentication_error"


def test_full_pool_without_a_queue_is_429(front):
    pool = front.cluster.pool

    async def take_all():
        return pool.allocate([pool.num_free * pool.block_size], 0)

    async def give_back(blocks):
        pool.free(blocks)

    held = front.cluster.run(take_all())
    router = front.cluster.gateway.servicer.router
    deadline = (
        time.time() + 5
    )  # the router routes on the worker's pushed load: wait for the full pool's report
    while time.time() < deadline and any(w.load.free_blocks for w in router.decode.values()):
        time.sleep(0.02)
    try:
        with pytest.raises(openai.RateLimitError) as err:
            front.client.chat.completions.create(
                model=MODEL, messages=chat(data_url(random_png(1))), max_tokens=4, stream=True
            )
        assert err.value.status_code == 429 and "no decode worker has room" in err.value.message
    finally:
        front.cluster.run(give_back(held))


def _extra_front(front, prefill: list[str], decode: list[str], **transfer):
    cfg = replace(front.cfg, transfer=TransferConfig(**transfer)) if transfer else front.cfg
    gateway = front.cluster.run(start_gateway(cfg, prefill, decode, processor=front.cluster.processor))
    front.extra.append(gateway)
    http = front.start_http(gateway)
    front.extra.insert(0, http)  # stopped before its gateway
    return front.openai(http.url)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_no_reachable_decode_worker_is_503(front):
    dead = f"127.0.0.1:{_free_port()}"
    client = _extra_front(front, [front.cluster.prefill.address], [dead])
    with pytest.raises(openai.InternalServerError) as err:
        client.chat.completions.create(model=MODEL, messages=chat(data_url(random_png(1))), max_tokens=4)
    assert err.value.status_code == 503 and "no decode worker is reachable" in err.value.message


def test_prefill_past_its_deadline_is_504(front):
    hung = socket.socket()  # accepts connections, never answers: the Prefill call runs into its deadline
    hung.bind(("127.0.0.1", 0))
    hung.listen()
    try:
        client = _extra_front(
            front, [f"127.0.0.1:{hung.getsockname()[1]}"], [front.cluster.decode.address], deadline_s=0.5
        )
        free = front.cluster.pool.num_free
        with pytest.raises(openai.APIStatusError) as err:
            client.chat.completions.create(model=MODEL, messages=chat(data_url(random_png(1))), max_tokens=4)
        assert err.value.status_code == 504 and err.value.body["code"] == "deadline_exceeded"
        assert front.cluster.pool.num_free == free
    finally:
        hung.close()


def _metric(f: Front, name: str, **labels) -> float:
    value = f.cluster.gateway.servicer.metrics.registry.get_sample_value(name, labels)
    return value or 0.0


def test_disconnect_mid_stream_cancels_and_frees_the_kv(front):
    pool = front.cluster.pool
    start = pool.num_free
    cancelled = _metric(front, "vlkv_requests_total", status="CANCELLED", front="http")
    stream = front.client.chat.completions.create(
        model=MODEL, messages=chat(data_url(random_png(5))), max_tokens=900, stream=True
    )
    for got, _chunk in enumerate(stream, 1):
        if got == 4:
            assert pool.num_free < start  # the cache sits in the pool while the stream runs
            break
    stream.close()
    deadline = time.time() + 10
    while (pool.num_free != start or front.cluster.gateway.servicer.in_flight) and time.time() < deadline:
        time.sleep(0.01)
    assert pool.num_free == start and front.cluster.gateway.servicer.in_flight == 0
    assert _metric(front, "vlkv_requests_total", status="CANCELLED", front="http") == cancelled + 1
    assert _metric(front, "vlkv_generated_tokens_total", front="http") > 0


def test_grpc_and_http_share_the_metrics_labelled_by_front(front):
    ok_http = _metric(front, "vlkv_requests_total", status="OK", front="http")
    ok_grpc = _metric(front, "vlkv_requests_total", status="OK", front="grpc")
    verified = _metric(front, "vlkv_verified_agreement_count", budget="10")
    _grpc(front, build_request(images=[random_png(6)], question=Q, max_new_tokens=2))
    front.client.chat.completions.create(model=MODEL, messages=chat(data_url(random_png(6))), max_tokens=2)
    assert _metric(front, "vlkv_requests_total", status="OK", front="http") == ok_http + 1
    assert _metric(front, "vlkv_requests_total", status="OK", front="grpc") == ok_grpc + 1
    assert _metric(front, "vlkv_ttft_seconds_count", front="http") >= 1
    # both requests named no policy: verified at the default 10% and counted there
    assert _metric(front, "vlkv_verified_agreement_count", budget="10") == verified + 2


def test_a_continue_follow_up_through_the_openai_client_runs_on_the_decode_worker(front):
    first = chat(data_url(random_png(9)))

    def ask(messages, **vlkv):
        return front.client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_completion_tokens=6,
            temperature=0,
            extra_body={"vlkv": {"policy": "full", **vlkv}},
        )

    a = ask(first, conversation="continue")
    follow = [
        *first,
        {"role": "assistant", "content": a.choices[0].message.content},
        {"role": "user", "content": [{"type": "text", "text": "and the circle ?"}]},
    ]
    b = ask(follow, conversation="continue")
    assert a.usage.vlkv["continued_on"] == "" and b.usage.vlkv["continued_on"] == "decode"
    assert b.usage.vlkv["continued_tokens"] > 0 and b.usage.prompt_tokens_details.cached_tokens > 0
    # with nothing dropped, the follow-up answers as the same prompt prefilled afresh
    assert b.choices[0].message.content == ask(follow, reuse="off").choices[0].message.content
