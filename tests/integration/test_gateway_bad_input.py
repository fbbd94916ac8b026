"""Bad input gets a clear status from the gateway, and the servers keep serving afterwards."""

from __future__ import annotations

import grpc
import pytest
from inproc_cluster import InProcCluster
from sample_images import random_png
from vlkv.common.config import ModelConfig, PoolConfig, ServerConfig
from vlkv.deploy.client import build_request, generate
from vlkv.v1 import generate_pb2

Q = "what colour is the square ?"
INVALID = grpc.StatusCode.INVALID_ARGUMENT


@pytest.fixture(scope="module")
def cluster(tiny_model_dirs):
    cfg = ServerConfig(
        model=ModelConfig(path=tiny_model_dirs("llava-gqa")), pool=PoolConfig(pool_bytes=4 << 20)
    )
    c = InProcCluster(cfg)
    yield c
    c.close()


def _truncated_png() -> bytes:
    return random_png(1)[:60]


def _gif() -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buf, format="GIF")
    return buf.getvalue()


def _chat_no_messages():
    req = generate_pb2.GenerateRequest()
    req.chat.SetInParent()
    return req


BAD = {
    "undecodable image": (build_request(images=[b"not an image"], question=Q), INVALID, "cannot be decoded"),
    "truncated image": (build_request(images=[_truncated_png()], question=Q), INVALID, "image 0"),
    "gif image": (build_request(images=[_gif()], question=Q), INVALID, "only PNG and JPEG"),
    "empty image": (build_request(images=[b""], question=Q), INVALID, "empty"),
    "more images than placeholders": (
        build_request(prompt="USER : <image> " + Q + " ASSISTANT :", images=[random_png(1), random_png(2)]),
        INVALID,
        "placeholders",
    ),
    "placeholder without image": (
        build_request(prompt="USER : <image> " + Q + " ASSISTANT :"),
        INVALID,
        "placeholders",
    ),
    "no prompt": (generate_pb2.GenerateRequest(), INVALID, "prompt is empty"),
    "blank prompt": (build_request(prompt="   "), INVALID, "prompt is empty"),
    "chat without messages": (_chat_no_messages(), INVALID, "no messages"),
    "max_new_tokens 0": (build_request(prompt=Q, max_new_tokens=0), INVALID, "max_new_tokens"),
    "max_new_tokens huge": (build_request(prompt=Q, max_new_tokens=10**6), INVALID, "max_new_tokens"),
    "negative temperature": (build_request(prompt=Q, temperature=-1.0), INVALID, "temperature"),
    "nan temperature": (build_request(prompt=Q, temperature=float("nan")), INVALID, "temperature"),
    "top_p 0": (build_request(prompt=Q, top_p=0.0), INVALID, "top_p"),
    "top_p above 1": (build_request(prompt=Q, top_p=1.5), INVALID, "top_p"),
    "empty stop string": (build_request(prompt=Q, stop=[""]), INVALID, "stop"),
    "unknown policy": (build_request(prompt=Q, policy="magic"), INVALID, "unknown compression policy"),
    "budget 0": (build_request(prompt=Q, budget=0.0), INVALID, "budget"),
    "budget above 1": (build_request(prompt=Q, budget=1.5), INVALID, "budget"),
    "threshold 0": (build_request(prompt=Q, threshold=0.0), INVALID, "threshold"),
    "unknown allocator": (build_request(prompt=Q, allocator="magic"), INVALID, "allocator"),
    "prompt over context": (build_request(prompt="red " * 1100), INVALID, "over the limit"),
    "prompt + max_new over context": (
        build_request(prompt="red " * 1000, max_new_tokens=100),
        INVALID,
        "context",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_status_and_server_keeps_serving(cluster, case):
    request, code, needle = BAD[case]
    free = cluster.pool.num_free
    with pytest.raises(grpc.RpcError) as err:
        generate(cluster.stub, request, timeout=30)
    assert err.value.code() == code, err.value.details()
    assert needle in err.value.details()
    assert cluster.pool.num_free == free
    good = generate(
        cluster.stub, build_request(images=[random_png(7)], question=Q, max_new_tokens=3), timeout=30
    )
    assert good.finished is not None and good.finished.usage.generated_tokens >= 1
    assert cluster.pool.num_free == free
