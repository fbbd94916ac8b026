"""A worker that leaves the router while requests run on it (the autoscaler removes a dead or hung worker,
which closes its channel and so cancels the calls still open on it): each of those requests ends at once
with UNAVAILABLE (HTTP 503, or an error event once streaming), on both fronts, never as if its client had
cancelled it and never left open."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import replace

import grpc
import openai
import pytest
from http_front_harness import MODEL, TOKEN, Front, Q, chat, data_url
from sample_images import random_png
from vlkv.common.config import PoolConfig, TransferConfig
from vlkv.deploy.client import build_request, connect, generate
from vlkv.deploy.servers import start_decode_worker, start_gateway, start_prefill_worker


@pytest.fixture(scope="module")
def front(tiny_model_dirs):
    f = Front(tiny_model_dirs("llava-gqa"))
    yield f
    f.close()


def _remove_decode_when_streaming(front, started: threading.Event):
    router = front.cluster.gateway.servicer.router
    address = front.cluster.decode.address
    assert started.wait(60)
    front.cluster.run(router.remove(address))

    async def add_back() -> None:
        router.add_decode(address)

    front.cluster.run(add_back())  # back for the next test (the worker itself never stopped) ...
    end = time.monotonic() + 30
    while time.monotonic() < end and not router.decode[address].load.total_blocks:
        time.sleep(0.02)  # ... once the router has its first pushed load


def test_decode_worker_removed_mid_stream_ends_http_stream_with_unavailable(front):
    started = threading.Event()
    remover = threading.Thread(target=_remove_decode_when_streaming, args=(front, started))
    remover.start()
    stream = front.client.chat.completions.create(
        model=MODEL, messages=chat(data_url(random_png(3))), max_tokens=900, stream=True
    )
    chunks = 0
    with pytest.raises(openai.APIError) as err:
        for _ in stream:
            chunks += 1
            if chunks == 3:
                started.set()
    remover.join(30)
    assert chunks >= 3 and err.value.code == "unavailable"
    assert front.cluster.gateway.servicer.in_flight == 0


def test_decode_worker_removed_mid_stream_ends_grpc_stream_with_unavailable(front):
    started = threading.Event()
    remover = threading.Thread(target=_remove_decode_when_streaming, args=(front, started))
    remover.start()
    call = front.stub.Generate(build_request(images=[random_png(4)], question=Q, max_new_tokens=900))
    tokens = 0
    with pytest.raises(grpc.RpcError) as err:
        for resp in call:
            tokens += resp.HasField("token")
            if tokens == 3:
                started.set()
    remover.join(30)
    assert tokens >= 3 and err.value.code() == grpc.StatusCode.UNAVAILABLE
    # the worker serves again once back in the router
    out = front.client.chat.completions.create(
        model=MODEL, messages=chat(data_url(random_png(5))), max_tokens=2
    )
    assert out.usage.completion_tokens == 2


def test_decode_worker_lost_before_the_first_token_is_retried_on_another(front):
    """The request's decode worker fails while the cache is still on its way (a slow hand-off): nothing has
    reached the client, so the gateway runs the request once more on the other decode worker."""
    cl = front.cluster
    slow = replace(front.cfg, transfer=TransferConfig(fault_chunk_delay_ms=1000))
    prefill = cl.run(start_prefill_worker(slow, model=cl.model, processor=cl.processor))
    roomy = replace(front.cfg, pool=PoolConfig(pool_bytes=16 << 20))  # the most room: picked first
    doomed = cl.run(start_decode_worker(roomy, model=cl.model, tokenizer=cl.processor.tokenizer))
    for d in (doomed, cl.decode):
        prefill.servicer.allow_decode(d.address)
    decode = [doomed.address, cl.decode.address]
    gateway = cl.run(start_gateway(front.cfg, [prefill.address], decode, processor=cl.processor))
    router = gateway.servicer.router
    channel, stub = connect(gateway.address, token=TOKEN)
    free = cl.pool.num_free
    try:
        end = time.monotonic() + 30
        while time.monotonic() < end and not all(router.decode[a].load.total_blocks for a in decode):
            time.sleep(0.02)
        request = build_request(images=[random_png(6)], question=Q, max_new_tokens=5, policy="full")
        call = threading.Thread(target=lambda: out.append(generate(stub, request, timeout=60)))
        out: list = []
        call.start()
        while time.monotonic() < end and not router.decode[doomed.address].in_flight:
            time.sleep(0.01)
        assert router.decode[doomed.address].in_flight == 1  # its cache is on its way there, slowly
        cl.run(doomed.server.stop(0))  # the worker fails hard: no grace, no drain
        call.join(60)
        assert out and out[0].finished is not None and len(out[0].token_ids) == 5
        end = time.monotonic() + 10
        while time.monotonic() < end and cl.pool.num_free != free:
            time.sleep(0.02)
        assert cl.pool.num_free == free  # served on the other worker, whose blocks are back
    finally:
        channel.close()
        for server in (gateway, prefill, doomed):
            cl.run(server.stop())


def test_an_internal_call_cancelled_under_a_request_fails_it_on_both_fronts(front, monkeypatch):
    """A routing call cancelled by a closing channel (the router polls a worker as the autoscaler removes it)
    surfaces as CancelledError inside the request: it fails with UNAVAILABLE / 503, not left open."""

    async def pick_decode(*args, **kwargs):
        raise asyncio.CancelledError  # what a call on a channel closed under it raises

    monkeypatch.setattr(front.cluster.gateway.servicer.router, "pick_decode", pick_decode)
    request = build_request(images=[random_png(7)], question=Q, max_new_tokens=2)
    with pytest.raises(grpc.RpcError) as err:
        generate(front.stub, request, timeout=20)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(openai.APIStatusError) as err:
        front.client.chat.completions.create(
            model=MODEL, messages=chat(data_url(random_png(7))), max_tokens=2
        )
    assert err.value.status_code == 503 and err.value.body["code"] == "unavailable"
    assert front.cluster.gateway.servicer.in_flight == 0
