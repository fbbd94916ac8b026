"""The decode pool's block layout, for transports that write straight into it (NIXL).

A pool tensor is ``[num_blocks, H_kv, block_size, D]``; token t of a layer lives in block ``table[t // B]``
at row ``t % B`` of every head. A layer's ``[H_kv, k, D]`` cache therefore lands as ``ceil(k / B)`` whole
blocks, zero-padded after its last token. Blocks with consecutive ids are adjacent in memory, so a layer is
written as a few runs (``block_runs``), each one region, never one descriptor per token or per head.

The sender packs each layer into that block order (``pack_layer``: one copy on its side; writing straight
from ``[H, k, D]`` would take one region per head and block, 4 KiB each on a 7B layout, which UCX moves at
half the speed of whole layers) and checksums and checks finite what it packed; the receiver checksums the
same bytes where they landed (``runs_crc32c``: read in place, no copy) before the sequence may join a batch.
"""

from __future__ import annotations

import numpy as np
import torch
from vlkv.common.block_math import ceil_div
from vlkv.common.handoff.codec import crc32c_extend


def block_runs(table: list[int]) -> list[tuple[int, int]]:
    """``(first block, count)`` of each run of consecutive block ids in ``table``, in table order."""
    runs: list[tuple[int, int]] = []
    for b in table:
        if runs and runs[-1][0] + runs[-1][1] == b:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((b, 1))
    return runs


def packed_bytes(num_tokens: int, block_size: int, num_kv_heads: int, head_dim: int, itemsize: int) -> int:
    """Bytes of one packed tensor (K or V) of a layer of ``num_tokens``: its whole blocks."""
    return ceil_div(num_tokens, block_size) * num_kv_heads * block_size * head_dim * itemsize


def pack_layer(dst: torch.Tensor, src: torch.Tensor, block_size: int) -> None:
    """Copy ``src`` ``[H, k, D]`` into ``dst`` (flat, ``packed_bytes`` long) as ``[ceil(k/B), H, B, D]``
    blocks, zero past token k."""
    h, k, d = src.shape
    nb = ceil_div(k, block_size)
    out = dst.view(src.dtype).view(nb, h, block_size, d)
    full = k // block_size
    if full:
        out[:full].copy_(src[:, : full * block_size].reshape(h, full, block_size, d).transpose(0, 1))
    rest = k - full * block_size
    if rest:
        out[full, :, :rest].copy_(src[:, full * block_size :])
        out[full, :, rest:].zero_()


def _bytes_of(t: torch.Tensor) -> np.ndarray:
    """A uint8 NumPy view of a contiguous CPU tensor (no copy; bf16 has no NumPy dtype)."""
    return t.reshape(-1).view(torch.uint8).numpy()


def tensor_crc32c(t: torch.Tensor, crc: int = 0) -> int:
    """CRC-32C of a contiguous tensor's bytes, continuing ``crc`` (a CUDA tensor is copied to host)."""
    return crc32c_extend(crc, _bytes_of(t if t.device.type == "cpu" else t.cpu()))


def runs_crc32c(pool: torch.Tensor, runs: list[tuple[int, int]], crc: int = 0) -> int:
    """CRC-32C of the pool blocks of ``runs``, in order, read in place."""
    for first, count in runs:
        crc = tensor_crc32c(pool[first : first + count], crc)
    return crc
