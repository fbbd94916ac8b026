"""Compact-KV wire format: bit-exact round trips, every corruption's status code, pool balance. (Over real gRPC:
tests/integration/test_kv_wire_grpc.py.)"""

from __future__ import annotations

import types

import grpc
import numpy as np
import pytest
import torch
from google_crc32c import python as crc32c_python
from kv_wire_helpers import DTYPES, FP, FakePool, bits_equal, encode, feed_all, make_ckv
from vlkv.common.handoff import codec as kv_wire_codec
from vlkv.common.handoff.codec import CRC32C_IMPLEMENTATION, crc32c, parse_data_wire
from vlkv.common.handoff.wire import (
    KVWireError,
    encode_header,
    encode_stream,
)
from vlkv.common.model.spec import ModelSpec, model_fingerprint
from vlkv.v1 import kv_pb2

IA, DL, FPC = (
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.DATA_LOSS,
    grpc.StatusCode.FAILED_PRECONDITION,
)


def expect(code, pool: FakePool, ckv, chunks, *, allocs: int = 1, **kw) -> None:
    """The stream fails with ``code``; the pool saw ``allocs`` allocations, each released once."""
    with pytest.raises(KVWireError) as exc:
        feed_all(pool, ckv, chunks, **kw)
    assert exc.value.code == code, exc.value
    assert (pool.allocs, pool.releases, pool.free) == (allocs, allocs, pool.total)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("chunk_bytes", [1, 7, 100, 1 << 20])
def test_round_trip_bit_exact(dtype, chunk_bytes):
    ckv = make_ckv(dtype, [1, 2, 3, 5, 8, 13], m=13)
    chunks = encode(ckv, chunk_bytes)
    assert all(len(c.data.data) <= chunk_bytes for c in chunks if c.HasField("data"))
    pool = FakePool()
    header, out = feed_all(pool, ckv, chunks)
    assert (pool.allocs, pool.releases) == (1, 0)
    assert all(bits_equal(a, b) for a, b in zip(out.keys + out.values, ckv.keys + ckv.values, strict=True))
    assert (out.prompt_length, out.first_token, out.layer_lengths) == (13, 7, [1, 2, 3, 5, 8, 13])
    assert header.policy == "vlcache" and list(header.eos_token_ids) == [2, 3]
    assert header.sampling.max_new_tokens == 5 and header.request_id == "req-1"


def test_round_trip_special_values_bf16():
    ckv = make_ckv(torch.bfloat16, [4])
    ckv.keys[0].view(-1)[:4] = torch.tensor([float("nan"), float("inf"), -0.0, 1e-40])
    _, out = feed_all(FakePool(), ckv, encode(ckv, 5))
    assert bits_equal(out.keys[0], ckv.keys[0])


def test_chunks_split_layers_unevenly():
    ckv = make_ckv(torch.float16, [3])  # 2*3*8*2 = 96 bytes per tensor
    data = [c.data for c in encode(ckv, 40) if c.HasField("data")]
    assert [(d.tensor, d.offset, len(d.data)) for d in data] == [
        (0, 0, 40), (0, 40, 40), (0, 80, 16), (1, 0, 40), (1, 40, 40), (1, 80, 16),
    ]  # fmt: skip
    assert all(crc32c(d.data) == d.crc32c for d in data)


def test_crc32c_is_castagnoli_in_hardware_on_any_buffer():
    assert CRC32C_IMPLEMENTATION == "c"  # the wheel's C extension, not the pure-Python fallback
    vectors = {  # RFC 3720 B.4 and the usual check value
        b"123456789": 0xE3069283,
        bytes(32): 0x8A9136AA,
        b"\xff" * 32: 0x62A8AB43,
        bytes(range(32)): 0x46DD794E,
        b"": 0,
    }
    for data, want in vectors.items():
        assert crc32c(data) == want
        assert crc32c(bytearray(data)) == crc32c(memoryview(data)) == want
        assert crc32c_python.value(data) == want  # the fallback agrees
    blob = bytes(range(256)) * 8
    arr = np.frombuffer(blob, dtype=np.uint8)
    for lo, hi in [(0, 2048), (3, 1001), (1000, 1000), (7, 8)]:  # unaligned slices, zero-copy views
        assert crc32c(memoryview(blob)[lo:hi]) == crc32c(arr[lo:hi]) == crc32c(blob[lo:hi])
    t = torch.arange(100, dtype=torch.bfloat16)
    assert crc32c(memoryview(t.view(torch.uint8).numpy())) == crc32c(t.view(torch.uint8).numpy().tobytes())


