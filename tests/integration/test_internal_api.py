"""The internal API on real servers (issue 33): a caller holding the internal token still cannot make a
worker store or serve what it did not compute, and no PrefillRequest, however malformed, ends with anything
but a documented code.

The fuzz runs ``VLKV_INTERNAL_FUZZ_EXAMPLES`` generated requests (default 300, so CI stays quick; the
issue's 1,000+ run: ``VLKV_INTERNAL_FUZZ_EXAMPLES=1000 bash tests/run.sh -q tests/integration/test_internal_api.py``),
each a valid request with up to three of its fields broken (every field of PrefillRequest), sent straight
to the prefill worker with the internal token. Accepted ones are checked for consistency and their cache
claimed from the decode worker; afterwards the decode pool is full again and a good public request works.
"""

from __future__ import annotations

import math
import os
from collections import Counter

import grpc
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from inproc_cluster import InProcCluster
from sample_images import random_png
from vlkv.common.compression.allocators import allocator_names
from vlkv.common.compression.registry import POLICY_NAMES
from vlkv.common.config import Limits, ModelConfig, PoolConfig, ServerConfig
from vlkv.common.errors import Refusal, refusal_of
from vlkv.common.grpc_server import make_sync_channel
from vlkv.common.request import prepare_request, tensor_to_proto, to_prefill_proto
from vlkv.deploy.client import build_request, generate
from vlkv.v1 import worker_pb2, worker_pb2_grpc

EXAMPLES = int(os.environ.get("VLKV_INTERNAL_FUZZ_EXAMPLES", "300"))
Q = "what colour is the square ?"
# The codes a Prefill call may end with (README "Internal API"): its own data (INVALID_ARGUMENT), a decode
# address the worker may not dial (PERMISSION_DENIED), the decode pool's room (RESOURCE_EXHAUSTED) and a
# decode worker that cannot be reached (UNAVAILABLE with REFUSAL_HAND_OFF_FAILED).
DOCUMENTED = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}


@pytest.fixture(scope="module")
def cluster(tiny_model_dirs):
    cfg = ServerConfig(
        model=ModelConfig(path=tiny_model_dirs("llava-gqa")), pool=PoolConfig(pool_bytes=4 << 20)
    )
    c = InProcCluster(cfg)
    c.prefill_channel = make_sync_channel(c.prefill.address, cfg.security)
    c.decode_channel = make_sync_channel(c.decode.address, cfg.security)
    c.prefill_stub = worker_pb2_grpc.PrefillWorkerStub(c.prefill_channel)
    c.decode_stub = worker_pb2_grpc.DecodeWorkerStub(c.decode_channel)
    yield c
    c.prefill_channel.close()
    c.decode_channel.close()
    c.close()


def _prepared(cluster, images: list[bytes], question: str = Q, max_new_tokens: int = 3, rid: str = "r"):
    pb = build_request(images=images, question=question, max_new_tokens=max_new_tokens)
    req = prepare_request(pb, cluster.processor, cluster.gateway.servicer.spec, Limits(), default_seed=1)
    req.request_id = rid
    return req


def _claim(cluster, rid: str, usage: list | None = None) -> list[int]:
    """The tokens of a cache handed to the decode worker (claiming it frees its blocks when done); its
    final usage is appended to ``usage`` if given."""
    tokens = []
    request = worker_pb2.DecodeRequest(request_id=rid, wait_ms=30_000)
    for resp in cluster.decode_stub.Decode(request, timeout=60):
        if resp.HasField("token"):
            tokens.extend(resp.token.token_ids)
        elif usage is not None:
            usage.append(resp.finished.usage)
    return tokens


def _ask(cluster, image: bytes, reuse: str = "auto"):
    req = build_request(images=[image], question=Q, max_new_tokens=8)
    req.reuse.reuse = reuse
    return generate(cluster.stub, req, timeout=60)


def _load(cluster) -> worker_pb2.WorkerLoad:
    return cluster.prefill_stub.GetLoad(worker_pb2.LoadRequest(), timeout=10)


