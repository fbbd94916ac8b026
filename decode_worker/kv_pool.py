"""The decode worker's paged KV pool.

One pool of fixed-size blocks holds every layer of every sequence: a block is ``block_size`` tokens of one
layer, K and V for all KV heads. Because each layer of a compact cache keeps a different number of tokens,
a sequence owns one block table per layer. A sequence reserves, at admission, the blocks for its prompt
cache plus ``max_new_tokens`` in every layer, so decoding never runs out of room mid-stream; allocation
returns ``None`` when the pool cannot hold it, and the caller refuses or queues the request.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def blocks_needed(layer_lengths: list[int], extra_tokens: int, block_size: int) -> int:
    """Blocks that hold ``layer_lengths[l] + extra_tokens`` tokens in every layer l (one table per layer)."""
    return sum(_ceil_div(n + extra_tokens, block_size) for n in layer_lengths)


@dataclass
class SequenceBlocks:
    """Blocks reserved for one sequence: ``tables[l]`` lists layer l's block ids in token order."""

    tables: list[list[int]]

    @property
    def num_blocks(self) -> int:
        return sum(len(t) for t in self.tables)


class KVPool:
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
        self.block_size = block_size
        self.num_blocks = num_blocks
        shape = (num_blocks, num_kv_heads, block_size, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._used: set[int] = set()

    @classmethod
    def from_bytes(
        cls, pool_bytes: int, block_size: int, num_kv_heads: int, head_dim: int, dtype, device="cpu"
    ):
        per_block = 2 * num_kv_heads * block_size * head_dim * torch.empty((), dtype=dtype).element_size()
        num_blocks = pool_bytes // per_block
        if num_blocks < 1:
            raise ValueError(f"pool_bytes={pool_bytes} is smaller than one block ({per_block} bytes)")
        return cls(num_blocks, block_size, num_kv_heads, head_dim, dtype, device)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def block_bytes(self) -> int:
        return 2 * self.k[0].numel() * self.k.element_size()

    def blocks_needed(self, layer_lengths: list[int], extra_tokens: int) -> int:
        return blocks_needed(layer_lengths, extra_tokens, self.block_size)

    def can_allocate(self, layer_lengths: list[int], extra_tokens: int) -> bool:
        return self.blocks_needed(layer_lengths, extra_tokens) <= self.num_free

    def allocate(self, layer_lengths: list[int], extra_tokens: int) -> SequenceBlocks | None:
        """Reserve room for ``layer_lengths[l] + extra_tokens`` tokens in every layer, or return None."""
        if not self.can_allocate(layer_lengths, extra_tokens):
            return None
        tables = []
        for n in layer_lengths:
            count = _ceil_div(n + extra_tokens, self.block_size)
            ids = [self._free.pop() for _ in range(count)]
            self._used.update(ids)
            tables.append(ids)
        return SequenceBlocks(tables)

    def _full_tables(self, blocks: SequenceBlocks, lengths: list[int]) -> list[list[int]]:
        """The layer tables with no free slot for token ``lengths[l]``."""
        return [t for t, n in zip(blocks.tables, lengths, strict=True) if n >= len(t) * self.block_size]

    def blocks_to_append(self, blocks: SequenceBlocks, lengths: list[int]) -> int:
        """New blocks ``append`` needs to place token ``lengths[l]`` of every layer l."""
        return len(self._full_tables(blocks, lengths))

    def append(self, blocks: SequenceBlocks, lengths: list[int]) -> bool:
        """Make room for one more token in every layer (at index ``lengths[l]``); all or nothing."""
        grow = self._full_tables(blocks, lengths)
        if len(grow) > self.num_free:
            return False
        for table in grow:
            block = self._free.pop()
            self._used.add(block)
            table.append(block)
        return True

    def free(self, blocks: SequenceBlocks) -> None:
        """Return a sequence's blocks; freeing a block that is not in use is a bug and raises."""
        ids = [b for t in blocks.tables for b in t]
        if len(set(ids)) != len(ids) or not self._used.issuperset(ids):
            raise RuntimeError("freeing blocks that are not allocated (double free)")
        self._used.difference_update(ids)
        self._free.extend(reversed(ids))
        blocks.tables = [[] for _ in blocks.tables]

    def write(self, table: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Write one layer's prompt cache ``[H_kv, n, D]`` into the first blocks of ``table``."""
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
        """Gather the first n tokens of a layer back as ``[H_kv, n, D]`` (tests and diagnostics)."""
        nb = _ceil_div(n, self.block_size)
        ids = torch.tensor(table[:nb], dtype=torch.long, device=self.k.device)
        out = []
        for src in (self.k, self.v):
            x = src[ids].transpose(0, 1).reshape(src.shape[1], nb * self.block_size, src.shape[3])
            out.append(x[:, :n])
        return out[0], out[1]
