"""Paged decode attention in Triton, split along the sequence (flash-decoding).

Shapes (S sequences, H query heads, H_kv KV heads, G = H // H_kv, P tokens per block, D head dim):
``q`` ``[S, H, D]`` one new query per sequence; ``k_pool``, ``v_pool`` ``[num_blocks, H_kv, P, D]`` one
layer's view of the shared pool; ``block_tables`` ``[S, max_blocks]`` int32, token ``t`` of sequence ``s``
at block ``block_tables[s, t // P]``, offset ``t % P``; ``lengths`` ``[S]`` int32 (>= 1). Query head
``h`` reads KV head ``h // G``.

Two kernels:

1. ``_split_kernel``, grid ``(S, H_kv, num_splits)``: the G query heads of one KV head (padded to a
   ``BLOCK_G >= 16`` tile so the products run on ``tl.dot``) against one contiguous range of
   ``split_tokens`` cached tokens, read ``BLOCK_N`` tokens at a time through the block table, with an
   online softmax -> partial max, sum-exp ``[S, H, num_splits]`` and unnormalized output
   ``[S, H, num_splits, D]`` (fp32). A split past the sequence's end writes ``(-inf, 0, 0)``.
2. ``_combine_kernel``, grid ``(S, H)``: rescales and sums the splits -> ``[S, H, D]`` in q's dtype.
3. ``_mass_kernel`` (only with ``mass_out``, decode-phase re-compression), grid ``(S, H_kv, num_splits)``:
   a second pass over K that turns each token's scores into probabilities with the heads' global max and
   sum-exp (from the split partials) and sums them over the group -> per-token attention mass.

int8 pools (``QUANT``; KIVI scales as in the reference): the split kernel multiplies the G query rows by
the sequence's per-channel K scales (read once from its first block) and each tile's probabilities by the
per-token V scales before the ``tl.dot`` with the int8 tile converted to fp32, so the kernel reads one byte
per K/V element and materializes no dequantized tile. fp8 pools (``FP8``, same int8 tensors holding E4M3
bit patterns): each byte is decoded through a 256-entry fp32 table (``fp8_table_on``) instead of converted;
a gather from a 1 KiB table runs on every GPU Triton supports and in its interpreter (a native E4M3 cast
would need sm_89+).

:func:`paged_decode_attention` dispatches to these kernels for CUDA tensors (or ``force_triton=True``,
which on CPU needs ``TRITON_INTERPRET=1`` set before this module is imported), else to the reference
(which computes ``mass_out`` inside its softmax).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .paged_decode_reference import (
    check_kv_format,
    check_paged_inputs,
    check_paged_values,
    fp8_table_on,
    paged_decode_reference,
)

__all__ = ["paged_decode_attention", "paged_decode_reference"]

# Test-only hook: fill the internal split buffers with NaN so an unwritten partial shows.
_POISON_WORKSPACE = False


@triton.jit
def _load_tokens(base, tok_off, offs_d, tok_ok, D, stride_d):
    """``[BLOCK_N, BLOCK_D]`` rows at element offsets ``tok_off`` (zeros for masked tokens / dims)."""
    mask = tok_ok[:, None] & (offs_d[None, :] < D)
    return tl.load(base + tok_off[:, None] + offs_d[None, :] * stride_d, mask=mask, other=0.0)


@triton.jit
def _bytes_to_f32(x, lut_ptr, FP8: tl.constexpr):
    """An 8-bit tile in fp32: int8 steps converted, or E4M3 bytes decoded through the table."""
    if FP8:
        return tl.load(lut_ptr + (x.to(tl.int32) & 255))
    return x.to(tl.float32)


@triton.jit
def _load_q(
    q_ptr, ks_ptr, table, seq, kv_head, head, offs_d, q_mask, D,
    stride_qs, stride_qh, stride_qd, stride_ksb, stride_ksh, stride_ksd,
    UPCAST: tl.constexpr, QUANT: tl.constexpr,
):  # fmt: skip
    """One KV head's G query rows ``[BLOCK_G, BLOCK_D]``; for an int8 pool already multiplied by the layer's
    per-channel K scales (q . (k * ks) = (q * ks) . k; every block of the sequence's layer holds the same ks,
    so the first block's are read)."""
    q = tl.load(
        q_ptr + seq * stride_qs + head[:, None] * stride_qh + offs_d[None, :] * stride_qd, mask=q_mask
    )
    if UPCAST:  # the CPU interpreter cannot tl.dot bf16 (triton-lang/triton#11584)
        q = q.to(tl.float32)
    if QUANT:
        first = tl.load(table).to(tl.int64)
        ks = tl.load(
            ks_ptr + first * stride_ksb + kv_head * stride_ksh + offs_d * stride_ksd, mask=offs_d < D
        )
        q = q.to(tl.float32) * ks.to(tl.float32)[None, :]
    return q


@triton.jit
def _split_span(lengths_ptr, seq, split, split_tokens, window, WINDOWED: tl.constexpr):
    """The tokens ``[lo, end)`` of ``seq`` that split ``split`` reads: its share of the sequence and, for a
    sliding layer (``WINDOWED``, a constexpr: the other layers' programs are as without windows), only its last
    ``window`` tokens."""
    start = split * split_tokens
    if WINDOWED:
        length = tl.load(lengths_ptr + seq)
        return tl.maximum(start, length - window), tl.minimum(length, start + split_tokens)
    return start, tl.minimum(tl.load(lengths_ptr + seq), start + split_tokens)


# Arguments that vary from one decode step to the next (table width, split count, which group size) are not
# specialized on their values, so one program serves every step of a deployment: see kernels/specs.py.
@triton.jit(do_not_specialize=["tables_ptr", "stride_ts", "stride_ms", "stride_mh", "GROUP", "window"])
def _split_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, lengths_ptr, m_part_ptr, l_part_ptr, acc_part_ptr,
    ks_ptr, vs_ptr, lut_ptr,
    scale, D, split_tokens, window,
    stride_qs, stride_qh, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd,
    stride_ksb, stride_ksh, stride_ksd,
    stride_vsb, stride_vsh, stride_vst,
    stride_ts, stride_tb,
    stride_ms, stride_mh, stride_mp,
    stride_as, stride_ah, stride_ap, stride_ad,
    GROUP, PAGE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, QUANT: tl.constexpr,
    FP8: tl.constexpr, WINDOWED: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    head = kv_head * GROUP + offs_g
    g_ok = offs_g < GROUP
    q_mask = g_ok[:, None] & (offs_d[None, :] < D)
    table = tables_ptr + seq * stride_ts
    q = _load_q(
        q_ptr, ks_ptr, table, seq, kv_head, head, offs_d, q_mask, D,
        stride_qs, stride_qh, stride_qd, stride_ksb, stride_ksh, stride_ksd, UPCAST, QUANT,
    )  # fmt: skip
    k_base = k_ptr + kv_head * stride_kh
    v_base = v_ptr + kv_head * stride_vh

    lo, end = _split_span(lengths_ptr, seq, split, split_tokens, window, WINDOWED)
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for n0 in range(lo, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        tok_ok = offs_n < end
        # Block ids in int64: a large pool's element offsets overflow int32.
        block = tl.load(table + (offs_n // PAGE) * stride_tb, mask=tok_ok, other=0).to(tl.int64)
        slot = offs_n % PAGE
        k = _load_tokens(k_base, block * stride_kb + slot * stride_kt, offs_d, tok_ok, D, stride_kd)
        v = _load_tokens(v_base, block * stride_vb + slot * stride_vt, offs_d, tok_ok, D, stride_vd)
        if QUANT:
            k = _bytes_to_f32(k, lut_ptr, FP8)
            v = _bytes_to_f32(v, lut_ptr, FP8)
        elif UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        s = tl.where(tok_ok[None, :], s, float("-inf"))
        # The first tile holds token `lo` < end, so m_new is finite from the first iteration on (a split
        # wholly before the window, or past the end, runs no tile and writes (-inf, 0, 0)).
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if QUANT:  # p @ (v * vs) = (p * vs) @ v, per-token V scales
            vs = tl.load(vs_ptr + block * stride_vsb + kv_head * stride_vsh + slot * stride_vst, mask=tok_ok)
            pv = p * vs.to(tl.float32)[None, :]
        else:
            pv = p
        acc = acc * alpha[:, None] + tl.dot(pv.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    ml_off = seq * stride_ms + head * stride_mh + split * stride_mp
    tl.store(m_part_ptr + ml_off, m_i, mask=g_ok)
    tl.store(l_part_ptr + ml_off, l_i, mask=g_ok)
    acc_off = seq * stride_as + head[:, None] * stride_ah + split * stride_ap + offs_d[None, :] * stride_ad
    tl.store(acc_part_ptr + acc_off, acc, mask=q_mask)


@triton.jit(do_not_specialize=["num_splits", "stride_ms", "stride_mh"])
def _combine_kernel(
    m_part_ptr, l_part_ptr, acc_part_ptr, out_ptr,
    num_splits, D,
    stride_ms, stride_mh, stride_mp,
    stride_as, stride_ah, stride_ap, stride_ad,
    stride_os, stride_oh, stride_od,
    BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    ml_base = seq * stride_ms + head * stride_mh
    acc_base = acc_part_ptr + seq * stride_as + head * stride_ah + offs_d[None, :] * stride_ad
    # Split 0 always holds token 0, so the global max is finite and every weight exp(m - M) is defined.
    m_max = tl.full([BLOCK_P], float("-inf"), dtype=tl.float32)
    for p0 in range(0, num_splits, BLOCK_P):
        offs_p = p0 + tl.arange(0, BLOCK_P)
        m = tl.load(m_part_ptr + ml_base + offs_p * stride_mp, mask=offs_p < num_splits, other=float("-inf"))
        m_max = tl.maximum(m_max, m)
    m_glob = tl.max(m_max, axis=0)
    denom = tl.zeros([BLOCK_P], dtype=tl.float32)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for p0 in range(0, num_splits, BLOCK_P):
        offs_p = p0 + tl.arange(0, BLOCK_P)
        p_ok = offs_p < num_splits
        m = tl.load(m_part_ptr + ml_base + offs_p * stride_mp, mask=p_ok, other=float("-inf"))
        l_s = tl.load(l_part_ptr + ml_base + offs_p * stride_mp, mask=p_ok, other=0.0)
        w = tl.exp(m - m_glob)
        denom += l_s * w
        part = tl.load(
            acc_base + offs_p[:, None] * stride_ap, mask=p_ok[:, None] & (offs_d[None, :] < D), other=0.0
        )
        acc += tl.sum(part * w[:, None], axis=0)
    out = acc / tl.sum(denom, axis=0)
    o_ptrs = out_ptr + seq * stride_os + head * stride_oh + offs_d * stride_od
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=offs_d < D)


@triton.jit(do_not_specialize=["tables_ptr", "stride_ts", "stride_ws", "stride_wh", "GROUP", "window"])
def _mass_kernel(
    q_ptr, k_ptr, tables_ptr, lengths_ptr, m_ptr, l_ptr, ks_ptr, mass_ptr, lut_ptr,
    scale, D, split_tokens, window,
    stride_qs, stride_qh, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_ksb, stride_ksh, stride_ksd,
    stride_ts, stride_tb,
    stride_ms, stride_mh,
    stride_ws, stride_wh, stride_wt,
    GROUP, PAGE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, QUANT: tl.constexpr,
    FP8: tl.constexpr, WINDOWED: tl.constexpr,
):  # fmt: skip
    """Per-token attention mass of one KV head's G query heads over one split: ``exp(s - M) / L`` with
    the global max M and sum-exp L of each head (from the split kernel's partials), summed over the G
    heads -> ``mass[seq, kv_head, token]``. A second, K-only pass: re-compression's cheap reduction."""
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    head = kv_head * GROUP + offs_g
    g_ok = offs_g < GROUP
    q_mask = g_ok[:, None] & (offs_d[None, :] < D)
    table = tables_ptr + seq * stride_ts
    q = _load_q(
        q_ptr, ks_ptr, table, seq, kv_head, head, offs_d, q_mask, D,
        stride_qs, stride_qh, stride_qd, stride_ksb, stride_ksh, stride_ksd, UPCAST, QUANT,
    )  # fmt: skip
    m_g = tl.load(m_ptr + seq * stride_ms + head * stride_mh, mask=g_ok, other=0.0)
    inv_l = 1.0 / tl.load(l_ptr + seq * stride_ms + head * stride_mh, mask=g_ok, other=1.0)
    k_base = k_ptr + kv_head * stride_kh
    lo, end = _split_span(lengths_ptr, seq, split, split_tokens, window, WINDOWED)
    for n0 in range(lo, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        tok_ok = offs_n < end
        block = tl.load(table + (offs_n // PAGE) * stride_tb, mask=tok_ok, other=0).to(tl.int64)
        slot = offs_n % PAGE
        k = _load_tokens(k_base, block * stride_kb + slot * stride_kt, offs_d, tok_ok, D, stride_kd)
        if QUANT:
            k = _bytes_to_f32(k, lut_ptr, FP8)
        elif UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        p = tl.exp(s - m_g[:, None]) * inv_l[:, None]
        p = tl.where(g_ok[:, None] & tok_ok[None, :], p, 0.0)
        w_off = seq * stride_ws + kv_head * stride_wh + offs_n * stride_wt
        tl.store(mass_ptr + w_off, tl.sum(p, axis=0), mask=tok_ok)


def _check_triton_device(t: Tensor, kernel) -> None:
    if t.is_cuda:
        return
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(kernel, InterpretedFunction):
        raise RuntimeError(
            "Triton kernels on CPU tensors need TRITON_INTERPRET=1 set before vlkv.kernels is imported"
        )


def _default_splits(n_tiles: int, n_seq: int, n_kv: int, device: torch.device) -> int:
    """Enough (seq, KV head, split) programs to fill the device about twice over."""
    n_sm = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    return max(1, min(n_tiles, triton.cdiv(2 * n_sm, n_seq * n_kv)))


def paged_decode_attention(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    block_tables: Tensor,
    lengths: Tensor,
    *,
    scale: float,
    force_triton: bool = False,
    out: Tensor | None = None,
    max_length: int | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
    validate: bool = True,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
    mass_out: Tensor | None = None,
    kv_format: str = "int8",
    window: int = 0,
) -> Tensor:
    """Decode attention of ``q`` ``[S, H, D]`` over paged K/V; returns ``[S, H, D]`` in ``q.dtype``.

    Triton on CUDA tensors (or with ``force_triton``), the torch reference otherwise.
    ``out`` (Triton path): ``[S, H, D]`` buffer in q's dtype written in place.
    ``max_length``: an upper bound of ``lengths`` (else read from the device, a sync).
    ``num_splits``: splits per sequence (else sized to the device). ``block_n``: tokens per tile (default
    64; 32 for fp8 pools, whose table-decoded fp32 tiles reach ``tl.dot`` through shared memory: at 64 a
    D=128 program holds 92 KiB of it, so an A100 runs one per SM; ``vlkv kernels compile`` reports it).
    ``validate``: check lengths and the needed block ids (a device sync; off in a hot loop).
    ``k_scale``, ``v_scale``: an 8-bit pool's scales, ``kv_format`` what its bytes encode (``int8`` steps
    or ``fp8`` E4M3 patterns); ``mass_out`` ``[S, >= max_length]`` fp32: each token's
    attention probability summed over all query heads is added in place (``_mass_kernel``). ``window`` > 0:
    each sequence attends to its last ``window`` tokens only (a sliding-window layer; see the reference).
    """
    if window < 0:
        raise ValueError(f"window must be >= 0, got {window}")
    n_seq, n_heads, dim, n_blocks, n_kv, page = check_paged_inputs(
        q, k_pool, v_pool, block_tables, lengths, k_scale, v_scale
    )
    if validate:
        check_paged_values(block_tables, lengths, n_blocks, page)
    if not (q.is_cuda or force_triton):
        if out is not None:
            raise ValueError("out= is only supported on the Triton path")
        return paged_decode_reference(
            q, k_pool, v_pool, block_tables, lengths, scale=scale, validate=False,
            k_scale=k_scale, v_scale=v_scale, mass_out=mass_out, kv_format=kv_format, window=window,
        )  # fmt: skip
    _check_triton_device(q, _split_kernel)
    fp8 = k_scale is not None and check_kv_format(kv_format) == "fp8"
    if block_n is None:
        block_n = 32 if fp8 else 64
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    if out is None:
        out = torch.empty_like(q)
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(
            f"out must be {q.dtype} {tuple(q.shape)} on {q.device}, got {out.dtype} {tuple(out.shape)}"
        )
    if n_seq == 0:
        return out
    lengths = lengths.contiguous()  # the kernel reads lengths[seq] at unit stride
    if max_length is None:
        max_length = int(lengths.max())
    elif validate and max_length < int(lengths.max()):
        raise ValueError(f"max_length={max_length} is below the longest sequence ({int(lengths.max())})")
    n_tiles = triton.cdiv(max(1, max_length), block_n)
    splits = num_splits if num_splits is not None else _default_splits(n_tiles, n_seq, n_kv, q.device)
    if splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {splits}")
    split_tokens = triton.cdiv(n_tiles, min(splits, n_tiles)) * block_n
    splits = triton.cdiv(max_length, split_tokens)

    m_part = q.new_empty((n_seq, n_heads, splits), dtype=torch.float32)
    l_part = torch.empty_like(m_part)
    acc_part = q.new_empty((n_seq, n_heads, splits, dim), dtype=torch.float32)
    if _POISON_WORKSPACE:
        for t in (m_part, l_part, acc_part):
            t.fill_(float("nan"))
    quant = k_scale is not None
    lut = fp8_table_on(q.device) if fp8 else m_part  # unread unless fp8
    upcast = q.dtype == torch.bfloat16 and not q.is_cuda
    block_d = max(16, triton.next_power_of_2(dim))
    m_strides = m_part.stride()
    a_strides = acc_part.stride()
    ks, vs = (k_scale, v_scale) if quant else (m_part, m_part)  # unread when not quantized
    # Unread scales pass zero strides: the dummy's own strides would vary with the split count and make
    # Triton build a separate program for each value it specializes on (1, multiples of 16, others).
    ks_strides, vs_strides = (ks.stride(), vs.stride()) if quant else ((0, 0, 0), (0, 0, 0))
    fp32 = q.dtype == torch.float32 or upcast or (quant and not q.is_cuda)
    reach = window if window > 0 else max_length  # no window: every token from 0 on
    _split_kernel[(n_seq, n_kv, splits)](
        q, k_pool, v_pool, block_tables, lengths, m_part, l_part, acc_part, ks, vs, lut,
        scale, dim, split_tokens, reach,
        *q.stride(), *k_pool.stride(), *v_pool.stride(), *ks_strides, *vs_strides,
        *block_tables.stride(), *m_strides, *a_strides,
        GROUP=n_heads // n_kv, PAGE=page, BLOCK_G=max(16, triton.next_power_of_2(n_heads // n_kv)),
        BLOCK_N=block_n, BLOCK_D=block_d,
        PRECISION="ieee" if fp32 else "tf32", UPCAST=upcast, QUANT=quant, FP8=fp8, WINDOWED=window > 0,
    )  # fmt: skip
    _combine_kernel[(n_seq, n_heads)](
        m_part, l_part, acc_part, out, splits, dim, *m_strides, *a_strides, *out.stride(),
        BLOCK_P=min(32, max(16, triton.next_power_of_2(splits))), BLOCK_D=block_d,
    )  # fmt: skip
    if mass_out is not None:
        if mass_out.shape[0] != n_seq or mass_out.shape[1] < max_length:
            raise ValueError(f"mass_out must be [S={n_seq}, >= {max_length}]")
        m_glob = m_part.amax(dim=2)  # the last split holds the newest token: finite
        l_glob = (l_part * torch.exp(m_part - m_glob.unsqueeze(-1))).sum(dim=2)
        per_head = q.new_zeros((n_seq, n_kv, max_length), dtype=torch.float32)
        _mass_kernel[(n_seq, n_kv, splits)](
            q, k_pool, block_tables, lengths, m_glob, l_glob, ks, per_head, lut,
            scale, dim, split_tokens, reach,
            *q.stride(), *k_pool.stride(), *ks_strides, *block_tables.stride(), *m_glob.stride(),
            *per_head.stride(),
            GROUP=n_heads // n_kv, PAGE=page, BLOCK_G=max(16, triton.next_power_of_2(n_heads // n_kv)),
            BLOCK_N=block_n, BLOCK_D=block_d,
            PRECISION="ieee" if fp32 else "tf32", UPCAST=upcast, QUANT=quant, FP8=fp8, WINDOWED=window > 0,
        )  # fmt: skip
        mass_out.narrow(1, 0, max_length).add_(per_head.sum(dim=1))
    return out