def test_a_forged_prefill_cannot_change_a_later_answer(cluster):
    """A Prefill with a valid token carrying image B's pixels under image A's hash (the poisoning of issue
    33): the worker keys what it stores on B's pixels, so a later public request for A is answered from A,
    and one for B from B."""
    image_a, image_b = random_png(101), random_png(202)
    want_a = _ask(cluster, image_a, reuse="off").token_ids  # neither reads nor fills the image cache
    want_b = _ask(cluster, image_b, reuse="off").token_ids
    assert want_a != want_b  # the two images answer differently, so a swap would show
    hash_a = _prepared(cluster, [image_a]).image_hashes
    forged = to_prefill_proto(
        _prepared(cluster, [image_b], max_new_tokens=8, rid="forged"), cluster.decode.address
    )
    del forged.image_hashes[:]
    forged.image_hashes.extend(hash_a)
    mismatches = _load(cluster).image_cache.hint_mismatches
    cluster.prefill_stub.Prefill(forged, timeout=60)
    assert _claim(cluster, "forged") == want_b
    assert _load(cluster).image_cache.hint_mismatches == mismatches + 1  # logged and counted
    later_a = _ask(cluster, image_a)
    a_usage = later_a.finished.usage
    assert later_a.token_ids == want_a  # nothing planted: neither cache holds B's K/V under A
    assert not a_usage.image_cache_hit and a_usage.cached_prompt_tokens == 0
    later_b = _ask(cluster, image_b)
    b_usage = later_b.finished.usage  # B's entry, from B (the same prompt: the prefix cache's blocks)
    assert later_b.token_ids == want_b and (b_usage.image_cache_hit or b_usage.cached_prompt_tokens > 0)
    assert _ask(cluster, image_a).token_ids == want_a  # and A's own entry, once it is there


# -- the fuzz -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bases(cluster):
    """Valid requests to break: one image, two images, text only."""
    return [
        to_prefill_proto(_prepared(cluster, imgs, question=q), cluster.decode.address)
        for imgs, q in (([random_png(7)], Q), ([random_png(8), random_png(9)], Q), ([], "what is a square ?"))
    ]


TEXT = st.one_of(st.text(max_size=12), st.sampled_from(["", "x" * 129, "x" * 65536]))
FLOATS = st.one_of(st.floats(width=32), st.sampled_from([0.0, 0.5, 1.0, -1.0]))
U32 = st.one_of(st.integers(0, 2**32 - 1), st.sampled_from([0, 1, 3, 16, 576]))
DTYPES = st.sampled_from(["float32", "float16", "bfloat16", "int64", "int32", "uint8", "object", ""])


