"""The decode worker's K/V tensors: the storage behind ``block_manager.BlockManager``'s block ids.

Created once per worker, sized in bytes (``from_bytes``); a block id from a ``SequenceBlocks`` table
indexes the first axis. Nothing here knows which block is free or whose it is (that is the block
manager's job): ``write`` fills a layer's first blocks from an arriving compact cache (or a resumed
sequence's host copy), the model runner appends each step's token in place, and ``read`` gathers a layer
back (swap-out, tests).

``kv_dtype="int8"`` or ``"fp8"`` (``--kv-dtype``, see ``common/handoff/quantize.py``; an fp8 pool holds E4M3
bit patterns in the same int8 tensors, so everything below reads "int8" for both): k, v are int8 and every block
also holds its fp16 scales, ``k_scale`` ``[num_blocks, H_kv, D]`` (the per-channel K scales of the sequence
layer the block belongs to, repeated in each of its blocks so the kernel reads them per block) and
``v_scale`` ``[num_blocks, H_kv, block_size]`` (per token). ``block_bytes`` counts them, so a pool of the same
bytes holds about 1.9x the blocks of an fp16 pool (with 16-token blocks and D=128). Layer tensors in and out
of ``write``/``read`` are then ``(k, v, k_scale [H_kv, D], v_scale [H_kv, n])``.
"""

from __future__ import annotations

import torch
from vlkv.common.block_math import ceil_div
from vlkv.common.handoff.quantize import SCALE_DTYPE, check_kv_dtype


def block_bytes_of(
    block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, kv_dtype: str = "fp16"
) -> int:
    """Bytes of one block: K and V, ``num_kv_heads x block_size x head_dim`` each (int8: plus scales)."""
    if check_kv_dtype(kv_dtype) != "fp16":
        return num_kv_heads * (2 * block_size * head_dim + SCALE_DTYPE.itemsize * (head_dim + block_size))
    return 2 * num_kv_heads * block_size * head_dim * dtype.itemsize


