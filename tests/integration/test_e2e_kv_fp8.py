"""``--kv-dtype fp8`` through the real workers (``common/handoff/quantize.py``: E4M3 codes with KIVI's scales):
the prefill worker quantizes after token selection, the gRPC hand-off, the decode worker's fp8 pool, appends
and paged attention, on a tiny random LLaVA. The served greedy tokens equal the in-process engine's with the
same format, and every block comes back. (The format itself: tests/unit/test_kv_fp8.py.)"""

from __future__ import annotations

from inproc_cluster import InProcCluster
from sample_images import random_png
from vlkv.common.compression.registry import CompressionSettings
from vlkv.common.config import ModelConfig, PoolConfig, ServerConfig, TransferConfig
from vlkv.common.sampling import SamplingConfig
from vlkv.deploy.client import build_request, generate
from vlkv.deploy.inprocess import InProcessEngine


def test_fp8_greedy_tokens_through_the_workers(tiny_model_dirs):
    """The served tokens (prefill quantizes to E4M3, gRPC hand-off, fp8 pool, appends and paged attention)
    equal the in-process engine's with the same format; every block comes back."""
    cfg = ServerConfig(
        model=ModelConfig(path=tiny_model_dirs("llava-gqa")),
        pool=PoolConfig(pool_bytes=8 << 20),
        transfer=TransferConfig(kv_transport="grpc", kv_dtype="fp8"),
    )
    cluster = InProcCluster(cfg)
    try:
        free_before = cluster.pool.num_free
        images, question = [random_png(3)], "what colour is the square ?"
        settings = CompressionSettings("vlcache", 0.1)
        req = build_request(images=images, question=question, max_new_tokens=12, policy="vlcache", budget=0.1)
        got = generate(cluster.stub, req, timeout=60)
        sampling = SamplingConfig(max_new_tokens=12)
        want = {
            fmt: InProcessEngine(cluster.model, cluster.processor, pool_bytes=8 << 20, kv_dtype=fmt)
            .generate(images, question=question, sampling=sampling, compression=settings)
            .token_ids
            for fmt in ("fp8", "int8")
        }
        assert got.token_ids == want["fp8"] and len(got.token_ids) >= 1
        assert cluster.pool.num_free == free_before
    finally:
        cluster.close()
