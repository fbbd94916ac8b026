"""Admission "grow": caches take blocks for their tokens only, grow while decoding, and the newest sequence
is preempted (swapped to host memory) when the pool runs out; it resumes and yields the same tokens."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest
import torch
from inproc_cluster import InProcCluster
from sample_images import random_png
from vlkv.common.config import ModelConfig, PoolConfig, QueueConfig, ServerConfig
from vlkv.common.handoff.wire import KVWireError, encode_header
from vlkv.common.model.loading import load_model, load_processor
from vlkv.common.sampling import SamplingConfig
from vlkv.decode_worker.block_manager import BlockManager
from vlkv.decode_worker.core import DecodeCore
from vlkv.decode_worker.detokenizer import IncrementalText
from vlkv.decode_worker.engine import DecodeEngine
from vlkv.decode_worker.kv_cache import KVCache
from vlkv.decode_worker.model_runner import ModelRunner
from vlkv.decode_worker.sequence import Sequence
from vlkv.deploy.client import build_request, generate
from vlkv.v1 import generate_pb2, worker_pb2

BLOCK_BYTES = 1024  # the tiny GQA model: K and V, 2 KV heads, 4 tokens, head dim 16, fp32
POOL_BLOCKS = 60  # a full-cache prompt (27 tokens, 2 layers) takes 14 blocks, 34 with 40 new tokens
MAX_NEW = 40


def _req(i: int):
    return build_request(
        images=[random_png(i)], question="what colour is the square ?", max_new_tokens=MAX_NEW, policy="full"
    )


def _cluster(model_dir: str, max_waiting: int = 256, **pool) -> InProcCluster:
    cfg = PoolConfig(pool_bytes=POOL_BLOCKS * BLOCK_BYTES, block_size=4, **pool)
    queue = QueueConfig(max_waiting=max_waiting)
    c = InProcCluster(ServerConfig(model=ModelConfig(path=model_dir), pool=cfg, queue=queue))
    assert c.pool.num_blocks == POOL_BLOCKS and c.decode.servicer.kv_cache.block_bytes == BLOCK_BYTES
    return c


@pytest.fixture(scope="module")
def solo(tiny_model_dirs):
    """Each request decoded alone in a roomy pool."""
    c = InProcCluster(ServerConfig(model=ModelConfig(path=tiny_model_dirs("llava-gqa"))))
    try:
        yield {i: generate(c.stub, _req(i)).token_ids for i in range(4)}
    finally:
        c.close()


def _run_staggered(c: InProcCluster, ids: list[int]) -> dict:
    """Start each request once the previous one streams, so every cache is admitted before any grows."""
    results: dict = {}

    def run(i: int, started: threading.Event) -> None:
        try:
            out = []
            for resp in c.stub.Generate(_req(i)):
                started.set()
                if resp.HasField("token"):
                    out.extend(resp.token.token_ids)
            results[i] = out
        except grpc.RpcError as exc:
            results[i] = exc.code()
        finally:
            started.set()

    threads = []
    for i in ids:
        started = threading.Event()
        t = threading.Thread(target=run, args=(i, started))
        t.start()
        threads.append(t)
        started.wait(30)
    for t in threads:
        t.join(120)
    return results


def _load(c: InProcCluster) -> worker_pb2.WorkerLoad:
    return c.run(c.decode.servicer.GetLoad(worker_pb2.LoadRequest(), None))


def _engine_run(model, tokenizer, pool_blocks: int, swap_bytes: int, n_seqs: int = 4) -> tuple[dict, object]:
    """Submit ``n_seqs`` random full caches (27 tokens per layer) at once and decode them greedily."""
    pool, cache = BlockManager(pool_blocks, 4), KVCache(pool_blocks, 4, num_kv_heads=2, head_dim=16)
    engine = DecodeEngine(
        DecodeCore(ModelRunner(model, cache), pool, cache, max_batch=8, swap_bytes=swap_bytes)
    )
    g = torch.Generator().manual_seed(0)

    async def main():
        engine.start()
        seqs = []
        for i in range(n_seqs):
            blocks = pool.allocate([27, 27], 0)
            assert blocks is not None
            for table in blocks.tables:
                cache.write(table, torch.randn(2, 27, 16, generator=g), torch.randn(2, 27, 16, generator=g))
            seq = Sequence(
                f"r{i}", blocks, [27, 27], 27, 3 + i, SamplingConfig(max_new_tokens=MAX_NEW),
                detok=IncrementalText(tokenizer, []),
            )  # fmt: skip
            seqs.append((seq, engine.submit(seq)))
        out = {}
        for seq, outputs in seqs:
            while await outputs.get() is not None:
                pass
            out[seq.request_id] = seq.generated if seq.error is None else seq.error.code
        await engine.stop()
        return out

    return asyncio.run(main()), engine


def test_preempted_sequences_resume_with_the_same_tokens(tiny_model_dirs):
    model_dir = tiny_model_dirs("llava-gqa")
    model = load_model(ModelConfig(path=model_dir))
    tokenizer = load_processor(model_dir).tokenizer
    roomy, big = _engine_run(model, tokenizer, pool_blocks=200, swap_bytes=0)
    assert big.preemptions == 0
    tight, small = _engine_run(model, tokenizer, pool_blocks=POOL_BLOCKS, swap_bytes=1 << 20)
    assert small.preemptions > 0  # 4 x 14 blocks admitted; together they grow to 4 x 34
    assert tight == roomy and all(len(t) == MAX_NEW for t in tight.values())
    assert small.blocks.num_free == POOL_BLOCKS and small.swap_used == 0 and not small.scheduler.swapped


def test_no_swap_space_fails_the_newest_sequence_only(tiny_model_dirs):
    model_dir = tiny_model_dirs("llava-gqa")
    model = load_model(ModelConfig(path=model_dir))
    tokenizer = load_processor(model_dir).tokenizer
    roomy, _ = _engine_run(model, tokenizer, pool_blocks=200, swap_bytes=0)
    tight, small = _engine_run(model, tokenizer, pool_blocks=POOL_BLOCKS, swap_bytes=1)
    failed = sorted(r for r, t in tight.items() if t == grpc.StatusCode.RESOURCE_EXHAUSTED)
    assert failed and "r0" not in failed  # the oldest is never the one preempted
    assert all(tight[r] == roomy[r] for r in tight if r not in failed)
    assert small.blocks.num_free == POOL_BLOCKS


def test_cluster_under_pool_pressure_answers_every_request(tiny_model_dirs, solo):
    c = _cluster(tiny_model_dirs("llava-gqa"), watermark=0.0)
    try:
        results = _run_staggered(c, [0, 1, 2, 3])
        assert {i: r for i, r in results.items() if not isinstance(r, list)} == {}
        assert results == solo
        deadline = time.time() + 10
        while c.pool.num_free != POOL_BLOCKS and time.time() < deadline:
            time.sleep(0.05)
        load = _load(c)
        assert load.free_blocks == POOL_BLOCKS and load.swapped == 0
        assert load.preemptions == c.decode.servicer.engine.preemptions and not load.reserves_new_tokens
    finally:
        c.close()


def test_reserve_mode_queues_at_the_gateway_and_never_preempts(tiny_model_dirs, solo):
    c = _cluster(tiny_model_dirs("llava-gqa"), admission="reserve")
    try:
        assert _load(c).reserves_new_tokens
        results = _run_staggered(c, [0, 1])  # 34 blocks each with max_new_tokens reserved: one at a time
        assert results == {0: solo[0], 1: solo[1]}
        assert c.decode.servicer.engine.preemptions == 0
    finally:
        c.close()


def test_simultaneous_requests_do_not_overcommit_a_worker(tiny_model_dirs, solo):
    """Room for one: the first request's promised blocks count against the worker until its cache
    arrives, so the second waits at the gateway instead of being refused at hand-off."""
    c = _cluster(tiny_model_dirs("llava-gqa"), admission="reserve")
    try:
        start, results = threading.Barrier(2), {}

        def run(i):
            start.wait()
            results[i] = generate(c.stub, _req(i)).token_ids

        threads = [threading.Thread(target=run, args=(i,)) for i in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert results == {0: solo[0], 1: solo[1]}
        metrics = c.gateway.servicer.metrics.registry
        assert metrics.get_sample_value("vlkv_hand_off_retries_total") == 0
        deadline = time.time() + 3  # promises settle with the worker's next load report (at least every 1 s)
        while time.time() < deadline and any(w.promised for w in c.gateway.servicer.router.decode.values()):
            time.sleep(0.02)
        assert all(w.promised == 0 for w in c.gateway.servicer.router.decode.values())
    finally:
        c.close()


def test_full_pool_without_a_queue_is_resource_exhausted(tiny_model_dirs, solo):
    c = _cluster(tiny_model_dirs("llava-gqa"), admission="reserve", max_waiting=0)
    try:
        results = _run_staggered(c, [0, 1])
        assert results == {0: solo[0], 1: grpc.StatusCode.RESOURCE_EXHAUSTED}
        assert c.pool.num_free == POOL_BLOCKS
    finally:
        c.close()


def test_request_that_can_never_fit_is_refused(tiny_model_dirs):
    c = _cluster(tiny_model_dirs("llava-gqa"))
    try:
        req = _req(0)
        req.sampling.max_new_tokens = 4 * POOL_BLOCKS  # more tokens than the pool could ever hold
        with pytest.raises(grpc.RpcError) as err:
            generate(c.stub, req)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "needs more KV blocks than a decode worker holds" in err.value.details()
        receiver = c.decode.servicer.receiver  # the decode worker checks too
        spec = receiver.spec
        header = encode_header(
            request_id="big",
            fingerprint=spec.fingerprint,
            dtype=spec.dtype,
            num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            layer_lengths=[27] * spec.num_layers,
            prompt_length=27,
            sampling=generate_pb2.SamplingParams(max_new_tokens=4 * POOL_BLOCKS),
        ).header
        with pytest.raises(KVWireError) as err:
            receiver.admit(header, "127.0.0.1", object())
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "the pool has" in str(err.value)
        assert c.pool.num_free == POOL_BLOCKS
    finally:
        c.close()
