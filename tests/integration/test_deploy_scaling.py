"""Autoscaling and failure handling on a real local Ray (CPU): burst scale-up/down, a decode worker killed."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest
import ray
from sample_images import random_png
from vlkv.common.config import ModelConfig, PoolConfig, ServerConfig
from vlkv.common.grpc_server import make_sync_channel
from vlkv.deploy.autoscaler import PoolSpec
from vlkv.deploy.client import build_request, connect, generate
from vlkv.deploy.local import LocalCluster, init_ray
from vlkv.v1 import admin_pb2, admin_pb2_grpc, worker_pb2, worker_pb2_grpc

Q = "what colour is the square ?"


@pytest.fixture(scope="module")
def cluster(tiny_model_dirs):
    cfg = ServerConfig(
        model=ModelConfig(path=tiny_model_dirs("llava-gqa")), pool=PoolConfig(pool_bytes=4 << 20)
    )
    init_ray(num_cpus=2)
    c = LocalCluster(
        cfg,
        prefill=PoolSpec(min_replicas=1, max_replicas=2, target=1.0, cpus=0.25),
        decode=PoolSpec(min_replicas=2, max_replicas=2, cpus=0.25),
        interval_s=0.25,
        downscale_delay_s=2.0,
    )
    loop = asyncio.new_event_loop()  # the gateway and autoscaler run on this loop, on a background thread
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(c.start(), loop).result(300)
    yield c
    asyncio.run_coroutine_threadsafe(c.stop(), loop).result(120)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    ray.shutdown()


def _status(c) -> admin_pb2.ClusterStatus:
    with grpc.insecure_channel(c.address) as ch:
        return admin_pb2_grpc.AdminStub(ch).GetStatus(admin_pb2.StatusRequest(), timeout=10)


def _wait(pred, timeout: float) -> bool:
    end = time.time() + timeout
    while time.time() < end:
        try:
            if pred():
                return True
        except grpc.RpcError as exc:  # a status poll that ran out of time on a loaded host: not yet
            if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                raise
        time.sleep(0.1)
    return False


def test_burst_grows_prefill_pool_to_max_and_shrinks_back(cluster):
    timeline: list[tuple[float, int]] = []
    results: list[object] = []
    stop = threading.Event()
    t0 = time.time()

    def client(i: int) -> None:
        channel, stub = connect(cluster.address)
        n = 0
        while not stop.is_set():
            req = build_request(prompt="red blue green " * 60, max_new_tokens=2, seed=i, temperature=1.0)
            try:
                results.append(generate(stub, req, timeout=120))
            except grpc.RpcError as exc:
                results.append(exc)
            n += 1
        channel.close()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    grew = _wait(
        lambda: (
            timeline.append((time.time() - t0, cluster.replica_count("prefill")))
            or cluster.replica_count("prefill") == 2
        ),
        90,
    )
    end_burst = time.time() + 3  # keep the burst going on the grown pool for a moment
    while time.time() < end_burst:
        timeline.append((time.time() - t0, cluster.replica_count("prefill")))
        time.sleep(0.2)
    stop.set()
    for t in threads:
        t.join(120)
    shrank = _wait(
        lambda: (
            timeline.append((time.time() - t0, cluster.replica_count("prefill")))
            or cluster.replica_count("prefill") == 1
        ),
        60,
    )
    changes = [timeline[0]] + [b for a, b in zip(timeline, timeline[1:], strict=False) if a[1] != b[1]]
    print("prefill replicas over time (s, replicas):", changes)
    print("events:", [(e.kind, e.action, e.replicas, e.reason) for e in _status(cluster).events])
    assert grew and shrank
    errors = [r for r in results if isinstance(r, Exception)]
    assert not errors, errors[:3]
    assert len(results) >= 8 and all(r.finished is not None for r in results)


def test_decode_worker_killed_mid_stream(cluster):
    channel, stub = connect(cluster.address)
    call = stub.Generate(build_request(images=[random_png(3)], question=Q, max_new_tokens=900), timeout=120)
    seen = 0
    victim = None
    with pytest.raises(grpc.RpcError) as err:
        for resp in call:
            seen += resp.HasField("token")
            if seen == 3 and victim is None:
                victim = next(w for w in _status(cluster).workers if w.kind == "decode" and w.in_flight == 1)
                replica = next(r for r in cluster.autoscaler.replicas if r.address == victim.address)
                ray.kill(replica.actor)
    channel.close()
    assert victim is not None
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "decode worker failed" in err.value.details() and victim.address not in err.value.details()
    # the dead worker leaves the routing table and a replacement comes up; no block stays allocated anywhere
    assert _wait(
        lambda: (
            sum(1 for w in _status(cluster).workers if w.kind == "decode" and w.state == "serving") == 2
            and all(w.address != victim.address for w in _status(cluster).workers)
        ),
        90,
    )
    for w in _status(cluster).workers:
        if w.kind == "decode":
            with make_sync_channel(w.address, cluster.cfg.security) as ch:
                load = worker_pb2_grpc.DecodeWorkerStub(ch).GetLoad(worker_pb2.LoadRequest(), timeout=10)
            assert load.free_blocks == load.total_blocks
    channel, stub = connect(cluster.address)
    assert generate(stub, build_request(images=[random_png(4)], question=Q, max_new_tokens=4)).finished
    channel.close()