@pytest.fixture
def case():
    ckv = make_ckv(torch.float16, [2, 3, 4], m=4)
    return FakePool(), ckv, encode(ckv, 20)


@pytest.mark.parametrize("dtype", DTYPES)
def test_wire_encoding_is_protobufs_and_feed_wire_round_trips(dtype):
    ckv = make_ckv(dtype, [1, 4, 9], m=9)
    header = encode(ckv)[0]
    layers = list(zip(ckv.keys, ckv.values, strict=True))
    msgs = list(encode_stream(header, layers, 50))
    wire = list(encode_stream(header, layers, 50, wire=True))
    assert wire == [m.SerializeToString() for m in msgs]
    assert all(parse_data_wire(w) is not None for w, m in zip(wire, msgs, strict=True) if m.HasField("data"))
    pool = FakePool()
    asm = pool.assembler(ckv)
    for w in wire:
        asm.feed_wire(w)
    _, out = asm.finish()
    assert all(bits_equal(a, b) for a, b in zip(out.keys + out.values, ckv.keys + ckv.values, strict=True))


def _address_range(raw: bytes) -> range:
    start = np.frombuffer(raw, dtype=np.uint8).ctypes.data
    return range(start, start + len(raw))


def test_whole_tensor_chunks_are_views_of_received_bytes_and_reused_buffers_are_copied():
    ckv = make_ckv(torch.bfloat16, [2, 5, 9], m=9)  # layer 2: 288-byte tensors, split by 200-byte chunks
    layers = list(zip(ckv.keys, ckv.values, strict=True))
    wire = list(encode_stream(encode(ckv)[0], layers, 200, wire=True))
    asm = FakePool().assembler(ckv)
    for w in wire:
        asm.feed_wire(w)
    _, out = asm.finish()
    spans = [_address_range(w) for w in wire]
    shared = [any(t.data_ptr() in r for r in spans) for t in out.keys + out.values]
    assert shared == [True, True, False, True, True, False]  # layers 0-1 whole in one chunk: no copy
    assert all(bits_equal(a, b) for a, b in zip(out.keys + out.values, ckv.keys + ckv.values, strict=True))

    buf = bytearray(1 << 12)  # a receive buffer the caller reuses (the benchmark's TCP path does)
    asm = FakePool().assembler(ckv)
    for w in wire:
        buf[: len(w)] = w
        asm.feed_wire(memoryview(buf)[: len(w)])
    buf[:] = bytes(len(buf))
    _, out = asm.finish()
    assert all(bits_equal(a, b) for a, b in zip(out.keys + out.values, ckv.keys + ckv.values, strict=True))


def test_wire_zero_crc_is_omitted_like_protobuf(monkeypatch):
    monkeypatch.setattr(kv_wire_codec, "crc32c", lambda _: 0)
    raw = kv_wire_codec.encode_data_wire(0, 0, 0, memoryview(b"abc"))
    assert raw == kv_pb2.KVChunk(data=kv_pb2.KVData(data=b"abc")).SerializeToString()
    assert parse_data_wire(raw)[4] == 0 and bytes(parse_data_wire(raw)[3]) == b"abc"


def test_unparsable_bytes_are_data_loss(case):
    pool, ckv, chunks = case
    asm = pool.assembler(ckv)
    asm.feed_wire(chunks[0].SerializeToString())
    with pytest.raises(KVWireError) as exc:
        asm.feed_wire(chunks[1].SerializeToString()[:-3])
    assert exc.value.code == DL and (pool.allocs, pool.releases) == (1, 1)


