"""The decode worker's K/V tensors: the storage behind ``block_manager.BlockManager``'s block ids.

Created once per worker, sized in bytes (``from_bytes``); a block id from a ``SequenceBlocks`` table
indexes the first axis. Nothing here knows which block is free or whose it is (that is the block
manager's job): ``write`` fills a layer's first blocks from an arriving compact cache (or a resumed
sequence's host copy), the model runner appends each step's token in place, and ``read`` gathers a layer
back (swap-out, tests).
"""

from __future__ import annotations

import torch


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def block_bytes_of(block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one block: K and V, ``num_kv_heads x block_size x head_dim`` each."""
    return 2 * num_kv_heads * block_size * head_dim * torch.empty((), dtype=dtype).element_size()


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
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (num_blocks, num_kv_heads, block_size, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @classmethod
    def from_bytes(
        cls,
        pool_bytes: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
    ) -> KVCache:
        """As many blocks as fit in ``pool_bytes``; raises ValueError if not even one does."""
        per_block = block_bytes_of(block_size, num_kv_heads, head_dim, dtype)
        num_blocks = pool_bytes // per_block
        if num_blocks < 1:
            raise ValueError(f"pool_bytes={pool_bytes} is smaller than one block ({per_block} bytes)")
        return cls(num_blocks, block_size, num_kv_heads, head_dim, dtype, device)

    @property
    def device(self) -> torch.device:
        return self.k.device

    @property
    def block_bytes(self) -> int:
        return 2 * self.k[0].numel() * self.k.element_size()

    @property
    def token_bytes(self) -> int:
        """Bytes of one token of one layer (K and V): what a swapped-out token costs in host memory."""
        return self.block_bytes // self.block_size

    def write(self, table: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Write one layer's cache ``[H_kv, n, D]`` into the first blocks of ``table``."""
        n = k.shape[1]
        nb = _ceil_div(n, self.block_size)
        if nb > len(table):
            raise ValueError(f"{n} tokens need {nb} blocks, the table has {len(table)}")
        ids = torch.tensor(table[:nb], dtype=torch.long, device=self.k.device)
        pad = nb * self.block_size - n
        for src, dst in ((k, self.k), (v, self.v)):
            x = torch.nn.functional.pad(src.to(dst.dtype), (0, 0, 0, pad))
            dst[ids] = x.view(x.shape[0], nb, self.block_size, x.shape[2]).transpose(0, 1)

    def read(self, table: list[int], n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather the first n tokens of a layer back as ``[H_kv, n, D]`` (a copy)."""
        nb = _ceil_div(n, self.block_size)
        ids = torch.tensor(table[:nb], dtype=torch.long, device=self.k.device)
        out = []
        for src in (self.k, self.v):
            x = src[ids].transpose(0, 1).reshape(src.shape[1], nb * self.block_size, src.shape[3])
            out.append(x[:, :n])
        return out[0], out[1]
