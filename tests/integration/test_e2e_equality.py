"""With compression off, the disaggregated path's greedy tokens equal ``model.generate()`` on the same input.

Runs the gateway, a prefill worker and a decode worker in-process with real gRPC between them, on random
tiny LLaVA and LLaVA-NeXT checkpoints (GQA and MHA), with one and with two images. The in-process engine
(``deploy/inprocess.py``) is the same pipeline without gRPC: with a full cache it gives ``generate()``'s
tokens too, and with a 10% VL-Cache the served tokens, text and usage.
"""

from __future__ import annotations

import pytest
from generate_reference import MAX_NEW, reference_tokens
from inproc_cluster import InProcCluster
from sample_images import random_png
from tiny_models import TINY_VARIANTS
from vlkv.common.compression.registry import CompressionSettings
from vlkv.common.config import ModelConfig, PoolConfig, ServerConfig, TransferConfig
from vlkv.common.sampling import SamplingConfig
from vlkv.deploy.client import build_request, generate
from vlkv.deploy.inprocess import InProcessEngine

# Every variant hands its caches over NIXL (one-sided writes into the decode pool); one also over gRPC.
CASES = [(v, "nixl") for v in TINY_VARIANTS] + [("llava-gqa", "grpc")]


@pytest.fixture(scope="module", params=CASES, ids=[f"{v}-{t}" for v, t in CASES])
def cluster(request, tiny_model_dirs):
    variant, transport = request.param
    cfg = ServerConfig(
        model=ModelConfig(path=tiny_model_dirs(variant)),
        pool=PoolConfig(pool_bytes=8 << 20),
        transfer=TransferConfig(kv_transport=transport),
    )
    cluster = InProcCluster(cfg)
    cluster.variant, cluster.transport = variant, transport
    yield cluster
    cluster.close()


def test_hand_offs_go_over_the_cluster_transport(cluster):
    """Whatever else ran, a request served through the gateway hands its cache over this cluster's
    transport, and no hand-off used another."""
    before = dict(cluster.decode.servicer.receiver.received)
    req = build_request(images=[random_png(5)], question="what colour is the square ?", max_new_tokens=2)
    assert generate(cluster.stub, req, timeout=60).finished is not None
    received = cluster.decode.servicer.receiver.received
    assert received[cluster.transport] == before.get(cluster.transport, 0) + 1, received
    assert sum(received.values()) == received[cluster.transport], received


def test_full_cache_tokens_equal_generate(cluster):
    variant = cluster.variant
    free_before = cluster.pool.num_free
    for n_images in (1, 2):
        images = [random_png(10 * n_images + i) for i in range(n_images)]
        question = "what colour is the square ?"
        req = build_request(images=images, question=question, max_new_tokens=MAX_NEW, policy="full")
        got = generate(cluster.stub, req, timeout=60)
        want = reference_tokens(cluster, images, question)
        assert got.token_ids == want, f"{variant} with {n_images} image(s)"
        usage = got.finished.usage
        assert usage.generated_tokens >= len(want)
        assert usage.kv_bytes_kept == usage.kv_bytes_full > 0
        assert usage.vision_tokens > 0 and usage.prompt_tokens > usage.vision_tokens
    assert cluster.pool.num_free == free_before


def test_inprocess_engine_is_the_served_pipeline(cluster):
    if cluster.transport != "nixl":
        pytest.skip("the in-process engine has no hand-off: once per variant is enough")
    engine = InProcessEngine(cluster.model, cluster.processor, pool_bytes=8 << 20)
    free_before = engine.blocks.num_free
    sampling = SamplingConfig(max_new_tokens=MAX_NEW)
    question = "what colour is the square ?"
    vlcache = CompressionSettings("vlcache", 0.1)
    requests, served = [], []
    for n_images in (1, 2):
        images = [random_png(10 * n_images + i) for i in range(n_images)]
        full = engine.generate(
            images, question=question, sampling=sampling, compression=CompressionSettings("full")
        )
        assert full.token_ids == reference_tokens(cluster, images, question), f"{n_images} image(s)"
        assert full.kv_bytes_kept == full.kv_bytes_full > 0

        req = build_request(
            images=images, question=question, max_new_tokens=MAX_NEW, policy="vlcache", budget=0.1
        )
        want = generate(cluster.stub, req, timeout=60)
        got = engine.generate(images, question=question, sampling=sampling, compression=vlcache)
        assert got.token_ids == want.token_ids, f"{cluster.variant} with {n_images} image(s)"
        assert got.text == want.text
        usage = want.finished.usage
        assert got.generated_tokens == usage.generated_tokens
        assert (got.prompt_tokens, got.vision_tokens) == (usage.prompt_tokens, usage.vision_tokens)
        assert (got.kv_bytes_kept, got.kv_bytes_full) == (usage.kv_bytes_kept, usage.kv_bytes_full)
        assert got.kv_bytes_kept < got.kv_bytes_full
        assert got.layer_budgets == list(usage.layer_budgets) and got.policy == usage.policy
        assert got.finish_reason == {1: "length", 2: "eos", 3: "stop"}[want.finished.reason]
        requests.append(engine.prepare(images, question=question, sampling=sampling, compression=vlcache))
        served.append(want.token_ids)
    # Both requests in one continuous batch decode as they do alone.
    assert [g.token_ids for g in engine.generate_batch(requests)] == served
    assert engine.blocks.num_free == free_before


def test_inprocess_batch_in_a_small_pool_decodes_as_alone(cluster):
    """Sampled requests through a pool too small for all of them at once: preempted sequences swap out
    and back bit for bit, so each gets the tokens it gets alone; every block comes back."""
    if cluster.transport != "nixl":
        pytest.skip("the in-process engine has no hand-off: once per variant is enough")
    proc = cluster.processor
    engine = InProcessEngine(cluster.model, proc, pool_bytes=8 << 20)
    requests = [
        engine.prepare(
            [random_png(i)],
            question="what colour is the square ?",
            sampling=SamplingConfig(max_new_tokens=40, temperature=1.0, seed=i),
            compression=CompressionSettings("full"),
        )
        for i in range(12)
    ]
    alone = [engine.generate_batch([r])[0].token_ids for r in requests]
    prompt_blocks = engine.blocks.blocks_needed([requests[0].m] * engine.spec.num_layers, 0)
    small = InProcessEngine(cluster.model, proc, pool_bytes=3 * prompt_blocks * engine.cache.block_bytes)
    free_before = small.blocks.num_free
    assert [g.token_ids for g in small.generate_batch(requests)] == alone
    assert small.core.scheduler.preemptions > 0
    assert small.blocks.num_free == free_before
