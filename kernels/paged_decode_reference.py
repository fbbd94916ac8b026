"""Pure-torch paged decode attention (the reference, and the CPU production path).

Shapes (S sequences, H query heads, H_kv KV heads, G = H // H_kv, P tokens per block, D head dim):

- ``q``: ``[S, H, D]``, one new query per sequence; query head ``h`` reads KV head ``h // G``
- ``k_pool``, ``v_pool``: ``[num_blocks, H_kv, P, D]``, one layer's view of the shared block pool
- ``block_tables``: ``[S, max_blocks_per_seq]`` int32; token ``t`` of sequence ``s`` lives in block
  ``block_tables[s, t // P]`` at offset ``t % P``; entries past a sequence's need are ignored
- ``lengths``: ``[S]`` int32, valid tokens per sequence (>= 1)

Output ``[S, H, D]`` in ``q``'s dtype: ``softmax(scale * q k^T) v`` over each sequence's valid tokens.

``window`` ``W`` > 0 (a sliding-window layer, whose cache is a run of consecutive positions ending at the
new token): only each sequence's last ``W`` valid tokens are attended (``lengths - W .. lengths - 1``).

int8 pools (``--kv-dtype int8``, KIVI): ``k_pool``/``v_pool`` are int8 and come with ``k_scale``
``[num_blocks, H_kv, D]`` (per channel; every block of one sequence's layer holds the same scales) and
``v_scale`` ``[num_blocks, H_kv, P]`` (per token), fp16. Dequantization is folded into the products:
``q . (k * ks) = (q * ks) . k`` with the scales of the sequence's first block, and ``p @ (v * vs) =
(p * vs) @ v``, so no dequantized K/V tile is ever materialized.

fp8 pools (``--kv-dtype fp8``, ``kv_format="fp8"``): the same int8 tensors and scales, each byte an OCP FP8
E4M3 bit pattern instead of an integer step; the gathered bytes are decoded to fp32 (``_decode_fp8``)
where an int8 pool's are converted.

``mass_out`` ``[S, T]`` fp32 (T >= max_blocks * P): each sequence's attention probabilities, summed over
all query heads, are added at their token index (decode-phase re-compression accumulates them).
"""

from __future__ import annotations

import math
import threading

import torch
from torch import Tensor

__all__ = ["check_paged_inputs", "check_paged_values", "fp8_table", "fp8_table_on", "paged_decode_reference"]

KV_FORMATS = ("int8", "fp8")


def fp8_table(device: torch.device | str = "cpu") -> Tensor:
    """``[256]`` fp32: the value of each E4M3 byte, indexed by the byte read as unsigned (what the Triton
    kernel gathers from; the two NaN patterns are never written by the quantizer, which clamps)."""
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float().to(device)


_TABLES: dict[torch.device, Tensor] = {}


def fp8_table_on(device: torch.device) -> Tensor:
    """``fp8_table`` on ``device``, built once per device and shared (read only) by this reference and the
    Triton kernels."""
    if device not in _TABLES:
        _TABLES[device] = fp8_table(device)
    return _TABLES[device]


def _decode_fp8(codes: Tensor, name: str) -> Tensor:
    """E4M3 bytes (an int8 tensor) as fp32 values, into the per-thread scratch buffer ``name``."""
    out = _scratch(name, codes.shape, torch.float32, codes.device)
    idx = codes.reshape(-1).view(torch.uint8).int()
    torch.index_select(fp8_table_on(codes.device), 0, idx, out=out.view(-1))
    return out


def check_kv_format(kv_format: str) -> str:
    if kv_format not in KV_FORMATS:
        raise ValueError(f"kv_format must be one of {KV_FORMATS}, got {kv_format!r}")
    return kv_format


# Upper bound on the fp32 K + V gathered at once by the reference (256 MiB).
DEFAULT_CHUNK_BYTES = 256 << 20
_SCRATCH = threading.local()


