"""Property-based fuzz of KVAssembler: mutated and random chunk sequences (as messages, or as serialized
bytes with byte-level damage through ``feed_wire``) only ever raise KVWireError, finish quickly, and
leave the fake pool balanced (every allocation released unless the transfer succeeded, never twice).
The zero-copy wire parser must agree with protobuf on every message it accepts."""

from __future__ import annotations

import time

import pytest
import torch
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from kv_wire_helpers import FakePool, bits_equal, encode, make_ckv
from vlkv.common.handoff.codec import parse_data_wire
from vlkv.common.handoff.wire import KVWireError
from vlkv.v1 import kv_pb2

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
BIG = st.integers(0, 2**32 - 1)
FIELDS = {
    "data": ["layer", "tensor", "offset", "crc32c"],
    "header": ["format_version", "num_layers", "num_kv_heads", "head_dim", "prompt_length"],
    "trailer": ["num_chunks", "total_bytes"],
}


def _mutate(chunks: list[kv_pb2.KVChunk], op: str, draw) -> None:
    """Apply one mutation in place (chunks are fresh copies)."""
    if not chunks and op not in ("insert", "random"):
        return
    i = draw(st.integers(0, max(0, len(chunks) - 1)))
    if op == "drop":
        del chunks[i]
    elif op == "dup":
        chunks.insert(draw(st.integers(0, len(chunks))), chunks[i])
    elif op == "swap":
        j = draw(st.integers(0, len(chunks) - 1))
        chunks[i], chunks[j] = chunks[j], chunks[i]
    elif op == "truncate":
        del chunks[i:]
    elif op == "field":
        part = chunks[i].WhichOneof("part")
        if part is not None:
            name = draw(st.sampled_from(FIELDS[part]))
            limit = {"offset": 2**64 - 1, "total_bytes": 2**64 - 1, "tensor": 2**31 - 1}.get(name, 2**32 - 1)
            setattr(getattr(chunks[i], part), name, draw(st.integers(0, limit) | st.integers(0, 70)))
    elif op == "lengths" and chunks[i].HasField("header"):
        lengths = chunks[i].header.layer_lengths
        del lengths[:]
        lengths.extend(draw(st.lists(BIG | st.integers(0, 20), max_size=6)))
    elif op == "payload" and chunks[i].HasField("data"):
        payload = bytearray(chunks[i].data.data)
        if payload:
            payload[draw(st.integers(0, len(payload) - 1))] ^= draw(st.integers(1, 255))
        payload += draw(st.binary(max_size=3))
        chunks[i].data.data = bytes(payload)
    elif op == "wire":  # flip a byte of the serialized message; unparsable ones never reach us
        raw = bytearray(chunks[i].SerializeToString())
        if raw:
            raw[draw(st.integers(0, len(raw) - 1))] ^= draw(st.integers(1, 255))
            try:
                chunks[i] = kv_pb2.KVChunk.FromString(bytes(raw))
            except DecodeError:
                pass
    elif op in ("insert", "random"):
        blob = draw(st.binary(max_size=64))
        try:
            chunks.insert(draw(st.integers(0, len(chunks))), kv_pb2.KVChunk.FromString(blob))
        except DecodeError:
            pass


@st.composite
def streams(draw):
    dtype = draw(st.sampled_from(DTYPES))
    lengths = draw(st.lists(st.integers(1, 6), min_size=1, max_size=4))
    ckv = make_ckv(dtype, lengths, m=max(lengths) + draw(st.integers(0, 2)), seed=draw(st.integers(0, 9)))
    chunks = encode(ckv, chunk_bytes=draw(st.sampled_from([1, 5, 16, 64, 1 << 20])))
    ops = draw(
        st.lists(
            st.sampled_from(
                ["drop", "dup", "swap", "truncate", "field", "lengths", "payload", "wire", "insert", "random"]
            ),
            max_size=4,
        )
    )
    mutated = [kv_pb2.KVChunk.FromString(c.SerializeToString()) for c in chunks]
    for op in ops:
        _mutate(mutated, op, draw)
    if not draw(st.booleans()):
        return ckv, chunks, mutated
    raw = [c.SerializeToString() for c in mutated]  # feed_wire path, with byte-level damage
    for _ in range(draw(st.integers(0, 2))):
        if raw:
            raw[draw(st.integers(0, len(raw) - 1))] = draw(_damaged(raw[draw(st.integers(0, len(raw) - 1))]))
    return ckv, [c.SerializeToString() for c in chunks], raw


def _damaged(blob: bytes) -> st.SearchStrategy[bytes]:
    """``blob`` with a byte flipped, cut short, or extended."""
    if not blob:
        return st.binary(max_size=8)
    flip = st.tuples(st.integers(0, len(blob) - 1), st.integers(1, 255)).map(
        lambda t: blob[: t[0]] + bytes([blob[t[0]] ^ t[1]]) + blob[t[0] + 1 :]
    )
    return flip | st.integers(0, len(blob)).map(lambda n: blob[:n]) | st.binary(max_size=8).map(blob.__add__)


@pytest.mark.timeout(180)
@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(streams())
def test_assembler_survives_arbitrary_streams(case):
    ckv, original, chunks = case
    pool = FakePool(blocks=10_000)
    asm = pool.assembler(ckv, max_total_bytes=1 << 20)
    start = time.monotonic()
    ok, outcome = False, "ok"
    try:
        for c in chunks:
            asm.feed_wire(c) if isinstance(c, bytes) else asm.feed(c)
        header, out = asm.finish()
        ok = True
    except KVWireError as err:
        outcome = err.code.name
        assert outcome in ("INVALID_ARGUMENT", "DATA_LOSS", "FAILED_PRECONDITION"), err
    event(outcome)
    asm.abort()  # no-op after success or failure; must never release twice
    assert time.monotonic() - start < 2.0
    assert pool.allocs == pool.releases + ok
    assert pool.free == pool.total - (len(ckv.keys) if ok else 0)
    if ok:
        assert out.layer_lengths == list(header.layer_lengths)
        assert all(k.dtype == ckv.dtype and k.shape[0] == ckv.num_kv_heads for k in out.keys)
    if chunks == original:
        assert ok and all(bits_equal(a, b) for a, b in zip(out.keys, ckv.keys, strict=True))


# Every message kind (header, data at offset 0 and later, both tensors, layer > 0, trailer) of a few caches.
WIRE_SAMPLES = [
    c.SerializeToString()
    for i, dtype in enumerate(DTYPES)
    for c in encode(make_ckv(dtype, [1, 3], seed=i), chunk_bytes=(3, 64, 1 << 20)[i])
]


@st.composite
def wire_messages(draw) -> bytes:
    blob = draw(st.sampled_from(WIRE_SAMPLES))
    for _ in range(draw(st.integers(0, 3))):
        blob = draw(_damaged(blob))
    return blob


@settings(max_examples=1000, deadline=None)
@given(wire_messages())
def test_wire_parser_agrees_with_protobuf(blob):
    fields = parse_data_wire(blob)
    event("fast path" if fields is not None else "protobuf fallback")
    if fields is None:
        return
    chunk = kv_pb2.KVChunk.FromString(blob)  # whatever the fast path accepts, protobuf must parse
    assert chunk.WhichOneof("part") == "data"
    d = chunk.data
    assert (d.layer, d.tensor, d.offset, d.data, d.crc32c) == (*fields[:3], bytes(fields[3]), fields[4])
