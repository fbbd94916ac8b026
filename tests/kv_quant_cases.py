"""8-bit compact caches for the KV storage-format tests (int8 and fp8): a float cache to quantize, a quantized pool
holding random sequences with their float originals, and exact attention over those originals."""

from __future__ import annotations

import math

import torch
from vlkv.common.handoff.compact_kv import CompactKV
from vlkv.common.handoff.quantize import quantize_k, quantize_v
from vlkv.decode_worker.kv_cache import KVCache

H, D = 2, 16
LENGTHS = [1, 3, 4, 9]
LAYOUT = (len(LENGTHS), H, D, torch.float32)


def float_cache(seed: int = 0, dtype=torch.float32) -> CompactKV:
    g = torch.Generator().manual_seed(seed)
    keys = [(torch.randn(H, n, D, generator=g) * torch.linspace(0.1, 8, D)).to(dtype) for n in LENGTHS]
    values = [torch.randn(H, n, D, generator=g).to(dtype) for n in LENGTHS]
    return CompactKV(keys, values, prompt_length=12, first_token=5)


def int8_case(lengths, n_heads, n_kv, dim, page, seed=0, kv_dtype="int8"):
    """An 8-bit pool (int8, or fp8 E4M3) holding each sequence's quantized cache, its float original, a
    table and queries."""
    g = torch.Generator().manual_seed(seed)
    n_blocks = sum(math.ceil(n / page) for n in lengths) + 3
    cache = KVCache(n_blocks, page, n_kv, dim, torch.float32, kv_dtype=kv_dtype)
    order = torch.randperm(n_blocks, generator=g).tolist()
    width = max(math.ceil(n / page) for n in lengths)
    table = torch.full((len(lengths), width), -1, dtype=torch.int32)
    originals = []
    for s, n in enumerate(lengths):
        ids = [order.pop() for _ in range(math.ceil(n / page))]
        table[s, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        k = torch.randn(n_kv, n, dim, generator=g) * torch.linspace(0.2, 3, dim)
        v = torch.randn(n_kv, n, dim, generator=g)
        (qk, sk), (qv, sv) = quantize_k(k, kv_dtype), quantize_v(v, kv_dtype)
        cache.write(ids, qk, qv, sk, sv)
        originals.append((k, v))
    q = torch.randn(len(lengths), n_heads, dim, generator=g)
    return cache, table, torch.tensor(lengths, dtype=torch.int32), q, originals


def exact(q, originals, scale):
    out = []
    for s, (k, v) in enumerate(originals):
        group = q.shape[1] // k.shape[0]
        kk, vv = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        p = torch.softmax(torch.einsum("hd,hnd->hn", q[s], kk) * scale, -1)
        out.append(torch.einsum("hn,hnd->hd", p, vv))
    return torch.stack(out)