def check_paged_inputs(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    block_tables: Tensor,
    lengths: Tensor,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
) -> tuple[int, int, int, int, int, int]:
    """Validate shapes, dtypes and devices; return ``(S, H, D, num_blocks, H_kv, P)``."""
    if q.dim() != 3 or k_pool.dim() != 4:
        raise ValueError(f"q must be [S, H, D] and k_pool [blocks, H_kv, P, D], got {tuple(q.shape)}, "
                         f"{tuple(k_pool.shape)}")  # fmt: skip
    n_seq, n_heads, dim = q.shape
    n_blocks, n_kv, page, dim_k = k_pool.shape
    if v_pool.shape != k_pool.shape:
        raise ValueError(f"v_pool {tuple(v_pool.shape)} must match k_pool {tuple(k_pool.shape)}")
    if dim_k != dim:
        raise ValueError(f"head dim mismatch: q has {dim}, the pool {dim_k}")
    if n_kv == 0 or n_heads % n_kv != 0:
        raise ValueError(f"H={n_heads} must be a multiple of H_kv={n_kv}")
    if block_tables.dim() != 2 or block_tables.shape[0] != n_seq or block_tables.shape[1] == 0:
        raise ValueError(
            f"block_tables must be [S={n_seq}, max_blocks >= 1], got {tuple(block_tables.shape)}"
        )
    if lengths.shape != (n_seq,):
        raise ValueError(f"lengths must be [S={n_seq}], got {tuple(lengths.shape)}")
    if block_tables.dtype != torch.int32 or lengths.dtype != torch.int32:
        raise TypeError(f"block_tables and lengths must be int32, got {block_tables.dtype}, {lengths.dtype}")
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"q must be fp32, fp16 or bf16, got {q.dtype}")
    quantized = k_pool.dtype == torch.int8
    if (k_scale is not None) != quantized or (v_scale is not None) != quantized:
        raise TypeError("int8 pools need k_scale and v_scale, floating-point pools take neither")
    if quantized:
        if v_pool.dtype != torch.int8:
            raise TypeError(f"k_pool is int8, v_pool {v_pool.dtype}")
        if k_scale.shape != (n_blocks, n_kv, dim) or v_scale.shape != (n_blocks, n_kv, page):
            raise ValueError(f"scales {tuple(k_scale.shape)}, {tuple(v_scale.shape)} do not fit the pool")
    elif k_pool.dtype != q.dtype or v_pool.dtype != q.dtype:
        raise TypeError(
            f"q, k_pool, v_pool must share a dtype, got {q.dtype}, {k_pool.dtype}, {v_pool.dtype}"
        )
    scales = () if k_scale is None else (k_scale, v_scale)
    devices = {t.device for t in (q, k_pool, v_pool, block_tables, lengths, *scales)}
    if len(devices) != 1:
        raise ValueError(f"all inputs must be on one device, got {sorted(map(str, devices))}")
    return n_seq, n_heads, dim, n_blocks, n_kv, page


def check_paged_values(block_tables: Tensor, lengths: Tensor, n_blocks: int, page: int) -> None:
    """Data checks (a device sync on GPU): 1 <= length <= table capacity, needed block ids in the pool."""
    if lengths.numel() == 0:
        return
    capacity = block_tables.shape[1] * page
    lo, hi = int(lengths.min()), int(lengths.max())
    if lo < 1 or hi > capacity:
        raise ValueError(f"lengths must be in [1, {capacity}] (max_blocks * P), got [{lo}, {hi}]")
    needed = torch.arange(block_tables.shape[1], device=lengths.device) * page < lengths[:, None]
    ids = block_tables[needed]
    if int(ids.min()) < 0 or int(ids.max()) >= n_blocks:
        raise ValueError(f"block ids of valid tokens must be in [0, {n_blocks}), got [{int(ids.min())}, "
                         f"{int(ids.max())}]")  # fmt: skip