# --- corruption -> status code, pool balanced ---------------------------------------------------
def test_truncated_stream(case):
    pool, ckv, chunks = case
    expect(DL, pool, ckv, chunks[:-1])  # no trailer
    expect(DL, pool, ckv, chunks[: len(chunks) // 2], allocs=2)
    expect(DL, FakePool(), ckv, [], allocs=0)  # nothing at all


def test_flipped_byte_in_chunk(case):
    pool, ckv, chunks = case
    data = bytearray(chunks[3].data.data)
    data[5] ^= 0x10
    chunks[3].data.data = bytes(data)
    expect(DL, pool, ckv, chunks)


def test_missing_layer(case):
    pool, ckv, chunks = case
    kept = [c for c in chunks if not (c.HasField("data") and c.data.layer == 1)]
    expect(DL, pool, ckv, kept)  # trailer totals disagree
    sent = [c.data for c in kept if c.HasField("data")]
    kept[-1].trailer.num_chunks, kept[-1].trailer.total_bytes = len(sent), sum(len(d.data) for d in sent)
    expect(DL, pool, ckv, kept, allocs=2)  # consistent trailer, but layer 1 never arrived


def test_header_claims_more_bytes_than_arrive(case):
    pool, ckv, chunks = case
    chunks[0].header.layer_lengths[0] += 1
    expect(DL, pool, ckv, chunks)


@pytest.mark.parametrize(
    "mutate",
    [
        lambda h: setattr(h, "format_version", 2),
        lambda h: setattr(h, "dtype", "int8"),
        lambda h: setattr(h, "num_layers", 10**6),
        lambda h: h.layer_lengths.append(1),
        lambda h: h.layer_lengths.__setitem__(0, 0),
        lambda h: h.layer_lengths.__setitem__(0, 5),  # > prompt_length
        lambda h: setattr(h, "prompt_length", 0),
        lambda h: setattr(h, "head_dim", 0),
        lambda h: h.eos_token_ids.extend(range(1 << 15)),  # header bytes over the limit
        lambda h: setattr(h, "num_kv_heads", 1 << 30),  # announces absurd bytes
    ],
)
def test_insane_or_oversized_header(case, mutate):
    pool, ckv, chunks = case
    mutate(chunks[0].header)
    expect(IA, pool, ckv, chunks, allocs=0)


def test_total_bytes_limit(case):
    pool, ckv, chunks = case
    expect(IA, pool, ckv, chunks, allocs=0, max_total_bytes=ckv.nbytes - 1)
    _, out = feed_all(pool, ckv, chunks, max_total_bytes=ckv.nbytes)


@pytest.mark.parametrize(
    "layout",
    [(3, 2, 8, torch.bfloat16), (3, 2, 8, "float32"), (4, 2, 8, torch.float16), (3, 1, 8, torch.float16)],
)
def test_wrong_layout_or_dtype_refused_before_allocation(case, layout):
    pool, ckv, chunks = case
    expect(FPC, pool, layout, chunks, allocs=0)


def test_wrong_fingerprint_refused_before_allocation(case):
    pool, ckv, chunks = case
    expect(FPC, pool, ckv, chunks, allocs=0, fingerprint="ffffffffffffffff")


def _data(layer=0, tensor=0, offset=0, data=b"x" * 4, crc=None) -> kv_pb2.KVChunk:
    crc = crc32c(data) if crc is None else crc
    return kv_pb2.KVChunk(
        data=kv_pb2.KVData(layer=layer, tensor=tensor, offset=offset, data=data, crc32c=crc)
    )


@pytest.mark.parametrize(
    "edit, code",
    [
        (lambda c: c[1:], IA),  # data before header
        (lambda c: c[:2] + [c[0]] + c[2:], IA),  # second header
        (lambda c: c[:2] + [kv_pb2.KVChunk()] + c[2:], IA),  # empty chunk
        (lambda c: c + [c[1]], IA),  # after trailer
        (lambda c: c[:1] + [_data(layer=3)] + c[1:], IA),  # unknown layer
        (lambda c: c[:1] + [_data(tensor=5)] + c[1:], IA),  # unknown tensor kind
        (lambda c: c[:1] + [_data(data=b"")] + c[1:], IA),  # empty data chunk
        (lambda c: c[:1] + [_data(offset=4)] + c[1:], IA),  # gap
        (lambda c: c[:2] + [c[1]] + c[2:], IA),  # duplicate: overlap
        (lambda c: c[:1] + [_data(data=b"y" * 65)] + c[1:], IA),  # past the end (layer 0: 64 bytes)
        (lambda c: c[:1] + [_data(crc=1)] + c[1:], DL),  # CRC checked first
        (lambda c: c[:-1] + [kv_pb2.KVChunk(trailer=kv_pb2.KVTrailer(num_chunks=1))], DL),
    ],
)
def test_protocol_violations(case, edit, code):
    pool, ckv, chunks = case
    expect(code, pool, ckv, edit(chunks), allocs=0 if edit(chunks)[0].HasField("data") else 1)


def test_trailer_total_bytes_mismatch(case):
    pool, ckv, chunks = case
    chunks[-1].trailer.total_bytes += 1
    expect(DL, pool, ckv, chunks)


def test_abort_feed_after_failure_and_reuse(case):
    pool, ckv, chunks = case
    asm = pool.assembler(ckv)
    asm.feed(chunks[0])
    asm.abort()
    asm.abort()
    with pytest.raises(KVWireError) as exc:
        asm.feed(chunks[1])
    assert exc.value.code == grpc.StatusCode.CANCELLED
    with pytest.raises(KVWireError):
        asm.finish()
    assert (pool.allocs, pool.releases, pool.free) == (1, 1, pool.total)
    # the worker keeps serving: the next transfer succeeds and keeps its blocks until decode ends
    with pool.assembler(ckv) as asm2:
        for c in chunks:
            asm2.feed(c)
        asm2.finish()
    assert (pool.allocs, pool.releases, pool.free) == (2, 1, pool.total - 3)
    pool.release(asm2.handle)


def test_allocate_refusal_propagates_without_release(case):
    _, ckv, chunks = case
    pool = FakePool(blocks=2)
    expect(grpc.StatusCode.RESOURCE_EXHAUSTED, pool, ckv, chunks, allocs=0)


def test_encode_stream_checks_layers():
    ckv = make_ckv(torch.float32, [2, 3])
    header = encode_header(
        request_id="r", fingerprint=FP, dtype="float32", num_kv_heads=2, head_dim=8,
        layer_lengths=[2, 3], prompt_length=3,
    )  # fmt: skip
    with pytest.raises(ValueError):
        list(encode_stream(header, [(ckv.keys[0], ckv.values[0])]))
    with pytest.raises(ValueError):
        list(encode_stream(header, [(ckv.keys[1], ckv.values[1])] * 2))


def test_model_fingerprint():
    def model(layers=2, dtype=torch.float32, seed=0):
        torch.manual_seed(seed)
        m = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(layers)]).to(dtype)
        m.config = types.SimpleNamespace(
            model_type="llama", num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, hidden_size=64,
            vocab_size=100,
        )  # fmt: skip
        return m

    base = model()
    fp = model_fingerprint(base)
    assert fp == model_fingerprint(model()) and len(fp) == 16
    assert ModelSpec.from_model(base).kv_layout == (2, 2, 16, torch.float32)
    with torch.no_grad():
        base[1].bias[-1] += 1.0
    assert model_fingerprint(base) != fp
    assert len({fp, model_fingerprint(model(layers=3)), model_fingerprint(model(dtype=torch.bfloat16))}) == 3


