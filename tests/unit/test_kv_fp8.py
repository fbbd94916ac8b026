"""fp8 compact caches (``--kv-dtype fp8``: E4M3 codes with KIVI's scales, ``common/handoff/quantize.py``): the
error bound of E4M3, the paged decode kernel's table decoding against its reference (under
``TRITON_INTERPRET=1``) and against exact attention, the attention mass, the wire (the format travels in the
header and a pool of the other 8-bit format refuses). (The served greedy tokens through the real workers:
tests/integration/test_e2e_kv_fp8.py.)
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import math  # noqa: E402

import grpc  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from kv_assembler import KVAssembler  # noqa: E402
from kv_quant_cases import LAYOUT, exact, float_cache, int8_case  # noqa: E402
from triton_interpret import kernel_module  # noqa: E402
from vlkv.common.handoff.quantize import (  # noqa: E402
    FP8_MAX,
    decode_codes,
    dequantize_compact,
    dequantize_k,
    dequantize_v,
    quantize_compact,
    quantize_k,
    quantize_k_with,
    quantize_v,
)
from vlkv.common.handoff.wire import KVWireError, encode_compact_kv  # noqa: E402
from vlkv.decode_worker.kv_cache import block_bytes_of  # noqa: E402
from vlkv.kernels.paged_decode_reference import fp8_table, paged_decode_reference  # noqa: E402

H, D = 2, 16


def test_e4m3_codes_within_half_a_relative_step_of_their_own_scale():
    g = torch.Generator().manual_seed(1)
    # ranges from 0.1 to 100 (below absmax 448 x 2^-14 the scale stops at its floor, MIN_SCALE)
    k = torch.randn(H, 50, D, generator=g) * torch.logspace(-1, 2, D)
    v = torch.randn(H, 50, D, generator=g) * torch.logspace(-1, 2, 50)[:, None]
    qk, sk = quantize_k(k, "fp8")
    qv, sv = quantize_v(v, "fp8")
    assert qk.dtype == qv.dtype == torch.int8 and sk.shape == (H, D) and sv.shape == (H, 50)
    # every channel's (K) / token's (V) largest value lands on E4M3's largest code
    assert decode_codes(qk, "fp8").abs().amax(dim=1).eq(FP8_MAX).all()
    assert decode_codes(qv, "fp8").abs().amax(dim=-1).eq(FP8_MAX).all()
    # 3 mantissa bits: half a step is 2^-4 of the value; below 2^-6 (subnormals) steps are 2^-9 of the scale
    for x, q, deq, scale in (
        (k, qk, dequantize_k(qk, sk, fmt="fp8"), sk.float()[:, None, :]),
        (v, qv, dequantize_v(qv, sv, fmt="fp8"), sv.float()[..., None]),
    ):
        assert ((deq - x).abs() <= x.abs() * 2**-4 + scale * 2**-10 + 1e-6).all()
        assert not torch.equal(q, quantize_k(k)[0] if q is qk else quantize_v(v)[0])  # not int8's bytes
    # the same values read as int8 steps would be wrong: the format decides how a byte decodes
    assert not torch.allclose(dequantize_k(qk, sk), k, atol=0.1, rtol=0.1)


def test_appended_keys_clamp_at_the_largest_code_and_the_table_decodes_every_byte():
    k = torch.tensor([[[1.0, -2.0]]])
    _, scale = quantize_k(k, "fp8")
    out = quantize_k_with(torch.tensor([[[5.0, -1.0]]]), scale[:, None, :].squeeze(1), "fp8")
    assert decode_codes(out, "fp8").tolist() == [[[FP8_MAX, -224.0]]]  # 5 clamps to 1's code; -1 = -2 / 2
    table = fp8_table()
    codes = torch.arange(-128, 128, dtype=torch.int8)
    finite = ~torch.isnan(decode_codes(codes, "fp8"))
    assert finite.sum() == 254  # the two NaN patterns
    torch.testing.assert_close(table[codes.long() & 255][finite], decode_codes(codes, "fp8")[finite])


def test_fp8_compact_cache_round_trips_the_wire_and_names_its_format():
    q = quantize_compact(float_cache(), "fp8")
    assert q.kv_dtype == q.qformat == "fp8" and q.dtype == torch.int8
    assert q.nbytes == quantize_compact(float_cache(), "int8").nbytes  # same bytes, different codes
    chunks = list(encode_compact_kv(q, request_id="r", fingerprint="fp", chunk_bytes=16))
    a = KVAssembler("fp", LAYOUT, expected_kv_dtype="fp8")
    for c in chunks:
        a.feed(c)
    header, got = a.finish()
    assert header.kv_dtype == "fp8" and got.kv_dtype == "fp8"
    for x, y in zip(dequantize_compact(got).keys, dequantize_compact(q).keys, strict=True):
        assert torch.equal(x, y)
    # within E4M3's error of the original
    for x, y in zip(dequantize_compact(got).values, float_cache().values, strict=True):
        assert (x - y).abs().max() < 0.1
    # an int8 pool refuses an fp8 cache (and the other way round): the bytes would decode wrong
    b = KVAssembler("fp", LAYOUT, expected_kv_dtype="int8")
    with pytest.raises(KVWireError) as e:
        for c in chunks:
            b.feed(c)
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION and "fp8" in e.value.message


@pytest.fixture(scope="module")
def kernels():
    yield from kernel_module("vlkv.kernels.paged_decode", "_split_kernel")


def fp8_case(lengths, n_heads, n_kv, dim, page):
    cache, *rest = int8_case(lengths, n_heads, n_kv, dim, page, kv_dtype="fp8")
    assert cache.block_bytes == block_bytes_of(page, n_kv, dim, torch.float32, "int8")  # same bytes as int8
    return (cache, *rest)


@pytest.mark.parametrize(
    "lengths,n_heads,n_kv,dim,page", [([1, 5, 17, 64], 4, 2, 16, 4), ([130], 6, 2, 24, 16)]
)
def test_fp8_kernel_matches_reference_and_exact_attention(kernels, lengths, n_heads, n_kv, dim, page):
    cache, table, lens, q, originals = fp8_case(lengths, n_heads, n_kv, dim, page)
    scale = 1 / math.sqrt(dim)
    width = table.shape[1] * page
    kw = dict(scale=scale, k_scale=cache.k_scale, v_scale=cache.v_scale, kv_format="fp8")
    ref_mass, tri_mass = torch.zeros(len(lengths), width), torch.zeros(len(lengths), width)
    ref = paged_decode_reference(q, cache.k, cache.v, table, lens, mass_out=ref_mass, **kw)
    tri = kernels.paged_decode_attention(
        q, cache.k, cache.v, table, lens, force_triton=True, block_n=16, num_splits=2, mass_out=tri_mass, **kw
    )
    torch.testing.assert_close(tri, ref, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(tri_mass, ref_mass, atol=1e-5, rtol=1e-4)
    # against exact attention over the unquantized K/V: E4M3's 3 mantissa bits (a relative step of 1/8)
    # are coarser than int8's 255 uniform steps on Gaussian K/V (int8's bound in test_kv_quant: 0.05)
    assert (ref - exact(q, originals, scale)).abs().max() < 0.2
    # a float pool holding the decoded, scaled tokens gives the same output
    fk = decode_codes(cache.k, "fp8") * cache.k_scale.float()[:, :, None, :]
    fv = decode_codes(cache.v, "fp8") * cache.v_scale.float()[..., None]
    torch.testing.assert_close(paged_decode_reference(q, fk, fv, table, lens, scale=scale), ref)
    # the same bytes read as int8 steps give another answer: the format reaches the kernel
    as_int8 = paged_decode_reference(q, cache.k, cache.v, table, lens, **{**kw, "kv_format": "int8"})
    assert (as_int8 - ref).abs().max() > 0.01
    with pytest.raises(ValueError, match="kv_format"):
        paged_decode_reference(q, cache.k, cache.v, table, lens, **{**kw, "kv_format": "fp4"})
