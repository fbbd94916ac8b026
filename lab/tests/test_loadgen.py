"""The load generator against an in-process cluster, and the Hugging Face baseline server."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from inproc_cluster import InProcCluster
from sample_images import random_png
from vlkv.common.config import Limits, ModelConfig, PoolConfig, ServerConfig
from vlkv.common.errors import ResourceExhausted
from vlkv.common.model.inputs import decode_images
from vlkv.common.model.loading import load_model, load_processor
from vlkv.common.request import render_prompt
from vlkv.deploy.client import build_request, connect, generate
from vlkv_lab.bench.hf_baseline import HFBaselineServicer, start_hf_baseline
from vlkv_lab.loadgen import dir_workload, run_load, synthetic_workload


@pytest.fixture(scope="module")
def cluster(tiny_model_dirs):
    cfg = ServerConfig(
        model=ModelConfig(path=tiny_model_dirs("llava-gqa")), pool=PoolConfig(pool_bytes=512 << 10)
    )
    c = InProcCluster(cfg)
    yield c
    c.close()


def _check_records(res, n: int, max_new: int) -> None:
    assert len(res.records) == n
    assert sorted(r.index for r in res.records) == list(range(n))
    for r in res.records:
        assert r.ok, (r.status, r.error)
        assert r.ttft is not None and 0 < r.ttft <= r.e2e
        assert 1 <= r.tokens <= max_new
        assert r.tokens == r.generated_tokens
        assert len(r.itl) <= r.tokens - 1 and all(x >= 0 for x in r.itl)
        assert r.prompt_tokens > r.vision_tokens > 0
        assert r.finish_reason in ("LENGTH", "EOS")
    s = res.summary()
    assert s["ok"] == n and s["errors"] == {}
    assert s["tokens"] == sum(r.tokens for r in res.records)
    assert s["throughput_tok_s"] > 0 and s["ttft_p50_s"] <= s["e2e_p99_s"]


def test_closed_loop_one_record_per_request(cluster):
    reqs = synthetic_workload(4, max_new_tokens=5, policy="vlcache", budget=0.5)
    res = run_load(cluster.gateway.address, reqs, concurrency=3, max_requests=7, progress=False)
    _check_records(res, 7, 5)
    assert res.mode == "closed" and res.concurrency == 3
    assert all(0 < r.compression_ratio < 1 for r in res.records)
    assert cluster.pool.num_free == cluster.pool.num_blocks


def test_open_loop_poisson_arrivals_bounded_by_count_and_time(cluster):
    reqs = synthetic_workload(3, max_new_tokens=4, policy="full")
    res = run_load(cluster.gateway.address, reqs, rate=20.0, max_requests=5, progress=False, seed=1)
    _check_records(res, 5, 4)
    assert res.mode == "open"
    starts = [r.start for r in res.records]
    assert starts == sorted(starts)
    # time bound: nothing is sent after duration_s
    res = run_load(cluster.gateway.address, reqs, rate=50.0, duration_s=0.3, progress=False)
    assert all(r.start <= 0.35 for r in res.records)


def test_errors_counted_by_status(cluster):
    good = synthetic_workload(1, max_new_tokens=3)[0]
    no_prompt = build_request(images=[random_png(1)], max_new_tokens=3)  # no text and no chat
    bad_image = build_request(images=[b"not an image"], question="what colour is it ?", max_new_tokens=3)
    too_long = synthetic_workload(1, max_new_tokens=4096)[0]
    huge = synthetic_workload(1, max_new_tokens=900, policy="full")[0]  # > the 512 KiB pool
    res = run_load(
        cluster.gateway.address,
        [good, no_prompt, bad_image, too_long, huge],
        concurrency=1,
        progress=False,
    )
    assert [r.status for r in res.records] == [
        "OK",
        "INVALID_ARGUMENT",
        "INVALID_ARGUMENT",
        "INVALID_ARGUMENT",
        "RESOURCE_EXHAUSTED",
    ]
    assert res.errors() == {"INVALID_ARGUMENT": 3, "RESOURCE_EXHAUSTED": 1}
    assert res.summary()["ok"] == 1
    assert all(r.error for r in res.records[1:])


def test_directory_workload(tmp_path, cluster):
    for i in range(2):
        (tmp_path / f"img{i}.png").write_bytes(random_png(i))
    (tmp_path / "prompts.txt").write_text(
        "# comment\nwhat colour is the square ?\nUSER : <image> <image> what shape ? ASSISTANT :\n"
    )
    reqs = dir_workload(tmp_path, n=3, max_new_tokens=3)
    assert [len(r.images) for r in reqs] == [1, 2, 1]
    assert reqs[0].HasField("chat") and reqs[1].text.count("<image>") == 2
    res = run_load(cluster.gateway.address, reqs, concurrency=2, progress=False)
    _check_records(res, 3, 3)


@pytest.fixture(scope="module")
def hf_server(tiny_model_dirs):
    path = tiny_model_dirs("llava-gqa")
    model = load_model(ModelConfig(path=path))
    processor = load_processor(path)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    running = asyncio.run_coroutine_threadsafe(
        start_hf_baseline(path, kv_budget_bytes=1 << 20, threads=1, model=model, processor=processor), loop
    ).result(60)
    yield running, model, processor
    asyncio.run_coroutine_threadsafe(running.stop(), loop).result(60)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def _reference(model, processor, req, max_new: int) -> list[int]:
    images = decode_images(list(req.images), Limits())
    inputs = processor(images=images, text=render_prompt(req, processor), return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new, do_sample=False)
    ids = out[0, inputs["input_ids"].shape[1] :].tolist()
    eos = processor.tokenizer.eos_token_id
    return ids[: ids.index(eos)] if eos in ids else ids


def test_hf_baseline_greedy_equals_generate(hf_server):
    running, model, processor = hf_server
    reqs = synthetic_workload(3, seed=5, max_new_tokens=8)
    channel, stub = connect(running.address)
    try:
        for req in reqs:
            out = generate(stub, req, timeout=60)
            assert out.token_ids == _reference(model, processor, req, 8)
            assert out.finished.usage.generated_tokens == len(out.token_ids)
            assert out.finished.usage.compression_ratio == 1.0
    finally:
        channel.close()
    # concurrent requests are batched
    res = run_load(running.address, reqs, concurrency=3, max_requests=3, progress=False)
    assert all(r.ok and r.tokens >= 1 for r in res.records)
    assert running.servicer.stats["max_batch_seen"] >= 2


def test_hf_baseline_batched_tokens_equal_generate(hf_server):
    running, model, processor = hf_server
    reqs = synthetic_workload(4, seed=9, max_new_tokens=6)  # 1- and 2-image prompts: different lengths
    got: dict[int, list[int]] = {}

    async def go() -> None:
        import grpc
        from vlkv.v1 import generate_pb2_grpc

        async with grpc.aio.insecure_channel(running.address) as ch:
            stub = generate_pb2_grpc.GenerationStub(ch)

            async def one(i, req):
                ids = []
                async for resp in stub.Generate(req, timeout=60):
                    if resp.HasField("token"):
                        ids.extend(resp.token.token_ids)
                got[i] = ids

            await asyncio.gather(*(one(i, r) for i, r in enumerate(reqs)))

    asyncio.run(go())
    for i, req in enumerate(reqs):
        assert got[i] == _reference(model, processor, req, 6)


def test_hf_baseline_kv_budget_caps_the_batch(hf_server):
    _, model, processor = hf_server
    req = synthetic_workload(1, max_new_tokens=20)[0]

    async def check() -> None:
        probe = HFBaselineServicer(model, processor, kv_budget_bytes=10**9)
        per_token = probe.bytes_per_token
        assert per_token == 2 * 2 * 16 * 4 * 3  # K and V, 2 KV heads, head dim 16, fp32, 3 layers
        m = probe._validate(req).m
        budget = 2 * (m + 20) * per_token + per_token  # room for two such sequences, not three
        svc = HFBaselineServicer(model, processor, kv_budget_bytes=budget)
        svc.waiting = [svc._validate(req) for _ in range(3)]
        batch = svc._take_batch()
        assert len(batch) == 2 and len(svc.waiting) == 1
        alone = synthetic_workload(1, max_new_tokens=2 * (m + 20))[0]  # cannot fit even alone
        with pytest.raises(ResourceExhausted):
            svc._validate(alone)

    asyncio.run(check())
