"""Paged decode attention (kernels/paged_decode.py) against the torch reference, and the reference
against per-sequence ``F.scaled_dot_product_attention`` on the gathered tokens.

The Triton kernels run on CPU through the Triton interpreter, with no conftest involved: see
tests/triton_interpret.py for why ``TRITON_INTERPRET`` is set first thing and what the ``kernels``
fixture does when triton was already imported in compiled mode. ``TRITON_INTERPRET=0`` on a CUDA machine tests the GPU kernels.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")


import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from paged_decode_cases import DEVICE, make_case  # noqa: E402
from triton_interpret import INTERPRET, kernel_module  # noqa: E402
from vlkv.kernels.paged_decode_reference import paged_decode_reference  # noqa: E402

if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("TRITON_INTERPRET=0 needs a CUDA device", allow_module_level=True)


@pytest.fixture(scope="module")
def kernels():
    yield from kernel_module("vlkv.kernels.paged_decode", "_split_kernel")


def dense_decode(q, k_pool, v_pool, table, lengths, scale):
    """Per sequence: gather its tokens one by one, then SDPA with GQA."""
    page, outs = k_pool.shape[2], []
    for s in range(q.shape[0]):
        t = torch.arange(int(lengths[s]))
        blocks = table[s, t // page].long()
        k = k_pool[blocks, :, t % page].transpose(0, 1).float()  # [H_kv, n, D]
        v = v_pool[blocks, :, t % page].transpose(0, 1).float()
        qs = q[s].float()[:, None]  # [H, 1, D]
        outs.append(F.scaled_dot_product_attention(qs, k, v, scale=scale, enable_gqa=True)[:, 0])
    return torch.stack(outs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_bytes", [1, 1 << 28])
def test_reference_matches_sdpa(dtype, chunk_bytes):
    q, k_pool, v_pool, table, lengths = make_case([1, 4, 5, 17, 9, 40], 8, 2, 16, 4, 64, dtype)
    got = paged_decode_reference(q, k_pool, v_pool, table, lengths, scale=0.3, chunk_bytes=chunk_bytes)
    want = dense_decode(q, k_pool, v_pool, table, lengths, 0.3)
    assert got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)


def test_reference_strided_pools():
    """A layer's view of a [blocks, layers, H_kv, P, D] pool, and a pool whose blocks are not slabs."""
    q, _, _, table, lengths = make_case([3, 11, 1], 4, 1, 16, 4, 32, torch.float32, seed=2)
    big = torch.randn(32, 3, 1, 4, 16)
    k_pool, v_pool = big[:, 1], big[:, 2].transpose(2, 3).contiguous().transpose(2, 3)
    got = paged_decode_reference(q, k_pool, v_pool, table, lengths, scale=0.5)
    torch.testing.assert_close(got, dense_decode(q, k_pool, v_pool, table, lengths, 0.5))


TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


@pytest.mark.parametrize(
    "lengths,n_heads,n_kv,dim,page,n_blocks,dtype,splits,top",
    [
        ([1, 4, 5, 17, 9], 4, 4, 16, 4, 64, torch.float32, None, False),  # GQA 1, lengths from 1
        ([1, 70, 33], 8, 2, 24, 16, 4096, torch.float16, 3, True),  # GQA 4, top of a large pool
        ([45, 1, 16], 8, 1, 32, 8, 64, torch.bfloat16, 2, False),  # GQA 8
        ([100, 2], 16, 2, 16, 16, 3000, torch.float32, 5, True),  # GQA 8, many splits, empty splits
    ],
)
def test_kernel_matches_reference(
    kernels, monkeypatch, lengths, n_heads, n_kv, dim, page, n_blocks, dtype, splits, top
):
    monkeypatch.setattr(kernels, "_POISON_WORKSPACE", True)  # NaN in the split partials
    q, k_pool, v_pool, table, lens = make_case(lengths, n_heads, n_kv, dim, page, n_blocks, dtype, top=top)
    want = paged_decode_reference(q, k_pool, v_pool, table, lens, scale=0.3)
    out = torch.full(q.shape, float("nan"), dtype=dtype, device=DEVICE)
    args = [t.to(DEVICE) for t in (q, k_pool, v_pool, table, lens)]
    got = kernels.paged_decode_attention(
        *args, scale=0.3, force_triton=True, out=out, num_splits=splits, block_n=16
    )
    assert got is out
    torch.testing.assert_close(got.cpu().float(), want.float(), rtol=TOL[dtype], atol=TOL[dtype])


def test_kernel_max_length_bound_and_default_tile(kernels):
    """A loose max_length (no device sync) and the default 64-token tile."""
    q, k_pool, v_pool, table, lens = make_case([3, 30], 4, 2, 16, 16, 16, torch.float16, seed=5)
    want = paged_decode_reference(q, k_pool, v_pool, table, lens, scale=0.25)
    args = [t.to(DEVICE) for t in (q, k_pool, v_pool, table, lens)]
    got = kernels.paged_decode_attention(*args, scale=0.25, force_triton=True, max_length=32, validate=False)
    torch.testing.assert_close(got.cpu(), want, rtol=2e-3, atol=2e-3)


def test_cpu_dispatch_uses_reference(kernels):
    q, k_pool, v_pool, table, lens = make_case([2, 9], 4, 2, 16, 4, 16, torch.float32)
    got = kernels.paged_decode_attention(q, k_pool, v_pool, table, lens, scale=0.5)
    assert torch.equal(got, paged_decode_reference(q, k_pool, v_pool, table, lens, scale=0.5))
    with pytest.raises(ValueError, match="out="):
        kernels.paged_decode_attention(q, k_pool, v_pool, table, lens, scale=0.5, out=torch.empty_like(q))


def test_input_validation(kernels):
    q, k_pool, v_pool, table, lens = make_case([2, 9], 4, 2, 16, 4, 16, torch.float32)
    fn = kernels.paged_decode_attention
    for force in (False, True):
        for bad_lengths in ([0, 9], [2, 17]):  # empty; beyond the table's capacity of 16
            with pytest.raises(ValueError, match="lengths"):
                bad = torch.tensor(bad_lengths, dtype=torch.int32)
                fn(q, k_pool, v_pool, table, bad, scale=1.0, force_triton=force)
        bad = table.clone()
        bad[1, 0] = 16  # a needed block outside the pool
        with pytest.raises(ValueError, match="block ids"):
            fn(q, k_pool, v_pool, bad, lens, scale=1.0, force_triton=force)
        with pytest.raises(TypeError):
            fn(q, k_pool, v_pool, table.long(), lens, scale=1.0, force_triton=force)
        if force:
            with pytest.raises(ValueError, match="max_length"):
                fn(q, k_pool, v_pool, table, lens, scale=1.0, force_triton=True, max_length=8)
        with pytest.raises(TypeError):
            fn(q.half(), k_pool, v_pool, table, lens, scale=1.0, force_triton=force)
        with pytest.raises(ValueError):  # H % H_kv
            fn(q[:, :3], k_pool, v_pool, table, lens, scale=1.0, force_triton=force)