def _mutations(cluster):
    vocab = cluster.gateway.servicer.spec.vocab_size
    image = cluster.gateway.servicer.spec.image_token_id
    ids = st.integers(0, vocab + 5)
    address = st.sampled_from(
        [cluster.decode.address, "", "192.0.2.1:50051", "localhost:1", "unix:/tmp/x", "x" * 300]
    )

    def one(data, pb: worker_pb2.PrefillRequest) -> str:
        """Break one field of ``pb`` (drawn from ``data``); the field's name."""
        draw = data.draw
        field = draw(
            st.sampled_from(
                [
                    "request_id",
                    "decode_address",
                    "input_ids",
                    "image_token",
                    "vision_spans",
                    "tensor",
                    "model_inputs",
                    "sampling",
                    "compression",
                    "image_hashes",
                    "reuse",
                ]
            )
        )
        if field == "request_id":
            pb.request_id = draw(TEXT)
        elif field == "decode_address":
            pb.decode_address = draw(address)
        elif field == "input_ids":
            new = draw(st.lists(ids, max_size=40)) if draw(st.booleans()) else list(pb.input_ids)
            if new and draw(st.booleans()):
                new[draw(st.integers(0, len(new) - 1))] = draw(st.sampled_from([vocab, vocab + 1, 2**32 - 1]))
            del pb.input_ids[:]
            pb.input_ids.extend(new)
        elif field == "image_token":  # one image token more or fewer, at the runs' edges or anywhere
            new = list(pb.input_ids)
            at = draw(st.integers(0, len(new)))
            if draw(st.booleans()) or image not in new:
                new.insert(at, image)
            else:
                new.remove(image)
            del pb.input_ids[:]
            pb.input_ids.extend(new)
        elif field == "vision_spans":
            spans = list(pb.vision_spans)
            kind = draw(st.sampled_from(["random", "shift", "overlap", "many", "drop"]))
            if kind == "random":
                spans = draw(st.lists(U32, max_size=8))
            elif kind == "shift":
                spans = [s + draw(st.integers(-2, 2)) % 7 for s in spans]
            elif kind == "overlap":
                spans = spans + spans
            elif kind == "many":
                spans = [0, 1] * draw(st.sampled_from([2, 1000, 100_000]))
            else:
                spans = spans[:-1]
            del pb.vision_spans[:]
            pb.vision_spans.extend(spans)
        elif field == "tensor" and pb.model_inputs:
            t = pb.model_inputs[draw(st.integers(0, len(pb.model_inputs) - 1))]
            part = draw(st.sampled_from(["dtype", "shape", "data", "name", "values"]))
            if part == "dtype":
                t.dtype = draw(DTYPES)
            elif part == "shape":
                shape = draw(
                    st.lists(st.one_of(st.integers(0, 64), st.sampled_from([2**64 - 1, 2**31])), max_size=9)
                )
                del t.shape[:]
                t.shape.extend(shape)
                if draw(st.booleans()):  # the bytes follow the announced shape where they can
                    n = math.prod(shape) * 4
                    t.data = b"\0" * n if n <= 1 << 22 else t.data
            elif part == "data":
                t.data = t.data[: draw(st.integers(0, len(t.data)))] + draw(st.binary(max_size=8))
            elif part == "name":
                t.name = draw(
                    st.sampled_from(["", "image_sizes", "attention_mask", "pixel_values", "x" * 100])
                )
            elif len(t.shape) >= 2 and max(t.shape) <= 4096 and math.prod(t.shape) <= 1 << 22:
                # finite or not, another number of images, 4 channels
                shape = list(t.shape)
                kind = draw(st.sampled_from(["nan", "images", "channels"]))
                if kind == "nan":
                    x = torch.full(shape, float(draw(st.sampled_from(["nan", "inf", "1e30"]))))
                elif kind == "images":
                    x = torch.randn(draw(st.sampled_from([0, 2, 9, 44])), *shape[1:])
                else:
                    x = torch.randn(shape[0], 4, *shape[2:])
                t.CopyFrom(tensor_to_proto(t.name, x))
        elif field == "model_inputs":
            kind = draw(st.sampled_from(["drop", "dup", "image_sizes", "many"]))
            if kind == "drop" and pb.model_inputs:
                del pb.model_inputs[0]
            elif kind == "dup" and pb.model_inputs:
                pb.model_inputs.add().CopyFrom(pb.model_inputs[0])
            elif kind == "image_sizes":
                sizes = torch.tensor([[draw(st.integers(0, 2**40)), draw(st.integers(0, 2**40))]])
                pb.model_inputs.add().CopyFrom(tensor_to_proto("image_sizes", sizes))
            else:
                for i in range(draw(st.integers(1, 12))):
                    pb.model_inputs.add(name=f"t{i}", dtype="int64", shape=[1], data=b"\0" * 8)
        elif field == "sampling":
            s = pb.sampling
            s.max_new_tokens = draw(st.sampled_from([0, 1, 3, 1025, 2**32 - 1]))
            s.temperature = draw(FLOATS)
            s.top_p = draw(FLOATS)
            s.top_k = draw(U32)
            s.seed = draw(st.integers(0, 2**64 - 1))
            del s.stop[:]
            s.stop.extend(draw(st.lists(TEXT, max_size=3)))
        elif field == "compression":
            c = pb.compression
            c.policy = draw(st.sampled_from([*POLICY_NAMES, "", "nope"]))
            c.budget = draw(FLOATS)
            c.threshold = draw(FLOATS)
            c.allocator = draw(st.sampled_from(["", *allocator_names(), "nope"]))
            c.exact_budget = draw(st.booleans())
        elif field == "image_hashes":
            del pb.image_hashes[:]
            pb.image_hashes.extend(draw(st.lists(TEXT, max_size=10)))
        elif field == "reuse":
            r = pb.reuse
            r.reuse = draw(st.sampled_from(["", "auto", "off", "on"]))
            r.mode = draw(st.sampled_from(["", "vlcache", "mpic", "none", "x"]))
            r.recompute_ratio = draw(FLOATS)
        return field

    return one


