"""A worker that leaves the router while requests run on it (the autoscaler removes a dead or hung worker,
which closes its channel and so cancels the calls still open on it): each of those requests ends at once
with UNAVAILABLE (HTTP 503, or an error event once streaming), on both fronts, never as if its client had
cancelled it and never left open."""

from __future__ import annotations

import threading
import time

import grpc
import openai
import pytest
from vlkv.tools.client import build_request

from tests.test_e2e_equality import random_png
from tests.test_http_front import MODEL, Front, Q, chat, data_url


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
