"""Three gateways over the same prefill and decode workers (real servers, real gRPC): each routes on the
workers' pushed load plus its own reservations; races for a small pool end in refusals and re-queues,
never in a lost request."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from inproc_cluster import InProcCluster
from sample_images import random_png
from vlkv.common.config import ModelConfig, PoolConfig, QueueConfig, ServerConfig
from vlkv.deploy.client import build_request, generate
from vlkv.deploy.servers import start_decode_worker, start_gateway
from vlkv.v1 import generate_pb2_grpc

GATEWAYS = 3
REQUESTS = 18


@pytest.fixture(scope="module")
def cluster(tiny_model_dirs):
    cfg = ServerConfig(
        model=ModelConfig(path=tiny_model_dirs("llava-gqa")),
        pool=PoolConfig(pool_bytes=96 << 10, max_batch=4),  # room for a few requests per worker at once
        queue=QueueConfig(admit_wait_s=60.0),
    )
    c = InProcCluster(cfg, client=False)
    c.second = c.run(start_decode_worker(cfg, model=c.model, tokenizer=c.processor.tokenizer))
    c.prefill.servicer.allow_decode(c.second.address)
    decode = [c.decode.address, c.second.address]
    c.gateways = [c.gateway] + [
        c.run(start_gateway(cfg, [c.prefill.address], decode, processor=c.processor))
        for _ in range(GATEWAYS - 1)
    ]
    c.run(_add(c.gateway.servicer.router, decode[1:]))
    yield c
    for g in c.gateways[1:]:
        c.run(g.stop())
    c.run(c.second.stop())
    c.close()


async def _add(router, decode: list[str]) -> None:
    for a in decode:
        router.add_decode(a)


def test_three_gateways_lose_no_request(cluster):
    channels = [grpc.insecure_channel(g.address) for g in cluster.gateways]
    stubs = [generate_pb2_grpc.GenerationStub(ch) for ch in channels]

    def one(i: int):
        req = build_request(images=[random_png(i)], question="what colour is the square ?", max_new_tokens=24)
        return generate(stubs[i % GATEWAYS], req, timeout=120)

    try:
        with ThreadPoolExecutor(REQUESTS) as pool:
            results = list(pool.map(one, range(REQUESTS)))
    finally:
        for ch in channels:
            ch.close()
    assert all(r.finished is not None and r.token_ids for r in results)
    routers = [g.servicer.router for g in cluster.gateways]
    # every gateway routed on pushed reports of both pools (the workers' WatchLoad streams)
    deadline = time.time() + 3  # promises settle with each worker's next load report (at least every 1 s)
    while time.time() < deadline and any(w.promised for r in routers for w in r.decode.values()):
        time.sleep(0.02)
    for router in routers:
        assert all(w.load_at > float("-inf") and not w.polled for w in router.decode.values())
        assert all(w.load_at > float("-inf") and not w.polled for w in router.prefill.values())
        assert router.num_queued == 0 and all(w.promised == 0 for w in router.decode.values())
    # every block came back
    assert cluster.pool.num_free == cluster.pool.num_blocks
    assert cluster.second.servicer.pool.num_free == cluster.second.servicer.pool.num_blocks