def _scratch(slot: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """A reusable per-thread buffer: fresh multi-MB allocations page-fault on every decode step."""
    bufs = _SCRATCH.__dict__.setdefault("bufs", {})
    # Inference-mode tensors cannot be written outside inference mode (and vice versa): one buffer per mode.
    numel, key = math.prod(shape), (slot, dtype, device, torch.is_inference_mode_enabled())
    buf = bufs.get(key)
    if buf is None or buf.numel() < numel:
        buf = bufs[key] = torch.empty(numel, dtype=dtype, device=device)
    return buf[:numel].view(shape)


def _gather(pool: Tensor, table: Tensor, slot: str) -> Tensor:
    """``[c, H_kv, nb * P, D]`` tokens of the blocks ``table`` ``[c, nb]`` (int64) in the pool's dtype."""
    n_blocks, n_kv, page, dim = pool.shape
    c, n_blk = table.shape
    s0, s1, s2, s3 = pool.stride()
    if not (s3 == 1 and s2 == dim and s1 == page * dim and s0 % dim == 0):
        # Blocks are not [H_kv, P, D] slabs: slow path through advanced indexing.
        return pool[table].transpose(1, 2).contiguous().view(c, n_kv, n_blk * page, dim)
    # Every (block, head, offset) is one contiguous row of D elements: gather the rows in output order.
    rows = pool.as_strided(((n_blocks - 1) * (s0 // dim) + n_kv * page, dim), (dim, 1))
    head = torch.arange(n_kv, device=table.device).view(1, n_kv, 1, 1)
    offset = torch.arange(page, device=table.device).view(1, 1, 1, page)
    idx = (table.view(c, 1, n_blk, 1) * (s0 // dim) + head * page + offset).view(-1)
    out = _scratch(slot, (c * n_kv * n_blk * page, dim), pool.dtype, pool.device)
    return torch.index_select(rows, 0, idx, out=out).view(c, n_kv, n_blk * page, dim)


@torch.no_grad()
def paged_decode_reference(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    block_tables: Tensor,
    lengths: Tensor,
    *,
    scale: float,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    validate: bool = True,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
    mass_out: Tensor | None = None,
    kv_format: str = "int8",
    window: int = 0,
) -> Tensor:
    """Decode attention of ``q`` ``[S, H, D]`` over paged K/V; returns ``[S, H, D]`` in ``q.dtype``.

    Sequences are processed longest first in chunks whose gathered K + V stay under ``chunk_bytes``
    (fp32 compute; the gather buffers are kept per thread and reused); each chunk is padded only to
    its own longest sequence. ``k_scale``/``v_scale``: an 8-bit pool's scales, ``kv_format`` what its
    bytes encode (``int8`` or ``fp8``); ``mass_out``: see the module.
    """
    fp8 = check_kv_format(kv_format) == "fp8" and k_scale is not None
    n_seq, n_heads, dim, n_blocks, n_kv, page = check_paged_inputs(
        q, k_pool, v_pool, block_tables, lengths, k_scale, v_scale
    )
    if validate:
        check_paged_values(block_tables, lengths, n_blocks, page)
    if mass_out is not None and (
        mass_out.shape[0] != n_seq or mass_out.shape[1] < block_tables.shape[1] * page
    ):
        raise ValueError(f"mass_out must be [S={n_seq}, >= {block_tables.shape[1] * page}]")
    group = n_heads // n_kv
    out = torch.empty_like(q)
    if n_seq == 0:
        return out
    lens, order = torch.sort(lengths.long(), descending=True)
    lens_list = lens.tolist()
    start = 0
    while start < n_seq:
        n_tok = math.ceil(lens_list[start] / page) * page
        per_seq = 2 * n_kv * n_tok * dim * 4
        stop = min(n_seq, start + max(1, chunk_bytes // per_seq))
        c, n_blk = stop - start, n_tok // page
        idx, ln = order[start:stop], lens[start:stop]
        table = block_tables[idx, :n_blk].long()
        tok = torch.arange(n_tok, device=q.device)
        pad = tok >= ln[:, None]  # [c, n_tok]
        if window > 0:  # a sliding layer: tokens before its last `window` are out of reach
            pad |= tok < (ln - window)[:, None]
        table.masked_fill_(pad.view(c, n_blk, page).all(-1), 0)  # blocks no token of the sequence needs
        kk, vv = _gather(k_pool, table, "k"), _gather(v_pool, table, "v")
        if fp8:  # a 256-entry table gather: ~3x faster on CPU than torch's float8 -> fp32 conversion
            kk, vv = _decode_fp8(kk, "kf"), _decode_fp8(vv, "vf")
        elif kk.dtype != torch.float32:
            kk = _scratch("kf", kk.shape, torch.float32, q.device).copy_(kk)
            vv = _scratch("vf", vv.shape, torch.float32, q.device).copy_(vv)
        # K @ q^T and p^T @ V (transposed views): faster than q @ K^T for the few rows of a GQA group.
        qq = (q[idx].float() * scale).view(c, n_kv, group, dim)
        if k_scale is not None:  # q . (k * ks) = (q * ks) . k: one scale row per (sequence, KV head)
            # the layer's scales sit in every block it holds: its first table entry, before any masking
            qq = qq * k_scale[block_tables[idx, 0].long()].float().view(c, n_kv, 1, dim)
        qq = qq.view(c * n_kv, group, dim)
        s = torch.bmm(kk.view(c * n_kv, n_tok, dim), qq.transpose(1, 2))  # [c * H_kv, n_tok, G]
        s.view(c, n_kv, n_tok, group).masked_fill_(pad.view(c, 1, n_tok, 1), -math.inf)
        probs = torch.softmax(s, dim=1)
        if mass_out is not None:
            mass_out[idx, :n_tok] += probs.view(c, n_kv * n_tok, group).sum(-1).view(c, n_kv, n_tok).sum(1)
        if v_scale is not None:  # p @ (v * vs) = (p * vs) @ v
            vs = v_scale[table].float().transpose(1, 2).reshape(c * n_kv, n_tok, 1)
            probs = probs * vs
        o = torch.bmm(probs.transpose(1, 2), vv.view(c * n_kv, n_tok, dim))  # [c * H_kv, G, D]
        out[idx] = o.view(c, n_heads, dim).to(q.dtype)
        start = stop
    return out
