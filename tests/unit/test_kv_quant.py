"""int8 compact caches (``--kv-dtype int8``, ``common/handoff/quantize.py``): quantization error bounds, the
int8 paged decode kernel against its reference (under ``TRITON_INTERPRET=1``) and against exact attention,
the pool's int8 storage, the wire format's scales (round trip, corruption, truncation, a worker of the
other dtype refusing), the per-token attention mass (Triton kernel vs reference). (The hand-off of an int8
cache between processes over NIXL and gRPC into a real int8 pool: tests/integration/test_kv_nixl.py.)
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import math  # noqa: E402

import grpc  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from kv_assembler import KVAssembler  # noqa: E402
from kv_quant_cases import LAYOUT, LENGTHS, D, H, exact, float_cache, int8_case  # noqa: E402
from triton_interpret import kernel_module  # noqa: E402
from vlkv.common.handoff.compact_kv import CompactKV  # noqa: E402
from vlkv.common.handoff.quantize import (  # noqa: E402
    QMAX,
    dequantize_compact,
    dequantize_k,
    dequantize_v,
    quantize_compact,
    quantize_k,
    quantize_k_with,
    quantize_v,
)
from vlkv.common.handoff.wire import KVWireError, encode_compact_kv  # noqa: E402
from vlkv.decode_worker.kv_cache import KVCache, block_bytes_of  # noqa: E402
from vlkv.kernels.paged_decode_reference import paged_decode_reference  # noqa: E402
from vlkv.v1 import kv_pb2  # noqa: E402

P = 4  # block size


# -- quantization -----------------------------------------------------------------------------------------
def test_k_is_per_channel_and_v_per_token_within_half_a_step():
    g = torch.Generator().manual_seed(1)
    k = torch.randn(H, 50, D, generator=g) * torch.logspace(-2, 2, D)  # channels of very different range
    v = torch.randn(H, 50, D, generator=g) * torch.logspace(-2, 2, 50)[:, None]  # tokens likewise
    qk, sk = quantize_k(k)
    qv, sv = quantize_v(v)
    assert qk.dtype == qv.dtype == torch.int8 and sk.shape == (H, D) and sv.shape == (H, 50)
    # each channel (K) / token (V) is scaled to its own range: error at most half a step of its own scale
    err_k = (dequantize_k(qk, sk) - k).abs()
    assert (err_k <= sk.float()[:, None, :] * 0.5 + 1e-6).all()
    err_v = (dequantize_v(qv, sv) - v).abs()
    assert (err_v <= sv.float()[..., None] * 0.5 + 1e-6).all()
    assert qk.abs().amax(dim=1).eq(127).all()  # the full int8 range is used per channel
    # relative to each channel's range, the error is ~1/254: a per-tensor scale would lose small channels
    assert (err_k.amax(dim=1) / k.abs().amax(dim=1)).max() < 1 / 200


def test_appended_keys_reuse_the_prefill_scales_and_clamp():
    k = torch.randn(H, 10, D)
    qk, sk = quantize_k(k)
    new = torch.randn(H, D)
    new[0, 0] = 50 * float(sk[0, 0]) * QMAX  # far past the channel's prefill range
    q = quantize_k_with(new, sk)
    assert q[0, 0] == 127  # clamped, not wrapped
    inside = new.abs() <= sk.float() * QMAX
    assert ((q.float() * sk.float() - new).abs()[inside] <= sk.float()[inside] * 0.5 + 1e-6).all()


def test_all_zero_channels_and_tokens_quantize_to_zeros():
    qk, sk = quantize_k(torch.zeros(H, 3, D))
    qv, sv = quantize_v(torch.zeros(H, 3, D))
    assert not qk.any() and not qv.any() and torch.isfinite(sk).all() and (sk > 0).all()


def test_quantized_compact_cache_and_its_bytes():
    ckv = float_cache(dtype=torch.float16)
    q = quantize_compact(ckv, "int8")
    assert q.quantized and q.kv_dtype == "int8" and q.source_dtype == torch.float16
    assert quantize_compact(ckv, "fp16") is ckv and quantize_compact(q, "int8") is q
    assert q.full_nbytes == ckv.full_nbytes  # the full cache is counted in the model's dtype
    tokens = sum(LENGTHS)
    assert q.nbytes == 2 * H * D * tokens + 2 * (H * D * len(LENGTHS) + H * tokens)  # int8 + fp16 scales
    back = dequantize_compact(q)
    for a, b in zip(back.values, ckv.values, strict=True):
        assert a.dtype == torch.float16 and (a.float() - b.float()).abs().max() < 0.03
    with pytest.raises(ValueError):
        CompactKV(q.keys, q.values, prompt_length=12)  # int8 without scales


# -- the pool and the kernel -------------------------------------------------------------------------------
def test_int8_pool_counts_its_scales_and_round_trips():
    fp16 = block_bytes_of(16, 8, 128, torch.float16)
    int8 = block_bytes_of(16, 8, 128, torch.float16, "int8")
    assert int8 == 8 * (2 * 16 * 128 + 2 * (128 + 16)) and 1.85 < fp16 / int8 < 1.95
    cache = KVCache(12, P, H, D, torch.float32, kv_dtype="int8")
    assert cache.k.dtype == torch.int8 and cache.block_bytes == block_bytes_of(P, H, D, torch.float32, "int8")
    q = quantize_compact(float_cache(), "int8")
    table = [7, 2, 9]
    cache.write(table, q.keys[3], q.values[3], q.k_scales[3], q.v_scales[3])
    got = cache.read(table, 9)
    for a, b in zip(got, (q.keys[3], q.values[3], q.k_scales[3], q.v_scales[3]), strict=True):
        assert torch.equal(a, b)
    with pytest.raises(ValueError):
        cache.write(table, q.keys[3], q.values[3])  # an int8 pool needs the scales


@pytest.fixture(scope="module")
def kernels():
    yield from kernel_module("vlkv.kernels.paged_decode", "_split_kernel")


@pytest.mark.parametrize(
    "lengths,n_heads,n_kv,dim,page",
    [([1, 5, 17, 64], 4, 2, 16, 4), ([33, 2], 8, 8, 32, 16), ([130], 6, 2, 24, 16)],
)
def test_int8_kernel_matches_reference_and_exact_attention(kernels, lengths, n_heads, n_kv, dim, page):
    cache, table, lens, q, originals = int8_case(lengths, n_heads, n_kv, dim, page)
    scale = 1 / math.sqrt(dim)
    kw = dict(scale=scale, k_scale=cache.k_scale, v_scale=cache.v_scale)
    ref = paged_decode_reference(q, cache.k, cache.v, table, lens, **kw)
    tri = kernels.paged_decode_attention(
        q, cache.k, cache.v, table, lens, force_triton=True, block_n=16, **kw
    )
    torch.testing.assert_close(tri, ref, atol=2e-5, rtol=1e-4)
    # against attention over the unquantized K/V: the int8 error stays small
    assert (ref - exact(q, originals, scale)).abs().max() < 0.05
    # a float pool holding the dequantized tokens gives the same output (dequantization folded correctly)
    fk = cache.k.float() * cache.k_scale.float()[:, :, None, :]
    fv = cache.v.float() * cache.v_scale.float()[..., None]
    torch.testing.assert_close(paged_decode_reference(q, fk, fv, table, lens, scale=scale), ref)


@pytest.mark.parametrize("quant", [True, False])
def test_attention_mass_kernel_matches_reference_and_sums_to_the_heads(kernels, quant):
    cache, table, lens, q, _ = int8_case([5, 9, 2, 40], 4, 2, 16, 4)
    if quant:
        k, v, kw = cache.k, cache.v, dict(k_scale=cache.k_scale, v_scale=cache.v_scale)
    else:
        k = cache.k.float() * cache.k_scale.float()[:, :, None, :]
        v, kw = cache.v.float() * cache.v_scale.float()[..., None], {}
    width = table.shape[1] * 4
    ref_mass, tri_mass = torch.zeros(4, width), torch.full((4, width), 0.5)  # added to what is there
    ref = paged_decode_reference(q, k, v, table, lens, scale=0.25, mass_out=ref_mass, **kw)
    tri = kernels.paged_decode_attention(
        q, k, v, table, lens, scale=0.25, force_triton=True, block_n=16, num_splits=2, mass_out=tri_mass, **kw
    )
    torch.testing.assert_close(tri, ref, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(tri_mass - 0.5, ref_mass, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(ref_mass.sum(1), torch.full((4,), 4.0))  # each of the 4 query heads sums to 1
    for s, n in enumerate(lens.tolist()):
        assert not ref_mass[s, n:].any() and (ref_mass[s, :n] > 0).all()


def test_int8_pool_without_scales_is_refused():
    cache, table, lens, q, _ = int8_case([5], 2, 2, 16, 4)
    with pytest.raises(TypeError, match="scale"):
        paged_decode_reference(q, cache.k, cache.v, table, lens, scale=0.25)


# -- the wire -----------------------------------------------------------------------------------------------
def assemble(chunks, kv_dtype="int8", wire=False):
    a = KVAssembler("fp", LAYOUT, expected_kv_dtype=kv_dtype)
    for c in chunks:
        a.feed_wire(c) if wire else a.feed(c)
    return a.finish()


@pytest.mark.parametrize("wire", [False, True])
def test_int8_wire_round_trip_is_bit_exact(wire):
    q = quantize_compact(float_cache(), "int8")
    chunks = list(encode_compact_kv(q, request_id="r", fingerprint="fp", chunk_bytes=16, wire=wire))
    header, got = assemble(chunks, wire=wire)
    assert header.kv_dtype == "int8" and header.dtype == "float32" and got.quantized
    assert got.source_dtype == torch.float32 and got.nbytes == q.nbytes
    for name in ("keys", "values", "k_scales", "v_scales"):
        for a, b in zip(getattr(got, name), getattr(q, name), strict=True):
            assert torch.equal(a, b)
    fp16_bytes = sum(
        len(c.data.data) for c in encode_compact_kv(float_cache(), request_id="r", fingerprint="fp")
    )
    assert q.nbytes < 0.35 * fp16_bytes  # int8 + scales vs fp32 (scales weigh much at D=16)


def _chunks():
    q = quantize_compact(float_cache(), "int8")
    return list(encode_compact_kv(q, request_id="r", fingerprint="fp", chunk_bytes=8))


def test_corrupt_scales_are_data_loss():
    chunks = _chunks()
    i = next(i for i, c in enumerate(chunks) if c.WhichOneof("part") == "data" and c.data.tensor == 3)
    bad = kv_pb2.KVChunk()
    bad.CopyFrom(chunks[i])
    data = bytearray(bad.data.data)
    data[0] ^= 0x40
    bad.data.data = bytes(data)
    chunks[i] = bad
    with pytest.raises(KVWireError) as err:
        assemble(chunks)
    assert err.value.code == grpc.StatusCode.DATA_LOSS and "CRC" in err.value.message


def test_truncated_scales_are_data_loss():
    chunks = _chunks()
    last_scale = max(i for i, c in enumerate(chunks) if c.WhichOneof("part") == "data" and c.data.tensor == 2)
    del chunks[last_scale]  # a K-scale piece never arrives; the trailer's totals disagree
    with pytest.raises(KVWireError) as err:
        assemble(chunks)
    assert err.value.code == grpc.StatusCode.DATA_LOSS


def test_a_worker_of_the_other_kv_dtype_refuses_with_failed_precondition():
    q = quantize_compact(float_cache(), "int8")
    with pytest.raises(KVWireError) as err:
        assemble(encode_compact_kv(q, request_id="r", fingerprint="fp"), kv_dtype="fp16")
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION and "--kv-dtype" in err.value.message
    with pytest.raises(KVWireError) as err:
        assemble(encode_compact_kv(float_cache(), request_id="r", fingerprint="fp"), kv_dtype="int8")
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION and "'fp16'" in err.value.message
