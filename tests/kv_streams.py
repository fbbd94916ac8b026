"""A cache's KV chunks addressed to a cluster's decode worker (its layout and fingerprint), as a prefill worker
would send them; the hand-off tests feed them to TransferKV straight, whole or spoiled."""

from __future__ import annotations

import torch
from vlkv.common.handoff.compact_kv import CompactKV
from vlkv.common.handoff.wire import encode_compact_kv
from vlkv.v1 import generate_pb2


def kv_stream(cluster, rid: str, m: int = 20, fingerprint: str | None = None, chunk_bytes: int = 4096):
    servicer = cluster.decode.servicer
    layers, kv_heads, head_dim, dtype = servicer.layout
    g = torch.Generator().manual_seed(0)
    lengths = [m, max(1, m // 2), 3][:layers] + [m] * max(0, layers - 3)
    keys = [torch.randn(kv_heads, n, head_dim, generator=g, dtype=dtype) for n in lengths]
    values = [torch.randn(kv_heads, n, head_dim, generator=g, dtype=dtype) for n in lengths]
    ckv = CompactKV(keys, values, prompt_length=m, first_token=5)
    return list(
        encode_compact_kv(
            ckv,
            request_id=rid,
            fingerprint=fingerprint or servicer.fingerprint,
            sampling=generate_pb2.SamplingParams(max_new_tokens=4, temperature=0.0, top_p=1.0, seed=1),
            eos_token_ids=[2],
            prompt_tokens=m,
            policy="vlcache",
            chunk_bytes=chunk_bytes,
        )
    )
