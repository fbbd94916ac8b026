"""Property-based fuzz of the public API against a live gateway: 1,000 generated requests.

Every reply is a completed stream or a defined client-facing status (never UNKNOWN or INTERNAL), no KV block
leaks, and the server still answers a good request afterwards.
"""

from __future__ import annotations

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from vlkv.common.config import ModelConfig, PoolConfig, ServerConfig
from vlkv.tools.client import generate
from vlkv.v1 import generate_pb2

from tests.inproc_cluster import InProcCluster
from tests.test_e2e_equality import random_png

DEFINED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}
PNG = random_png(0, size=24)
WORDS = [
    "what",
    "colour",
    "is",
    "the",
    "square",
    "?",
    "<image>",
    "USER",
    ":",
    "ASSISTANT",
    "zzz",
    "é",
    "\x00",
]


@pytest.fixture(scope="module")
def cluster(tiny_model_dirs):
    cfg = ServerConfig(
        model=ModelConfig(path=tiny_model_dirs("llava-gqa")), pool=PoolConfig(pool_bytes=2 << 20)
    )
    c = InProcCluster(cfg)
    yield c
    c.close()


floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=32), st.sampled_from([0.0, 0.5, 1.0]))
images = st.lists(
    st.one_of(st.just(PNG), st.binary(max_size=64), st.just(PNG[: len(PNG) // 2]), st.just(b"")), max_size=3
)
texts = st.one_of(st.lists(st.sampled_from(WORDS), max_size=30).map(" ".join), st.text(max_size=40))


@st.composite
def requests(draw):
    req = generate_pb2.GenerateRequest(request_id=draw(st.text(max_size=8)), images=draw(images))
    kind = draw(st.sampled_from(["text", "chat", "none"]))
    if kind == "text":
        req.text = draw(texts)
    elif kind == "chat":
        for _ in range(draw(st.integers(0, 2))):
            msg = req.chat.messages.add(
                role=draw(st.sampled_from(["user", "assistant", "system", "robot", ""]))
            )
            for _ in range(draw(st.integers(0, 3))):
                if draw(st.booleans()):
                    msg.content.add(image=generate_pb2.ImagePlaceholder())
                else:
                    msg.content.add(text=draw(texts))
    s = req.sampling
    if draw(st.booleans()):
        s.max_new_tokens = draw(st.integers(0, 5000) | st.integers(1, 4))
    else:
        s.max_new_tokens = draw(st.integers(1, 4))
    for name in ("temperature", "top_p"):
        if draw(st.booleans()):
            setattr(s, name, draw(floats))
    if draw(st.booleans()):
        s.top_k = draw(st.integers(0, 2**32 - 1))
    if draw(st.booleans()):
        s.seed = draw(st.integers(0, 2**64 - 1))
    s.stop.extend(draw(st.lists(st.text(max_size=5), max_size=3)))
    c = req.compression
    c.policy = draw(st.sampled_from(["", "vlcache", "h2o", "snapkv", "full", "random", "nope"]))
    if draw(st.booleans()):
        c.budget = draw(floats)
    if draw(st.booleans()):
        c.threshold = draw(floats)
    c.allocator = draw(st.sampled_from(["", "cake", "pyramid", "sparsity", "uniform", "x"]))
    c.exact_budget = draw(st.booleans())
    return req


def test_fuzz_public_api(cluster):
    free = cluster.pool.num_free
    seen: dict[str, int] = {}

    @settings(max_examples=1000, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(requests())
    def one(req):
        try:
            generate(cluster.stub, req, timeout=60)
            seen["OK"] = seen.get("OK", 0) + 1
        except grpc.RpcError as exc:
            assert exc.code() in DEFINED, (exc.code(), exc.details())
            assert exc.details()
            seen[exc.code().name] = seen.get(exc.code().name, 0) + 1

    one()
    print("fuzz outcomes:", seen)
    assert sum(seen.values()) >= 1000 and seen.get("OK", 0) > 0
    assert cluster.pool.num_free == free
    good = generate_pb2.GenerateRequest(
        text="USER : <image> what colour is the square ? ASSISTANT :", images=[PNG]
    )
    good.sampling.max_new_tokens = 3
    assert generate(cluster.stub, good, timeout=30).finished is not None