def _consistent(pb: worker_pb2.PrefillRequest, reply: worker_pb2.PrefillReply, image: int) -> bool:
    m = len(pb.input_ids)
    vision = sum(1 for i in pb.input_ids if i == image)
    return (
        reply.prompt_tokens == m
        and reply.vision_tokens == vision <= m
        and reply.post_vision_tokens <= m - vision
        and len(reply.layer_budgets) > 0
        and all(0 < k <= m for k in reply.layer_budgets)
    )


def test_fuzz_every_prefill_request_field(cluster, bases):
    free = cluster.pool.num_free
    image = cluster.gateway.servicer.spec.image_token_id
    mutate = _mutations(cluster)
    seen: Counter = Counter()
    fields: Counter = Counter()
    inconsistent = []
    counter = iter(range(10**9))

    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(st.data())
    def one(data):
        pb = worker_pb2.PrefillRequest()
        pb.CopyFrom(bases[data.draw(st.integers(0, len(bases) - 1))])
        pb.request_id = f"fuzz-{next(counter)}"
        for _ in range(data.draw(st.integers(1, 3))):
            fields[mutate(data, pb)] += 1
        try:
            reply = cluster.prefill_stub.Prefill(pb, timeout=60)
        except grpc.RpcError as exc:
            code = exc.code()
            hand_off = (
                code == grpc.StatusCode.UNAVAILABLE and refusal_of(exc) == Refusal.REFUSAL_HAND_OFF_FAILED
            )
            assert code in DOCUMENTED or hand_off, (code, exc.details())
            assert exc.details()
            seen[code.name] += 1
            return
        seen["OK"] += 1
        if not _consistent(pb, reply, image):
            inconsistent.append((list(pb.input_ids)[:20], reply))
        _claim(cluster, pb.request_id)

    one()
    print("internal fuzz outcomes:", dict(seen), "fields broken:", dict(fields))
    assert sum(seen.values()) >= EXAMPLES and seen["OK"] > 0 and seen["INVALID_ARGUMENT"] > 0
    assert not inconsistent, inconsistent[:3]
    assert seen["UNKNOWN"] == seen["INTERNAL"] == 0
    load = _load(cluster)
    assert load.running == load.waiting == 0
    assert cluster.pool.num_free == free  # every accepted cache was claimed and freed, none leaked
    assert _ask(cluster, random_png(3)).finished is not None  # and the workers still serve


# -- TransferKV: every field of the wire stream -----------------------------------------------------------
# What a TransferKV call may end with: a malformed or inconsistent stream (INVALID_ARGUMENT), bytes that do not
# match their checksum or count (DATA_LOSS), another model or layout (FAILED_PRECONDITION), no room
# (RESOURCE_EXHAUSTED), a request id already held (ALREADY_EXISTS), a newer transfer of it (ABORTED), a
# stream that stalls (DEADLINE_EXCEEDED).
TRANSFER_CODES = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.DATA_LOSS,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
}
U64 = st.one_of(st.integers(0, 2**64 - 1), st.sampled_from([0, 1, 4096, 2**32]))


