"""The Ray deployment path: workers placed as Ray actors (separate processes), gateway in this process."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest
import ray
from sample_images import random_png
from vlkv.common.config import ModelConfig, PoolConfig, ServerConfig
from vlkv.common.grpc_server import make_sync_channel
from vlkv.deploy.autoscaler import PoolSpec
from vlkv.deploy.client import build_request, connect, generate
from vlkv.deploy.local import LocalCluster, init_ray
from vlkv.v1 import worker_pb2, worker_pb2_grpc


@pytest.fixture(scope="module")
def cluster(tiny_model_dirs):
    cfg = ServerConfig(
        model=ModelConfig(path=tiny_model_dirs("llava-gqa")), pool=PoolConfig(pool_bytes=4 << 20)
    )
    init_ray(num_cpus=2)
    c = LocalCluster(cfg, prefill=PoolSpec(cpus=0.5), decode=PoolSpec(cpus=0.5))
    loop = asyncio.new_event_loop()  # the gateway serves from this loop, on a background thread
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(c.start(), loop).result(300)
    yield c, loop
    asyncio.run_coroutine_threadsafe(c.stop(), loop).result(120)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    ray.shutdown()


def test_request_through_ray_placed_workers(cluster):
    c, loop = cluster
    channel, stub = connect(c.address)
    try:
        images = [random_png(1), random_png(2)]
        full = generate(
            stub,
            build_request(
                images=images, question="what colour is the square ?", max_new_tokens=5, policy="full"
            ),
            timeout=120,
        )
        assert full.finished.usage.generated_tokens >= 1
        comp = generate(
            stub,
            build_request(
                images=images, question="what colour is the square ?", max_new_tokens=5, budget=0.2
            ),
            timeout=120,
        )
        assert comp.finished.usage.compression_ratio < 0.5
        assert comp.token_ids[0] == full.token_ids[0]
    finally:
        channel.close()


def test_workers_are_separate_processes_and_pools_return(cluster):
    c, loop = cluster

    pids = ray.get([r.actor.__ray_call__.remote(lambda self: os.getpid()) for r in c.autoscaler.replicas])
    assert len(set(pids)) == 2 and os.getpid() not in pids
    decode = [r.address for r in c.autoscaler.replicas if r.kind == "decode"]
    with make_sync_channel(decode[0], c.cfg.security) as ch:
        load = worker_pb2_grpc.DecodeWorkerStub(ch).GetLoad(worker_pb2.LoadRequest(), timeout=10)
    assert load.free_blocks == load.total_blocks > 0
    assert load.running == 0


def test_pools_ray_cannot_place_are_refused_before_any_worker_starts(cluster, tiny_model_dirs):
    """`vlkv serve --prefill 3 --decode 1` on a 2-CPU Ray: refused at once, naming the CPUs and the flags."""
    from vlkv.common.errors import ConfigError

    cfg = ServerConfig(
        model=ModelConfig(path=tiny_model_dirs("llava-gqa")), pool=PoolConfig(pool_bytes=4 << 20)
    )
    big = LocalCluster(cfg, prefill=PoolSpec(min_replicas=3, max_replicas=3), decode=PoolSpec())
    with pytest.raises(ConfigError, match=r"4 CPU .*3 prefill x 1 \+ 1 decode x 1.*has 2.*--worker-cpus"):
        asyncio.run(big.start())
    assert big.gateway is None and big.autoscaler is None and big._prefill_actors == []
