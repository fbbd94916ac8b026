"""Property-based fuzz of the public API against a live gateway: 1,000 generated requests.

Every reply is a completed stream or a defined client-facing status (never UNKNOWN or INTERNAL), no KV block
leaks, and the server still answers a good request afterwards.
"""

from __future__ import annotations

import math
import random
import struct
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from inproc_cluster import InProcCluster
from sample_images import random_png
from vlkv.common.compression.allocators import allocator_names
from vlkv.common.compression.registry import POLICY_NAMES
from vlkv.common.config import ModelConfig, PoolConfig, ServerConfig
from vlkv.deploy.client import build_request, generate
from vlkv.v1 import generate_pb2

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


# -- the whole accepted range of every sampling and compression parameter -----------------------------------
def _f32(x: float) -> float:
    """``x`` as the float32 proto field carries it."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


TINY = 1.4e-45  # the smallest float32
BELOW_1 = float(np.nextafter(np.float32(1), np.float32(0)))
ABOVE_1 = float(np.nextafter(np.float32(1), np.float32(2)))
BELOW_100 = float(np.nextafter(np.float32(100), np.float32(0)))
ABOVE_100 = float(np.nextafter(np.float32(100), np.float32(200)))
STOP_WORDS = ["square", "red", "?", " ", "é", "the", "zzz", "x" * 256]


def _pick(rng: random.Random, edges: list, low: float, high: float, *, log: bool = False) -> float:
    """An edge value, or one drawn over [low, high] (log-uniform with ``log``)."""
    if rng.random() < 0.5:
        return rng.choice(edges)
    if log:
        return 10 ** rng.uniform(math.log10(low), math.log10(high))
    return rng.uniform(low, high)


def _case(rng: random.Random, vocab: int, context: int, prompt_tokens: int) -> tuple[dict, str | None]:
    """Sampling and compression parameters over their accepted ranges, edges weighted, and now and then
    one parameter just outside its range; returns the build_request kwargs and the bad parameter's name."""
    kw = dict(
        max_new_tokens=rng.choice([1, 1, 2, 3]),
        temperature=_f32(_pick(rng, [0.0, TINY, 1e-38, 1e-7, 1.0, BELOW_100, 100.0], TINY, 100.0, log=True)),
        top_p=_f32(_pick(rng, [TINY, 1e-38, 1e-7, 0.5, BELOW_1, 1.0], TINY, 1.0, log=True)),
        top_k=rng.choice([0, 1, 2, vocab - 1, vocab, vocab + 1, 1_000_000, rng.randint(0, 1_000_000)]),
        seed=rng.choice([0, 1, 2**63 - 1, 2**63, 2**64 - 1, rng.randint(0, 2**64 - 1)]),
        stop=rng.sample(STOP_WORDS, rng.randint(0, 3)),
        policy=rng.choice(POLICY_NAMES),
        allocator=rng.choice(["", *allocator_names()]),
        budget=_f32(_pick(rng, [TINY, 1e-38, 1e-7, 0.01, 0.1, 0.5, BELOW_1, 1.0], TINY, 1.0, log=True)),
        threshold=_f32(_pick(rng, [TINY, 1e-38, 1e-7, 0.01, 0.5, BELOW_1], TINY, BELOW_1, log=True)),
        exact_budget=rng.random() < 0.5,
    )
    if rng.random() < 0.004:  # the longest answer the context allows (a few: each decodes ~1,000 tokens)
        kw["max_new_tokens"] = context - prompt_tokens
    bad = None
    if rng.random() < 0.15:
        bad, value = rng.choice(
            [
                ("max_new_tokens", 0),
                ("max_new_tokens", context - prompt_tokens + 1),
                ("temperature", -TINY),
                ("temperature", ABOVE_100),
                ("temperature", float("nan")),
                ("temperature", float("inf")),
                ("top_p", 0.0),
                ("top_p", ABOVE_1),
                ("top_p", float("nan")),
                ("top_k", 1_000_001),
                ("stop", ["x" * 257]),
                ("stop", [""]),
                ("budget", 0.0),
                ("budget", ABOVE_1),
                ("budget", float("-inf")),
                ("threshold", 0.0),
                ("threshold", 1.0),
                ("threshold", float("nan")),
                ("policy", "nope"),
                ("allocator", "nope"),
            ]
        )
        kw[bad] = value
    return kw, bad


@pytest.fixture(scope="module")
def roomy_cluster(tiny_model_dirs):
    """Room for 8 requests at a time, so an accepted request is never refused for room."""
    cfg = ServerConfig(
        model=ModelConfig(path=tiny_model_dirs("llava-gqa")), pool=PoolConfig(pool_bytes=16 << 20)
    )
    c = InProcCluster(cfg)
    yield c
    c.close()


def test_fuzz_sampling_and_compression_over_their_accepted_ranges(roomy_cluster):
    """1,000 requests (8 at a time) with every sampling and compression parameter drawn over its whole
    accepted range, edges included (smallest float32 temperature, top_p and budget, top_k past the
    vocabulary, 64-bit seeds, the longest answer the context allows), 15% with one parameter just outside:
    every accepted request completes with tokens from the vocabulary, every refused one is INVALID_ARGUMENT
    naming its parameter; no other code, no leaked block, and a good request is answered afterwards."""
    cluster = roomy_cluster
    spec = cluster.gateway.servicer.spec
    vocab, context = spec.vocab_size, spec.context
    image = random_png(5, size=24)
    prompt_tokens = generate(
        cluster.stub, build_request(images=[image], question="what ?", max_new_tokens=1), timeout=30
    ).finished.usage.prompt_tokens
    rng = random.Random(15)
    cases = [_case(rng, vocab, context, prompt_tokens) for _ in range(1000)]
    free = cluster.pool.num_free

    def run(case):
        kw, bad = case
        try:
            return (
                kw,
                bad,
                generate(cluster.stub, build_request(images=[image], question="what ?", **kw), 120),
            )
        except grpc.RpcError as exc:
            return kw, bad, exc

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(run, cases))
    outcomes: dict[str, int] = {}
    for kw, bad, out in results:
        if isinstance(out, grpc.RpcError):
            outcomes[out.code().name] = outcomes.get(out.code().name, 0) + 1
            assert bad is not None, (kw, out.code(), out.details())  # an accepted setting must be served
            assert out.code() == grpc.StatusCode.INVALID_ARGUMENT, (kw, out.code(), out.details())
            assert bad.rstrip("s") in out.details() or "compression" in out.details(), (bad, out.details())
        else:
            outcomes["OK"] = outcomes.get("OK", 0) + 1
            assert bad is None, (bad, kw)
            assert out.finished is not None and out.finished.usage.generated_tokens <= kw["max_new_tokens"]
            assert all(0 <= t < vocab for t in out.token_ids)
    print("accepted-range fuzz outcomes:", outcomes)
    assert outcomes.get("OK", 0) >= 800
    assert cluster.pool.num_free == free
    good = build_request(images=[PNG], question="what colour is the square ?", max_new_tokens=3)
    assert generate(cluster.stub, good, timeout=30).finished.usage.generated_tokens >= 1