def _break_stream(data, chunks: list) -> str:
    """Break one thing of a TransferKV stream (a header field, a data chunk, the trailer, the order)."""
    draw = data.draw
    headers = [c for c in chunks if c.WhichOneof("part") == "header"]
    datas = [c for c in chunks if c.WhichOneof("part") == "data"]
    trailers = [c for c in chunks if c.WhichOneof("part") == "trailer"]
    kind = draw(st.sampled_from(["header", "header", "data", "data", "trailer", "order"]))
    if kind == "header" and headers:
        h = headers[0].header
        name = draw(
            st.sampled_from(
                [
                    "format_version",
                    "request_id",
                    "model_fingerprint",
                    "dtype",
                    "num_layers",
                    "num_kv_heads",
                    "head_dim",
                    "layer_lengths",
                    "prompt_length",
                    "first_token_id",
                    "sampling",
                    "eos_token_ids",
                    "prompt_tokens",
                    "vision_tokens",
                    "policy",
                    "kv_dtype",
                    "prompt_scores",
                ]
            )
        )
        if name in ("request_id", "model_fingerprint", "policy"):
            setattr(h, name, draw(TEXT))
        elif name in ("dtype", "kv_dtype"):
            setattr(
                h, name, draw(st.sampled_from(["float32", "float16", "bfloat16", "int8", "fp8", "", "x"]))
            )
        elif name in ("layer_lengths", "eos_token_ids"):
            field = getattr(h, name)
            new = draw(st.lists(U32, max_size=6)) if draw(st.booleans()) else [*field, draw(U32)]
            del field[:]
            field.extend(new)
        elif name == "sampling":
            s = h.sampling
            s.max_new_tokens = draw(st.sampled_from([0, 1, 1025, 2**32 - 1]))
            s.temperature = draw(FLOATS)
            s.top_p = draw(FLOATS)
            s.top_k = draw(U32)
        elif name == "prompt_scores":
            del h.prompt_scores[:]
            h.prompt_scores.extend(draw(st.lists(st.binary(max_size=64), max_size=5)))
        else:
            setattr(h, name, draw(U32))
        return f"header.{name}"
    if kind == "data" and datas:
        d = datas[draw(st.integers(0, len(datas) - 1))].data
        name = draw(st.sampled_from(["layer", "tensor", "offset", "data", "crc32c"]))
        if name == "layer":
            d.layer = draw(U32)
        elif name == "tensor":
            d.tensor = draw(st.integers(0, 7))
        elif name == "offset":
            d.offset = draw(U64)
        elif name == "data":
            d.data = d.data[: draw(st.integers(0, len(d.data)))] + draw(st.binary(max_size=16))
        else:
            d.crc32c = draw(st.integers(0, 2**32 - 1))
        return f"data.{name}"
    if kind == "trailer" and trailers:
        t = trailers[0].trailer
        if draw(st.booleans()):
            t.num_chunks = draw(U32)
        else:
            t.total_bytes = draw(U64)
        return "trailer"
    op = draw(st.sampled_from(["drop", "duplicate", "swap", "empty"]))
    if op == "empty":
        chunks.clear()
    elif chunks:
        i = draw(st.integers(0, len(chunks) - 1))
        if op == "drop":
            del chunks[i]
        elif op == "duplicate":
            chunks.insert(i, chunks[i])
        else:
            j = draw(st.integers(0, len(chunks) - 1))
            chunks[i], chunks[j] = chunks[j], chunks[i]
    return f"order.{op}"


def test_fuzz_every_transfer_kv_field(cluster):
    from kv_streams import kv_stream
    from vlkv.v1 import kv_pb2

    free = cluster.pool.num_free
    transfer = cluster.decode_channel.stream_unary(
        "/vlkv.v1.DecodeWorker/TransferKV",
        request_serializer=kv_pb2.KVChunk.SerializeToString,
        response_deserializer=worker_pb2.TransferAck.FromString,
    )
    seen: Counter = Counter()
    fields: Counter = Counter()
    inconsistent = []
    counter = iter(range(10**9))

    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(st.data())
    def one(data):
        rid = f"kv-fuzz-{next(counter)}"
        chunks = [kv_pb2.KVChunk.FromString(c.SerializeToString()) for c in kv_stream(cluster, rid, m=20)]
        for _ in range(data.draw(st.integers(1, 3))):
            fields[_break_stream(data, chunks)] += 1
        try:
            transfer(iter(chunks), timeout=60)
        except grpc.RpcError as exc:
            assert exc.code() in TRANSFER_CODES, (exc.code(), exc.details())
            assert exc.details()
            seen[exc.code().name] += 1
            return
        seen["OK"] += 1
        header = next(c.header for c in chunks if c.WhichOneof("part") == "header")
        usage = []
        _claim(cluster, header.request_id, usage)  # decodes it; its blocks come back
        u = usage[0]
        m = header.prompt_length
        if not (u.vision_tokens <= u.prompt_tokens <= m and 0 < len(u.layer_budgets)):
            inconsistent.append(u)

    one()
    print("TransferKV fuzz outcomes:", dict(seen), "broken:", dict(fields))
    assert sum(seen.values()) >= EXAMPLES and seen["OK"] > 0
    assert seen["UNKNOWN"] == seen["INTERNAL"] == 0
    assert not inconsistent, inconsistent[:3]
    load = cluster.decode_stub.GetLoad(worker_pb2.LoadRequest(), timeout=10)
    assert cluster.pool.num_free == free and load.free_blocks == load.total_blocks
    assert _ask(cluster, random_png(4)).finished is not None