class KVCache:
    """k, v: ``[num_blocks, H_kv, block_size, D]``; token t of a layer lives in block ``table[t // B]``."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        kv_dtype: str = "fp16",
    ) -> None:
        """``dtype``: the model's (what attention computes in); ``kv_dtype``: how the pool stores K/V."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.kv_dtype = check_kv_dtype(kv_dtype)
        self.quantized = kv_dtype != "fp16"
        shape = (num_blocks, num_kv_heads, block_size, head_dim)
        store = torch.int8 if self.quantized else dtype
        self.k = torch.zeros(shape, dtype=store, device=device)
        self.v = torch.zeros(shape, dtype=store, device=device)
        self.k_scale = self.v_scale = None
        if self.quantized:
            self.k_scale = torch.ones((num_blocks, num_kv_heads, head_dim), dtype=SCALE_DTYPE, device=device)
            self.v_scale = torch.ones(
                (num_blocks, num_kv_heads, block_size), dtype=SCALE_DTYPE, device=device
            )

    @classmethod
    def from_bytes(
        cls,
        pool_bytes: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
        kv_dtype: str = "fp16",
    ) -> KVCache:
        """As many blocks as fit in ``pool_bytes``; raises ValueError if not even one does."""
        per_block = block_bytes_of(block_size, num_kv_heads, head_dim, dtype, kv_dtype)
        num_blocks = pool_bytes // per_block
        if num_blocks < 1:
            raise ValueError(f"pool_bytes={pool_bytes} is smaller than one block ({per_block} bytes)")
        return cls(num_blocks, block_size, num_kv_heads, head_dim, dtype, device, kv_dtype)

    @property
    def device(self) -> torch.device:
        return self.k.device

    @property
    def block_bytes(self) -> int:
        n = 2 * self.k[0].numel() * self.k.element_size()
        if self.quantized:
            n += (self.k_scale[0].numel() + self.v_scale[0].numel()) * SCALE_DTYPE.itemsize
        return n

    @property
    def kv_bytes_per_block(self) -> int:
        """Bytes of one tensor's (K's or V's) data in a block, without scales: what NIXL writes per block."""
        return self.k[0].numel() * self.k.element_size()

    @property
    def token_bytes(self) -> int:
        """Bytes of one token of one layer (K and V): what a swapped-out token costs in host memory."""
        return self.block_bytes // self.block_size

    def write(self, table: list[int], k: torch.Tensor, v: torch.Tensor, *scales: torch.Tensor) -> None:
        """Write one layer's cache ``[H_kv, n, D]`` into the first blocks of ``table``; an int8 pool also
        takes the layer's ``k_scale`` ``[H_kv, D]`` (into every block of ``table``) and ``v_scale``
        ``[H_kv, n]``."""
        if len(scales) != (2 if self.quantized else 0):
            raise ValueError(f"a {self.kv_dtype} pool takes {'K/V and their scales' if scales else 'K/V'}")
        n = k.shape[1]
        nb = ceil_div(n, self.block_size)
        if nb > len(table):
            raise ValueError(f"{n} tokens need {nb} blocks, the table has {len(table)}")
        ids = torch.tensor(table[:nb], dtype=torch.long, device=self.k.device)
        pad = nb * self.block_size - n
        for src, dst in ((k, self.k), (v, self.v)):
            x = torch.nn.functional.pad(src.to(dst.dtype), (0, 0, 0, pad))
            dst[ids] = x.view(x.shape[0], nb, self.block_size, x.shape[2]).transpose(0, 1)
        if self.quantized:
            self.write_scales(table, *scales)

    def write_scales(self, table: list[int], k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
        """An int8 layer's scales: ``k_scale`` ``[H_kv, D]`` into every block of ``table``, ``v_scale``
        ``[H_kv, n]`` into the slots of its n tokens."""
        n = v_scale.shape[1]
        nb = ceil_div(n, self.block_size)
        device = self.k.device
        self.k_scale[torch.tensor(table, dtype=torch.long, device=device)] = k_scale.to(device, SCALE_DTYPE)
        x = torch.nn.functional.pad(v_scale.to(device, SCALE_DTYPE), (0, nb * self.block_size - n), value=1.0)
        ids = torch.tensor(table[:nb], dtype=torch.long, device=device)
        self.v_scale[ids] = x.view(x.shape[0], nb, self.block_size).transpose(0, 1)

    def read(self, table: list[int], n: int) -> tuple[torch.Tensor, ...]:
        """Gather the first n tokens of a layer back as ``[H_kv, n, D]`` (a copy); an int8 pool also
        returns the layer's ``k_scale`` ``[H_kv, D]`` and ``v_scale`` ``[H_kv, n]`` (what ``write`` takes)."""
        nb = ceil_div(n, self.block_size)
        ids = torch.tensor(table[:nb], dtype=torch.long, device=self.k.device)
        out = []
        for src in (self.k, self.v):
            x = src[ids].transpose(0, 1).reshape(src.shape[1], nb * self.block_size, src.shape[3])
            out.append(x[:, :n])
        if self.quantized:
            out.append(self.k_scale[table[0]].clone())
            out.append(self.v_scale[ids].transpose(0, 1).reshape(self.v_scale.shape[1], -1)[:, :n])
        return tuple(out)

    def compact(self, table: list[int], keep: torch.Tensor) -> None:
        """Keep only the tokens ``keep`` (ascending token indices of this layer) as its first
        ``len(keep)`` tokens, in place (decode-phase re-compression; the caller frees the blocks past
        them). Reads every kept token before writing any, so overlapping moves are safe."""
        kept = [t[:, keep] if i < 2 else t for i, t in enumerate(self.read(table, int(keep.max()) + 1))]
        if self.quantized:
            kept[3] = kept[3][:, keep]
        self.write(table, *kept)
