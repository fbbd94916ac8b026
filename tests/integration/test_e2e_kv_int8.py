"""``--kv-dtype int8`` through the real workers: gateway, prefill worker (quantizes after token selection),
the hand-off (gRPC and NIXL), the decode worker's int8 pool and paged attention, on a tiny random LLaVA.

The served greedy tokens equal the in-process engine's with the same kv dtype (the same quantization at
the same point), usage counts the int8 bytes, and every block comes back. (With ``fp16`` nothing changes:
``test_e2e_equality.py`` still compares the served tokens with ``model.generate()``.)
"""

from __future__ import annotations

import urllib.request

import pytest
import torch
from inproc_cluster import InProcCluster
from sample_images import random_png
from vlkv.common.compression.registry import CompressionSettings
from vlkv.common.config import ModelConfig, PoolConfig, ServerConfig, TransferConfig
from vlkv.common.sampling import SamplingConfig
from vlkv.deploy.client import build_request, generate
from vlkv.deploy.inprocess import InProcessEngine
from vlkv.v1 import worker_pb2

MAX_NEW = 12
QUESTION = "what colour is the square ?"


@pytest.fixture(scope="module", params=["grpc", "nixl"])
def cluster(request, tiny_model_dirs):
    cfg = ServerConfig(
        model=ModelConfig(path=tiny_model_dirs("llava-gqa")),
        pool=PoolConfig(pool_bytes=8 << 20),
        transfer=TransferConfig(kv_transport=request.param, kv_dtype="int8"),
    )
    cluster = InProcCluster(cfg)
    cluster.transport = request.param
    yield cluster
    cluster.close()


def test_caches_go_over_the_cluster_transport(cluster):
    before = cluster.decode.servicer.receiver.received[cluster.transport]
    req = build_request(images=[random_png(4)], question=QUESTION, max_new_tokens=2)
    assert generate(cluster.stub, req, timeout=60).finished is not None
    assert cluster.decode.servicer.receiver.received[cluster.transport] == before + 1


@pytest.mark.parametrize("policy,budget", [("vlcache", 0.1), ("full", 1.0)])
def test_int8_greedy_tokens_through_the_workers(cluster, policy, budget):
    if cluster.transport == "nixl" and policy == "full":
        pytest.skip("one policy over NIXL is enough")
    engine = InProcessEngine(cluster.model, cluster.processor, pool_bytes=8 << 20, kv_dtype="int8")
    free_before = cluster.pool.num_free
    images = [random_png(3)]
    req = build_request(
        images=images, question=QUESTION, max_new_tokens=MAX_NEW, policy=policy, budget=budget
    )
    got = generate(cluster.stub, req, timeout=60)
    assert len(got.token_ids) >= 1
    sampling = SamplingConfig(max_new_tokens=MAX_NEW)
    want = engine.generate(
        images, question=QUESTION, sampling=sampling, compression=CompressionSettings(policy, budget)
    )
    assert got.token_ids == want.token_ids
    usage = got.finished.usage
    spec = engine.spec
    fp_token = 2 * spec.num_kv_heads * spec.head_dim * spec.dtype.itemsize
    assert usage.kv_bytes_full == spec.num_layers * usage.prompt_tokens * fp_token
    # int8 K/V: a token of a layer takes about a quarter of its fp32 bytes (plus its share of the scales)
    assert usage.kv_bytes_kept < 0.35 * sum(usage.layer_budgets) * fp_token
    assert cluster.pool.num_free == free_before


def test_status_reports_the_kv_dtype_and_block_bytes(cluster):
    load = cluster.run(cluster.decode.servicer.GetLoad(worker_pb2.LoadRequest(), None))
    cache = cluster.decode.servicer.kv_cache
    assert load.kv_dtype == "int8" and load.block_bytes == cache.block_bytes
    assert cache.k.dtype.itemsize == 1


def test_vlkv_status_and_metrics_show_the_kv_dtype_and_bytes(cluster, capsys):
    from prometheus_client.utils import floatToGoString
    from vlkv.deploy.cli.main import main
    from vlkv.services.metrics import serve_metrics

    if cluster.transport != "grpc":
        pytest.skip("once is enough")
    assert main(["status", "--address", cluster.gateway.address]) == 0  # polls the loads metrics export
    decode = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("decode"))
    cache = cluster.decode.servicer.kv_cache
    total_mib = cache.num_blocks * cache.block_bytes / (1 << 20)
    assert f" int8 0/{total_mib:.0f}MiB" in decode
    servicer = cluster.gateway.servicer
    http = serve_metrics(servicer.metrics, 0)
    try:
        body = (
            urllib.request.urlopen(f"http://127.0.0.1:{http.server_port}/metrics", timeout=10).read().decode()
        )
    finally:
        http.shutdown()
    want = f'kv_dtype="int8",state="total"}} {floatToGoString(cache.num_blocks * cache.block_bytes)}'
    assert "vlkv_decode_kv_bytes{" in body and want in body


def test_decode_recompression_through_the_workers(tiny_model_dirs):
    """``--decode-budget`` on a real decode worker (int8 pool, gRPC hand-off): the served tokens are the
    in-process engine's with the same options, layers were cut back while decoding, every block returns."""
    pool = PoolConfig(pool_bytes=8 << 20, block_size=4, decode_budget=0.5, decode_window=4)
    cfg = ServerConfig(
        model=ModelConfig(path=tiny_model_dirs("llava-gqa")),
        pool=pool,
        transfer=TransferConfig(kv_transport="grpc", kv_dtype="int8"),
    )
    cluster = InProcCluster(cfg)
    try:
        free_before = cluster.pool.num_free
        images = [random_png(5)]
        req = build_request(images=images, question=QUESTION, max_new_tokens=48, policy="vlcache", budget=0.3)
        core = cluster.decode.servicer.engine.core
        engine = InProcessEngine(
            cluster.model, cluster.processor, pool_bytes=8 << 20, block_size=4, kv_dtype="int8",
            decode_budget=0.5, decode_window=4,
        )  # fmt: skip
        seeds = {"served": [], "local": []}  # the prompt-time scores each decode core started from
        for name, c in (("served", core), ("local", engine.core)):
            c.seed = lambda seq, scores, _c=c, _n=name: (
                seeds[_n].append(scores),
                type(_c).seed(_c, seq, scores),
            )
        got = generate(cluster.stub, req, timeout=60)
        want = engine.generate(
            images,
            question=QUESTION,
            sampling=SamplingConfig(max_new_tokens=48),
            compression=CompressionSettings("vlcache", 0.3),
        )
        assert got.token_ids == want.token_ids
        (served,), (local,) = seeds["served"], seeds["local"]
        assert local is not None and all(torch.equal(a, b) for a, b in zip(served, local, strict=True))
        assert core.evicted_tokens == engine.core.evicted_tokens
        if len(got.token_ids) >= 16:  # long enough that some layer outgrew its budget by a block
            assert core.evicted_tokens > 0
        assert cluster.pool.num_free == free_before
    finally:
        cluster.close()
