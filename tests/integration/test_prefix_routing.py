"""Routing by prefix: a conversation's follow-up goes to the prefill worker that was sent its earlier turns
(it holds them in its prefix cache) unless that worker is much busier; another tenant's prompts never route
by them; a miss there (the worker evicted it, or left) still prefills in full."""

from __future__ import annotations

import pytest
from conversations import chat_request, conversation, png, run
from inproc_cluster import InProcCluster
from vlkv.common.config import ModelConfig, ServerConfig
from vlkv.deploy.servers import start_prefill_worker
from vlkv.services.prefix_index import PrefixIndex, route_keys
from vlkv.services.router import BUSY_MARGIN, Router, Worker

IMG = 7


def router_with(*loads: int) -> Router:
    r = Router(1 << 20)
    for i, load in enumerate(loads):
        r.prefill.join(Worker(f"w{i}", in_flight=load))
    return r


def test_the_prefix_holder_is_preferred_unless_much_busier():
    r = router_with(0, 0, 0)
    history = [1, 2] + [IMG] * 20 + list(range(100, 140))
    first = route_keys(history, ["img"], IMG, "t")
    follow = route_keys(history + list(range(50)), ["img"], IMG, "t")
    assert follow[: len(first)] == first
    assert r.pick_prefill(prefix=tuple(follow)).address == "w0"  # nobody was sent it: least loaded
    r.note_prefix("w2", tuple(first))
    assert r.pick_prefill(prefix=tuple(follow)).address == "w2"
    r.note_images("w1", ("img",), "t")  # another worker holds the image alone: the prefix outranks it
    assert r.pick_prefill(images=("img",), tenant="t", prefix=tuple(follow)).address == "w2"
    other = route_keys(history + list(range(50)), ["img"], IMG, "u")
    assert r.pick_prefill(prefix=tuple(other)).address == "w0"  # another tenant's keys differ
    r.prefill["w2"].in_flight = BUSY_MARGIN + 1
    assert r.pick_prefill(prefix=tuple(follow)).address == "w0"  # much busier: least loaded
    r.prefill["w2"].in_flight = 0
    assert r.pick_prefill(exclude={"w2"}, prefix=tuple(follow)).address == "w0"


def test_the_index_is_bounded_and_forgets_a_worker():
    idx = PrefixIndex(capacity=8)
    a = [f"a{i}" for i in range(6)]
    b = [f"b{i}" for i in range(6)]
    idx.note("w0", a)
    idx.note("w1", b)
    assert len(idx) == 8
    assert idx.longest(b) == ("w1", 6)
    assert idx.longest(a)[1] == 2  # a's tail went first; its root stays
    idx.forget("w1")
    assert idx.longest(b) == ("", 0)


@pytest.fixture(scope="module")
def cluster(tiny_model_dirs):
    cfg = ServerConfig(model=ModelConfig(path=tiny_model_dirs("llava-gqa")), image_cache_mb=0)
    c = InProcCluster(cfg)
    c.second = c.run(start_prefill_worker(cfg, model=c.model, processor=c.processor))
    c.second.servicer.allow_decode(c.decode.address)

    async def register():
        c.gateway.servicer.router.add_prefill(c.second.address)

    c.run(register())
    yield c
    c.run(c.second.stop())
    c.close()


def test_follow_ups_land_on_the_worker_holding_their_prefix(cluster):
    workers = (cluster.prefill.servicer, cluster.second.servicer)
    for seed in (11, 12, 13):  # three conversations spread over the two workers
        image = png(seed)
        _, first = run(cluster.stub, chat_request(conversation(1), image))
        assert first.cached_prompt_tokens == 0
        for turns in (2, 3):
            _, usage = run(cluster.stub, chat_request(conversation(turns), image))
            assert usage.cached_prompt_tokens > 0, (seed, turns)
    assert sum(w.prefix_cache.stats().hits for w in workers) == 6


def test_a_follow_up_whose_holder_lost_it_is_prefilled_in_full(cluster):
    image = png(21)
    want, _ = run(cluster.stub, chat_request(conversation(2), image))
    for w in (cluster.prefill.servicer, cluster.second.servicer):
        w.prefix_cache.clear()
    got, usage = run(cluster.stub, chat_request(conversation(2), image))
    assert usage.cached_prompt_tokens == 0 and got == want


def test_prometheus_counts_prompt_tokens_by_source_and_each_workers_prefix_cache(cluster):
    from vlkv.v1 import admin_pb2, admin_pb2_grpc

    reg = cluster.gateway.servicer.metrics.registry

    def tokens(source: str) -> float:
        return reg.get_sample_value("vlkv_prompt_tokens_total", {"source": source}) or 0

    before = {s: tokens(s) for s in ("prefilled", "prefix_cache")}
    image = png(31)
    _, first = run(cluster.stub, chat_request(conversation(1), image))
    _, second = run(cluster.stub, chat_request(conversation(2), image))
    assert tokens("prefix_cache") - before["prefix_cache"] == second.cached_prompt_tokens > 0
    fresh = first.prompt_tokens + second.prompt_tokens - second.cached_prompt_tokens
    assert tokens("prefilled") - before["prefilled"] == fresh
    admin_pb2_grpc.AdminStub(cluster.channel).GetStatus(admin_pb2.StatusRequest(), timeout=10)  # polls loads
    for running in (cluster.prefill, cluster.second):
        stats = running.servicer.prefix_cache.stats()
        labels = {"address": running.address}
        assert reg.get_sample_value("vlkv_prefix_cache_bytes", labels) == stats.bytes_held
        assert (
            reg.get_sample_value("vlkv_prefix_cache_events", {**labels, "event": "hit_tokens"})
            == stats.hit_tokens
        )
