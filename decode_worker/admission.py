"""Which caches the decode worker takes into its pool (``PoolConfig.admission``).

- ``grow`` (default): a cache takes the blocks of its own tokens; a new cache must leave ``watermark`` of
  the pool free, so running sequences have room to grow, and waits while preempted sequences wait to
  resume (they go first). Sequences take further blocks one at a time while decoding; when the pool runs
  out the engine preempts the newest (``engine.py``).
- ``reserve``: a cache also reserves ``max_new_tokens`` in every layer, so decoding never needs a block
  it does not have and nothing is ever preempted; fewer sequences fit.

Either way a request that could not fit even in an empty pool is refused outright.
"""

from __future__ import annotations

from dataclasses import dataclass

from vlkv.decode_worker.kv_pool import KVPool, SequenceBlocks


class AdmissionRefused(Exception):
    pass


@dataclass(frozen=True)
class AdmissionPolicy:
    reserve: bool = False
    watermark_blocks: int = 0

    @classmethod
    def from_config(cls, admission: str, watermark: float, pool: KVPool) -> AdmissionPolicy:
        reserve = admission == "reserve"
        return cls(reserve, 0 if reserve else int(watermark * pool.num_blocks))

    def need(self, pool: KVPool, lengths: list[int], max_new_tokens: int) -> int:
        """Blocks a cache of ``lengths`` takes at admission."""
        return pool.blocks_needed(lengths, max_new_tokens if self.reserve else 0)

    def available(self, pool: KVPool, swapped: int) -> int:
        """Blocks a new cache may take now."""
        if swapped:
            return 0
        return max(0, pool.num_free - self.watermark_blocks)

    def admit(
        self, pool: KVPool, lengths: list[int], max_new_tokens: int, swapped: int = 0
    ) -> SequenceBlocks:
        most = pool.blocks_needed(lengths, max_new_tokens)
        if most > pool.num_blocks:
            raise AdmissionRefused(
                f"request needs up to {most} KV blocks with max_new_tokens={max_new_tokens}; "
                f"the pool has {pool.num_blocks}"
            )
        need, room = self.need(pool, lengths, max_new_tokens), self.available(pool, swapped)
        if need > room:
            raise AdmissionRefused(
                f"KV pool full: request needs {need} blocks, {room} available "
                f"({pool.num_free} free, {swapped} preempted sequences waiting)"
            )
        return pool.allocate(lengths, max_new_tokens if self.reserve else 0)