def test_pool_blocks_write_the_same_through_numpy_and_torch():
    """``PoolBlocks`` copies with NumPy on a CPU pool and with torch on a GPU one: both place every row
    (heads, partial first and last blocks, whole blocks) in the same slots."""
    from vlkv.decode_worker.grpc_receiver import PoolBlocks
    from vlkv.decode_worker.kv_cache import KVCache

    caches = [KVCache(16, 4, num_kv_heads=2, head_dim=3) for _ in range(2)]
    table = [9, 2, 7, 5]
    src = torch.randn(2, 13, 3)  # [H, k, D]
    rows = src.reshape(26, 3).view(torch.uint8).view(26, 12)
    for cache, torch_path in zip(caches, (False, True), strict=True):
        pool = PoolBlocks(cache)
        if torch_path:
            pool.cpu = False
            pool.tensors = [pool._blocks(t) for t in (cache.k, cache.v, None, cache.v_scale)]
        ids = torch.tensor(table) if torch_path else np.asarray(table)
        for first, n in ((0, 5), (5, 11), (16, 10)):  # cuts inside a head and across heads
            part = rows[first : first + n]
            pool.write(0, ids, 13, first, part if torch_path else part.numpy())
        assert torch.equal(cache.read(table, 13)[0], src)
    assert torch.equal(caches[0].k, caches[1].k)
