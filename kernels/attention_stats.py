"""Fused post-vision attention statistics in Triton (VL-Cache paper, appendix A.5).

Shapes (H query heads, H_kv KV heads, G = H // H_kv, Tq query rows, m keys, D head dim):
``q`` ``[H, Tq, D]`` holds the rows at absolute positions ``q_start .. q_start + Tq - 1``,
``k`` ``[H_kv, m, D]`` all keys; query head ``h`` reads KV head ``h // G``; row ``i`` sees keys
``j <= q_start + i``.

Three kernels, run in order, never writing a score to memory:

1. ``_row_stats_kernel``, grid ``(cdiv(Tq, BLOCK_Q), H)``: one query tile, loops over the visible key
   tiles with an online max / sum-exp -> ``row_max``, ``row_sumexp`` ``[H, Tq]``.
2. ``_col_stats_kernel``, grid ``(cdiv(m, BLOCK_N), H)``: one key tile, recomputes the scores of the query
   tiles that see it, normalizes them with kernel 1's results and reduces over queries -> ``col_sum``
   ``[H, m]`` and one below-threshold count per key tile ``[H, cdiv(m, BLOCK_N)]`` (int32).
3. ``_sum_counts_kernel``, grid ``(H,)``: sums the per-tile counts -> ``below`` ``[H]`` int64.

Intermediates: two fp32 values per query row and one int32 per key tile, per head.
:func:`attention_stats` dispatches to these kernels for CUDA tensors (or ``force_triton=True``, which on
CPU needs ``TRITON_INTERPRET=1`` set before this module is imported) and to the torch reference otherwise.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from .attention_stats_reference import (
    AttentionStats,
    attention_stats_reference,
    check_stats_inputs,
    unmasked_count,
)

__all__ = ["AttentionStats", "attention_stats", "attention_stats_reference"]

# Test-only hook: fill the internal per-tile count buffer with garbage so an unwritten tile shows.
_POISON_WORKSPACE = False


@triton.jit
def _load_rows(base, offs_row, offs_d, n_rows, D, stride_row, stride_d):
    """Load a ``[len(offs_row), BLOCK_D]`` tile of rows ``offs_row`` (zeros outside ``n_rows`` x ``D``)."""
    ptrs = base + offs_row[:, None] * stride_row + offs_d[None, :] * stride_d
    mask = (offs_row[:, None] < n_rows) & (offs_d[None, :] < D)
    return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _scaled_scores(q, k, scale, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """``[BLOCK_Q, BLOCK_N]`` fp32 logits ``scale * q k^T`` of a query tile and a key tile.

    ``UPCAST`` converts the tiles to fp32 first: the CPU interpreter cannot ``tl.dot`` bf16 (it
    multiplies the bit patterns, triton-lang/triton#11584); bf16 products are exact in fp32 anyway.
    """
    if UPCAST:
        q = q.to(tl.float32)
        k = k.to(tl.float32)
    return tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale


# Sizes and strides that vary with the prompt (and the group size) are not specialized on their values, so
# one program per head dim and dtype serves every prompt: see kernels/specs.py.
@triton.jit(do_not_specialize=["Tq", "q_start", "stride_rh", "GROUP"])
def _row_stats_kernel(
    q_ptr, k_ptr, row_max_ptr, row_sumexp_ptr,
    Tq, D, q_start, scale,
    stride_qh, stride_qt, stride_qd,
    stride_kh, stride_kt, stride_kd,
    stride_rh, stride_rt,
    GROUP, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    pid_q = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)
    offs_q = pid_q * BLOCK_Q + tl.arange(0, BLOCK_Q)
    offs_d = tl.arange(0, BLOCK_D)
    q = _load_rows(q_ptr + head * stride_qh, offs_q, offs_d, Tq, D, stride_qt, stride_qd)
    k_base = k_ptr + (head // GROUP) * stride_kh
    q_pos = q_start + offs_q  # absolute position of each row: it sees keys j <= q_pos
    # Keys past the tile's last row are masked for every row of the tile: skip them.
    kv_end = q_start + tl.minimum((pid_q + 1) * BLOCK_Q, Tq)

    m_i = tl.full([BLOCK_Q], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_Q], dtype=tl.float32)
    for n0 in range(0, kv_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        k = _load_rows(k_base, offs_n, offs_d, kv_end, D, stride_kt, stride_kd)
        s = _scaled_scores(q, k, scale, PRECISION, UPCAST)
        s = tl.where(offs_n[None, :] <= q_pos[:, None], s, float("-inf"))
        # Tile 0 holds key 0, visible to every row, so m_i is finite from the first iteration on.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        l_i = l_i * tl.exp(m_i - m_new) + tl.sum(tl.exp(s - m_new[:, None]), axis=1)
        m_i = m_new

    row_mask = offs_q < Tq
    tl.store(row_max_ptr + head * stride_rh + offs_q * stride_rt, m_i, mask=row_mask)
    tl.store(row_sumexp_ptr + head * stride_rh + offs_q * stride_rt, l_i, mask=row_mask)


@triton.jit(do_not_specialize=["Tq", "m", "q_start", "stride_rh", "stride_ch", "stride_ph", "GROUP"])
def _col_stats_kernel(
    q_ptr, k_ptr, row_max_ptr, row_sumexp_ptr, col_sum_ptr, part_ptr,
    Tq, m, D, q_start, scale, log_p,
    stride_qh, stride_qt, stride_qd,
    stride_kh, stride_kt, stride_kd,
    stride_rh, stride_rt,
    stride_ch, stride_cn,
    stride_ph, stride_pb,
    GROUP, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)
    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    k = _load_rows(k_ptr + (head // GROUP) * stride_kh, offs_n, offs_d, m, D, stride_kt, stride_kd)
    q_base = q_ptr + head * stride_qh
    r_off = head * stride_rh

    col = tl.zeros([BLOCK_N], dtype=tl.float32)
    count = tl.zeros([BLOCK_N], dtype=tl.int32)
    # Row i sees key n0 iff i >= n0 - q_start: earlier query tiles see none of this key tile, and
    # a key tile at or past q_start + Tq runs no iteration (its col_sum stays 0).
    t_first = (tl.maximum(n0 - q_start, 0) // BLOCK_Q) * BLOCK_Q
    for t0 in range(t_first, Tq, BLOCK_Q):
        offs_q = t0 + tl.arange(0, BLOCK_Q)
        row_ok = offs_q < Tq
        q = _load_rows(q_base, offs_q, offs_d, Tq, D, stride_qt, stride_qd)
        r_max = tl.load(row_max_ptr + r_off + offs_q * stride_rt, mask=row_ok, other=0.0)
        r_sum = tl.load(row_sumexp_ptr + r_off + offs_q * stride_rt, mask=row_ok, other=1.0)
        shifted = _scaled_scores(q, k, scale, PRECISION, UPCAST) - r_max[:, None]
        visible = row_ok[:, None] & (offs_n[None, :] <= (q_start + offs_q)[:, None])
        prob = tl.where(visible, tl.exp(shifted) * (1.0 / r_sum)[:, None], 0.0)
        col += tl.sum(prob, axis=0)
        count += tl.sum((visible & (shifted < log_p)).to(tl.int32), axis=0)

    tl.store(col_sum_ptr + head * stride_ch + offs_n * stride_cn, col, mask=offs_n < m)
    tl.store(part_ptr + head * stride_ph + pid_n * stride_pb, tl.sum(count, axis=0))


@triton.jit(do_not_specialize=["n_parts", "stride_ph"])
def _sum_counts_kernel(part_ptr, below_ptr, n_parts, stride_ph, stride_pb, BLOCK: tl.constexpr):
    head = tl.program_id(0).to(tl.int64)
    base = part_ptr + head * stride_ph
    acc = tl.zeros([BLOCK], dtype=tl.int64)
    for b0 in range(0, n_parts, BLOCK):
        offs = b0 + tl.arange(0, BLOCK)
        acc += tl.load(base + offs * stride_pb, mask=offs < n_parts, other=0).to(tl.int64)
    tl.store(below_ptr + head, tl.sum(acc, axis=0))


def _check_triton_device(t: Tensor, kernel) -> None:
    if t.is_cuda:
        return
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(kernel, InterpretedFunction):
        raise RuntimeError(
            "Triton kernels on CPU tensors need TRITON_INTERPRET=1 set before vlkv.kernels is imported"
        )


def _check_out(out: AttentionStats, n_heads: int, tq: int, m: int, device: torch.device) -> None:
    expected = {
        "row_max": ((n_heads, tq), torch.float32),
        "row_sumexp": ((n_heads, tq), torch.float32),
        "col_sum": ((n_heads, m), torch.float32),
        "below": ((n_heads,), torch.int64),
        "unmasked": ((n_heads,), torch.int64),
    }
    for name, (shape, dtype) in expected.items():
        t = getattr(out, name)
        if tuple(t.shape) != shape or t.dtype != dtype or t.device != device:
            raise ValueError(
                f"out.{name} must be {dtype} {shape} on {device}, got {t.dtype} {tuple(t.shape)}"
            )
    if out.below.stride(0) != 1:
        raise ValueError("out.below must be contiguous")


def attention_stats(
    q: Tensor,
    k: Tensor,
    *,
    q_start: int,
    scale: float,
    threshold: float = 0.01,
    force_triton: bool = False,
    out: AttentionStats | None = None,
    block_q: int = 64,
    block_n: int = 64,
) -> AttentionStats:
    """Post-vision attention statistics of ``q`` ``[H, Tq, D]`` against ``k`` ``[H_kv, m, D]``.

    Triton on CUDA tensors (or with ``force_triton``), the torch reference otherwise. ``out`` (Triton
    path only) receives the results in place: fp32 ``[H, Tq]``, ``[H, Tq]``, ``[H, m]`` and int64 ``[H]``,
    ``[H]``. ``block_q`` / ``block_n`` are the query / key tile sizes (powers of two, >= 16).
    fp32 inputs use IEEE fp32 dot products; fp16 / bf16 inputs accumulate in fp32.
    """
    n_heads, tq, dim, n_kv, m = check_stats_inputs(q, k, q_start, threshold)
    if not (q.is_cuda or force_triton):
        if out is not None:
            raise ValueError("out= is only supported on the Triton path")
        return attention_stats_reference(q, k, q_start=q_start, scale=scale, threshold=threshold)
    _check_triton_device(q, _row_stats_kernel)
    for name, block in (("block_q", block_q), ("block_n", block_n)):
        if block < 16 or block & (block - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {block}")
    if out is None:
        out = AttentionStats(
            row_max=q.new_empty((n_heads, tq), dtype=torch.float32),
            row_sumexp=q.new_empty((n_heads, tq), dtype=torch.float32),
            col_sum=q.new_empty((n_heads, m), dtype=torch.float32),
            below=q.new_empty((n_heads,), dtype=torch.int64),
            unmasked=q.new_empty((n_heads,), dtype=torch.int64),
        )
    _check_out(out, n_heads, tq, m, q.device)
    for name, t in (("q", q), ("k", k)):  # offsets inside one head are int32 in the kernels
        if (t.shape[1] - 1) * t.stride(1) + (t.shape[2] - 1) * t.stride(2) >= 2**31:
            raise ValueError(f"{name} strides {t.stride()} overflow int32 offsets within a head")
    if out.row_max.stride() != out.row_sumexp.stride():
        raise ValueError("out.row_max and out.row_sumexp must share strides")

    n_parts = triton.cdiv(m, block_n)
    parts = q.new_empty((n_heads, n_parts), dtype=torch.int32)
    if _POISON_WORKSPACE:
        parts.fill_(1 << 28)
    log_p = math.log(threshold) if threshold > 0 else float("-inf")
    block_d = max(16, triton.next_power_of_2(dim))
    upcast = q.dtype == torch.bfloat16 and not q.is_cuda  # interpreter: no bf16 tl.dot
    precision = "ieee" if q.dtype == torch.float32 or upcast else "tf32"
    group = n_heads // n_kv
    q_strides = (q.stride(0), q.stride(1), q.stride(2))
    k_strides = (k.stride(0), k.stride(1), k.stride(2))
    r_strides = (out.row_max.stride(0), out.row_max.stride(1))
    meta = dict(
        GROUP=group, BLOCK_Q=block_q, BLOCK_N=block_n, BLOCK_D=block_d, PRECISION=precision, UPCAST=upcast
    )

    _row_stats_kernel[(triton.cdiv(tq, block_q), n_heads)](
        q, k, out.row_max, out.row_sumexp, tq, dim, q_start, scale, *q_strides, *k_strides, *r_strides, **meta
    )
    _col_stats_kernel[(n_parts, n_heads)](
        q, k, out.row_max, out.row_sumexp, out.col_sum, parts,
        tq, m, dim, q_start, scale, log_p,
        *q_strides, *k_strides, *r_strides,
        out.col_sum.stride(0), out.col_sum.stride(1), parts.stride(0), parts.stride(1),
        **meta,
    )  # fmt: skip
    _sum_counts_kernel[(n_heads,)](
        parts,
        out.below,
        n_parts,
        parts.stride(0),
        parts.stride(1),
        BLOCK=min(1024, max(16, triton.next_power_of_2(n_parts))),
    )
    out.unmasked.fill_(unmasked_count(q_start, tq))
    return out
