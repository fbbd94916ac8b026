"""Shared helpers for the KV wire tests: random caches, a fake block pool, bitwise comparison, feeding a stream."""

from __future__ import annotations

import grpc
import torch
from kv_assembler import KVAssembler
from vlkv.common.handoff.compact_kv import CompactKV
from vlkv.common.handoff.wire import KVWireError, encode_compact_kv
from vlkv.v1 import generate_pb2, kv_pb2

FP = "0123456789abcdef"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
H, D = 2, 8


def make_ckv(dtype: torch.dtype, lengths: list[int], m: int | None = None, seed: int = 0) -> CompactKV:
    """Random cache with ``[H, k_l, D]`` layers; values include NaN/inf-free random bit patterns."""
    g = torch.Generator().manual_seed(seed)
    m = m or max(lengths)
    keys = [torch.randn(H, k, D, generator=g).to(dtype) for k in lengths]
    values = [torch.randn(H, k, D, generator=g).to(dtype) for k in lengths]
    return CompactKV(keys, values, prompt_length=m, first_token=7)


def encode(ckv: CompactKV, chunk_bytes: int = 1 << 20, fingerprint: str = FP) -> list[kv_pb2.KVChunk]:
    return list(
        encode_compact_kv(
            ckv,
            request_id="req-1",
            fingerprint=fingerprint,
            sampling=generate_pb2.SamplingParams(max_new_tokens=5, temperature=0.5),
            eos_token_ids=[2, 3],
            prompt_tokens=ckv.prompt_length,
            vision_tokens=1,
            policy="vlcache",
            chunk_bytes=chunk_bytes,
        )
    )


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


class FakePool:
    """Counts blocks like the decode worker's pool: one block per layer per sequence."""

    def __init__(self, blocks: int = 1000) -> None:
        self.total = self.free = blocks
        self.allocs = self.releases = 0
        self.live: set[int] = set()
        self._next = 0

    def allocate(self, header: kv_pb2.KVHeader) -> tuple[int, int]:
        need = len(header.layer_lengths)
        if need > self.free:
            raise KVWireError(grpc.StatusCode.RESOURCE_EXHAUSTED, "pool full")
        self.free -= need
        self.allocs += 1
        self._next += 1
        self.live.add(self._next)
        return self._next, need

    def release(self, handle: tuple[int, int]) -> None:
        assert handle[0] in self.live, "released twice or never allocated"
        self.live.remove(handle[0])
        self.free += handle[1]
        self.releases += 1

    def assembler(self, ckv_or_layout: CompactKV | tuple, fingerprint: str = FP, **kw) -> KVAssembler:
        if isinstance(ckv_or_layout, CompactKV):
            c = ckv_or_layout
            layout = (c.num_layers, c.num_kv_heads, c.head_dim, c.dtype)
        else:
            layout = ckv_or_layout
        return KVAssembler(fingerprint, layout, allocate=self.allocate, release=self.release, **kw)


def feed_all(pool: FakePool, ckv, chunks, **kw):
    """Feed ``chunks`` to a fresh assembler of ``pool`` for ``ckv``; what ``finish`` returns."""
    asm = pool.assembler(ckv, **kw)
    for c in chunks:
        asm.feed(c)
    return asm.finish()
