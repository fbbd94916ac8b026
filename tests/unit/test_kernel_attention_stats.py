"""Attention-statistics kernels (kernels/attention_stats.py) against the torch reference, and the
reference against a dense softmax.

The Triton kernels run on CPU through the Triton interpreter, with no conftest involved.
``triton.jit`` reads ``TRITON_INTERPRET`` when it decorates a function, so it must be set before
``triton.language`` (whose own helpers such as ``tl.zeros`` and ``tl.sum`` are jit functions) and the
kernel module are imported. This module sets it first thing, which suffices when it runs alone. In a
full run, an earlier import of ``transformers`` (``torch._dynamo`` imports triton) may already have
built ``triton.language`` in compiled mode; the module-scoped ``kernels`` fixture then swaps those
helpers for interpreted ones for the duration of this module (``triton_interpreter``, restored
afterwards) and reloads the kernel module. Run with ``TRITON_INTERPRET=0`` on a CUDA machine to test
the compiled kernels on the GPU instead.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import math  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from triton_interpret import INTERPRET, kernel_module  # noqa: E402
from vlkv.kernels.attention_stats_reference import (  # noqa: E402
    AttentionStats,
    attention_stats_reference,
    unmasked_count,
)

DEVICE = "cpu" if INTERPRET else "cuda"
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("TRITON_INTERPRET=0 needs a CUDA device", allow_module_level=True)


@pytest.fixture(scope="module")
def kernels():
    yield from kernel_module("vlkv.kernels.attention_stats", "_row_stats_kernel")


def dense_stats(q, k, q_start, scale, p):
    """Naive statistics from the full [H, Tq, m] softmax (torch.softmax with a causal mask)."""
    n_heads, tq, _ = q.shape
    m = k.shape[1]
    kk = k.float().repeat_interleave(n_heads // k.shape[0], dim=0)
    s = q.float() @ kk.transpose(1, 2) * scale
    visible = torch.arange(m)[None, :] <= (q_start + torch.arange(tq))[:, None]
    s = s.masked_fill(~visible, -math.inf)
    a = torch.softmax(s, dim=-1)
    below = ((a < p * a.amax(dim=-1, keepdim=True)) & visible).sum(dim=(1, 2))
    return s.amax(-1), torch.logsumexp(s, -1), a.sum(1), below, visible.sum().item()


def random_qk(n_heads, n_kv, tq, m, dim, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n_heads, tq, dim, generator=g) * 1.5
    k = torch.randn(n_kv, m, dim, generator=g)
    return q.to(dtype), k.to(dtype)


@pytest.mark.parametrize(
    "n_heads,n_kv,tq,m,q_start,chunk",
    [
        (4, 4, 1, 30, 29, 1 << 23),  # one row at the end
        (8, 2, 30, 30, 0, 1 << 23),  # every row (H2O-style), GQA 4
        (8, 1, 12, 40, 9, 1 << 23),  # q_start > 0 with keys no row can see, GQA 8
        (8, 2, 25, 60, 20, 300),  # chunked over query rows
        (8, 4, 7, 20, 13, 1000),  # chunked over KV heads
    ],
)
@pytest.mark.parametrize("threshold", [0.01, 0.3])
def test_reference_matches_dense_softmax(n_heads, n_kv, tq, m, q_start, chunk, threshold):
    q, k = random_qk(n_heads, n_kv, tq, m, 16, torch.float32)
    st = attention_stats_reference(q, k, q_start=q_start, scale=0.4, threshold=threshold, chunk_elems=chunk)
    row_max, lse, col_sum, below, n_vis = dense_stats(q, k, q_start, 0.4, threshold)
    torch.testing.assert_close(st.row_max, row_max)
    torch.testing.assert_close(st.row_max + st.row_sumexp.log(), lse)
    torch.testing.assert_close(st.col_sum, col_sum)
    assert torch.equal(st.below, below)
    assert st.unmasked.tolist() == [n_vis] * n_heads == [unmasked_count(q_start, tq)] * n_heads
    torch.testing.assert_close(st.col_sum.sum(1), torch.full((n_heads,), float(tq)))
    assert (st.sparsity() >= 0).all() and (st.sparsity() <= 1).all()


def test_reference_threshold_edges():
    q, k = random_qk(4, 2, 6, 10, 16, torch.float32)
    assert attention_stats_reference(q, k, q_start=4, scale=1.0, threshold=0.0).below.sum() == 0
    # p = 1: everything but each row's maximum is below.
    st = attention_stats_reference(q, k, q_start=4, scale=1.0, threshold=1.0)
    assert st.below.tolist() == [unmasked_count(4, 6) - 6] * 4


def _poisoned(n_heads, tq, m):
    nan = float("nan")
    return AttentionStats(
        row_max=torch.full((n_heads, tq), nan, device=DEVICE),
        row_sumexp=torch.full((n_heads, tq), nan, device=DEVICE),
        col_sum=torch.full((n_heads, m), nan, device=DEVICE),
        below=torch.full((n_heads,), -(1 << 40), dtype=torch.int64, device=DEVICE),
        unmasked=torch.full((n_heads,), -1, dtype=torch.int64, device=DEVICE),
    )


TOL = {torch.float32: 1e-5, torch.float16: 1e-4, torch.bfloat16: 1e-4}


@pytest.mark.parametrize(
    "n_heads,n_kv,tq,m,q_start,dim,dtype",
    [
        (4, 4, 1, 37, 36, 16, torch.float32),  # tau = 1, GQA 1, m not a multiple of the tile
        (8, 2, 37, 37, 0, 24, torch.float16),  # tau = m, GQA 4, head dim not a power of two
        (8, 1, 20, 50, 13, 32, torch.bfloat16),  # GQA 8, q_start > 0, keys past the last row
        (4, 1, 5, 70, 65, 16, torch.float32),  # the paper's shape: a few rows at the end
    ],
)
def test_kernel_matches_reference(kernels, monkeypatch, n_heads, n_kv, tq, m, q_start, dim, dtype):
    mod = kernels
    monkeypatch.setattr(mod, "_POISON_WORKSPACE", True)
    q, k = random_qk(n_heads, n_kv, tq, m, dim, dtype, seed=m)
    ref = attention_stats_reference(q, k, q_start=q_start, scale=0.3)
    out = _poisoned(n_heads, tq, m)
    got = mod.attention_stats(
        q.to(DEVICE),
        k.to(DEVICE),
        q_start=q_start,
        scale=0.3,
        force_triton=True,
        out=out,
        block_q=16,
        block_n=16,
    )
    assert got is out
    tol = TOL[dtype]
    torch.testing.assert_close(got.row_max.cpu(), ref.row_max, rtol=tol, atol=tol)
    torch.testing.assert_close(got.row_sumexp.cpu(), ref.row_sumexp, rtol=tol, atol=tol)
    torch.testing.assert_close(got.col_sum.cpu(), ref.col_sum, rtol=tol, atol=tol)
    assert got.unmasked.cpu().equal(ref.unmasked)
    # A count may differ only where a logit sits within rounding of row_max + ln p.
    assert (got.below.cpu() - ref.below).abs().max() <= max(1, unmasked_count(q_start, tq) // 1000)


def test_kernel_strided_views_and_default_tiles(kernels):
    """Q as the last rows of a [H, m, D] tensor and K from a [m, H_kv, D] layout: no copies needed."""
    mod = kernels
    m, tau = 45, 6
    q_all, _ = random_qk(8, 2, m, m, 16, torch.float16, seed=3)
    k_tok = torch.randn(m, 2, 16, generator=torch.Generator().manual_seed(4)).half()
    q, k = q_all[:, m - tau :], k_tok.transpose(0, 1)
    ref = attention_stats_reference(q, k, q_start=m - tau, scale=0.25, threshold=0.05)
    got = mod.attention_stats(
        q.to(DEVICE), k.to(DEVICE), q_start=m - tau, scale=0.25, threshold=0.05, force_triton=True
    )
    torch.testing.assert_close(got.col_sum.cpu(), ref.col_sum, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got.row_max.cpu(), ref.row_max, rtol=1e-4, atol=1e-4)
    assert (got.below.cpu() - ref.below).abs().max() <= 1
    none = mod.attention_stats(
        q.to(DEVICE), k.to(DEVICE), q_start=m - tau, scale=0.25, threshold=0.0, force_triton=True
    )
    assert none.below.cpu().tolist() == [0] * 8


def test_cpu_dispatch_uses_reference(kernels):
    mod = kernels
    q, k = random_qk(4, 2, 3, 9, 16, torch.float32)
    got = mod.attention_stats(q, k, q_start=6, scale=0.5)
    ref = attention_stats_reference(q, k, q_start=6, scale=0.5)
    assert torch.equal(got.col_sum, ref.col_sum) and torch.equal(got.below, ref.below)
    with pytest.raises(ValueError, match="out="):
        mod.attention_stats(q, k, q_start=6, scale=0.5, out=_poisoned(4, 3, 9))


@pytest.mark.parametrize(
    "q_shape,k_shape,q_start,dtypes,err",
    [
        ((4, 3, 16), (3, 9, 16), 0, (torch.float32, torch.float32), ValueError),  # H % H_kv
        ((4, 3, 16), (2, 9, 8), 0, (torch.float32, torch.float32), ValueError),  # head dim
        ((4, 3, 16), (2, 9, 16), 7, (torch.float32, torch.float32), ValueError),  # q_start + Tq > m
        ((4, 0, 16), (2, 9, 16), 0, (torch.float32, torch.float32), ValueError),  # Tq = 0
        ((4, 3, 16), (2, 9, 16), 0, (torch.float16, torch.float32), TypeError),  # dtype mismatch
        ((4, 3, 16), (2, 9, 16), 0, (torch.float64, torch.float64), TypeError),  # unsupported dtype
    ],
)
def test_input_validation(kernels, q_shape, k_shape, q_start, dtypes, err):
    mod = kernels
    q, k = torch.zeros(q_shape, dtype=dtypes[0]), torch.zeros(k_shape, dtype=dtypes[1])
    for force in (False, True):
        with pytest.raises(err):
            mod.attention_stats(q, k, q_start=q_start, scale=1.0, force_triton=force)
