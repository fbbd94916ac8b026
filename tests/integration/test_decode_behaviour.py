"""Decode-side behaviour through the whole path: seeds, stop strings, batching, cancellation."""

from __future__ import annotations

import threading
import time

import pytest
from inproc_cluster import InProcCluster
from sample_images import random_png
from vlkv.common.config import ModelConfig, PoolConfig, ServerConfig
from vlkv.deploy.client import build_request, generate
from vlkv.v1 import generate_pb2

Q = "what colour is the square ?"


@pytest.fixture(scope="module")
def cluster(tiny_model_dirs):
    model = ModelConfig(path=tiny_model_dirs("llava-gqa"))
    c = InProcCluster(ServerConfig(model=model, pool=PoolConfig(pool_bytes=4 << 20, max_batch=8)))
    yield c
    c.close()


def _req(seed=None, temperature=None, max_new=12, stop=(), image=1, **kw):
    return build_request(
        images=[random_png(image)],
        question=Q,
        max_new_tokens=max_new,
        seed=seed,
        temperature=temperature,
        stop=list(stop),
        **kw,
    )


def test_same_seed_same_tokens(cluster):
    a = generate(cluster.stub, _req(seed=7, temperature=1.5, top_k=20))
    b = generate(cluster.stub, _req(seed=7, temperature=1.5, top_k=20))
    c = generate(cluster.stub, _req(seed=8, temperature=1.5, top_k=20))
    assert a.token_ids == b.token_ids
    assert len(a.token_ids) >= 6 and a.token_ids != c.token_ids  # sampled on (no early EOS), seeds differ


def test_stop_string_ends_stream_without_it(cluster):
    free = cluster.pool.num_free
    base = generate(cluster.stub, _req(seed=3, temperature=2.0))
    words = base.text.split()
    assert len(words) >= 4
    stop = words[2]
    out = generate(cluster.stub, _req(seed=3, temperature=2.0, stop=[stop]))
    assert out.finished.reason == generate_pb2.FINISH_REASON_STOP_STRING
    assert stop not in out.text
    assert base.text.startswith(out.text)
    assert cluster.pool.num_free == free


def test_alone_and_in_busy_batch_give_same_tokens(cluster):
    alone = generate(cluster.stub, _req(image=5, max_new=10))
    results = {}

    def run(i):
        results[i] = generate(cluster.stub, _req(image=i, max_new=10 + i, seed=i, temperature=1.0))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(10, 16)]
    for t in threads:
        t.start()
    time.sleep(0.05)
    busy = generate(cluster.stub, _req(image=5, max_new=10))
    for t in threads:
        t.join()
    assert busy.token_ids == alone.token_ids
    assert len(results) == 6


def test_cancel_mid_stream_frees_blocks(cluster):
    free = cluster.pool.num_free
    assert len(generate(cluster.stub, _req(max_new=200)).token_ids) == 200  # greedy: no early EOS
    call = cluster.stub.Generate(_req(max_new=200))
    got = 0
    for resp in call:
        got += resp.HasField("token")
        if got == 3:
            assert cluster.pool.num_free < free  # the sequence holds its blocks mid-stream
            call.cancel()
            break
    deadline = time.time() + 10
    while cluster.pool.num_free != free and time.time() < deadline:
        time.sleep(0.05)
    assert cluster.pool.num_free == free
    assert generate(cluster.stub, _req(max_new=3)).finished is not None
