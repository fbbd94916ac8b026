"""Cache-aware routing: a request whose image a prefill worker holds goes there unless that worker is much
busier; through the public API, usage reports the hit and the admin API each worker's image cache."""

from __future__ import annotations

import pytest
from inproc_cluster import InProcCluster
from sample_images import random_png
from vlkv.common.config import ModelConfig, ServerConfig
from vlkv.deploy.client import build_request, generate
from vlkv.deploy.servers import start_prefill_worker
from vlkv.services.router import BUSY_MARGIN, Router, Worker
from vlkv.v1 import admin_pb2, admin_pb2_grpc, generate_pb2


def router_with(*loads: int) -> Router:
    r = Router(1 << 20)
    for i, load in enumerate(loads):
        r.prefill.join(Worker(f"w{i}", in_flight=load))
    return r


def test_the_holder_is_preferred_unless_much_busier():
    r = router_with(0, 0, 0)
    assert r.pick_prefill(images=("img",), tenant="t").address == "w0"  # nobody holds it: least loaded
    r.note_images("w2", ("img",), "t")
    assert r.pick_prefill(images=("img",), tenant="t").address == "w2"
    assert r.pick_prefill(images=("img",), tenant="other").address == "w0"  # another tenant's image
    r.prefill["w2"].in_flight = BUSY_MARGIN
    assert r.pick_prefill(images=("img",), tenant="t").address == "w2"  # busier, not much busier
    r.prefill["w2"].in_flight = BUSY_MARGIN + 1
    assert r.pick_prefill(images=("img",), tenant="t").address == "w0"  # much busier: least loaded
    r.prefill["w2"].draining = True
    r.prefill["w2"].in_flight = 0
    assert r.pick_prefill(images=("img",), tenant="t").address == "w0"  # a draining holder is skipped
    assert r.pick_prefill(exclude={"w0"}, images=("img",), tenant="t").address == "w1"


def test_the_worker_holding_most_images_wins():
    r = router_with(0, 1, 1)
    r.note_images("w1", ("a",), "t")
    r.note_images("w2", ("a", "b"), "t")  # w2 prefilled both later: it holds a and b
    assert r.pick_prefill(images=("a", "b"), tenant="t").address == "w2"


@pytest.fixture(scope="module")
def cluster(tiny_model_dirs):
    # The image cache alone: an exact repeat of a prompt would otherwise come from the prefix cache.
    cfg = ServerConfig(model=ModelConfig(path=tiny_model_dirs("llava-gqa")), prefix_cache_mb=0)
    c = InProcCluster(cfg)
    c.second = c.run(start_prefill_worker(cfg, model=c.model, processor=c.processor))
    c.second.servicer.allow_decode(c.decode.address)

    async def register():
        c.gateway.servicer.router.add_prefill(c.second.address)

    c.run(register())
    yield c
    c.run(c.second.stop())
    c.close()


def ask(cluster, prompt: str, image: bytes, **reuse):
    req = build_request(prompt, [image], max_new_tokens=4, policy="full")
    req.reuse.CopyFrom(generate_pb2.ReuseParams(**reuse))
    return generate(cluster.stub, req, timeout=120)


def test_repeated_images_hit_on_their_holder_through_the_public_api(cluster):
    workers = {cluster.prefill.address: cluster.prefill, cluster.second.address: cluster.second}
    image = random_png(71)
    first = ask(cluster, "<image> what colour", image)
    assert not first.finished.usage.image_cache_hit and first.finished.usage.recompute_ratio == 1.0
    holders = [a for a, w in workers.items() if len(w.servicer.image_cache)]
    assert len(holders) == 1
    holder = workers[holders[0]].servicer
    for prompt in ("the red one is <image> what shape", "a b <image> what colour", "<image> what colour"):
        want = ask(cluster, prompt, image, reuse="off")
        got = ask(cluster, prompt, image, recompute_ratio=1.0)
        assert got.finished.usage.image_cache_hit and got.token_ids == want.token_ids
        exact = prompt == "<image> what colour"  # the prompt it was cached under: nothing to recompute
        want_recomputed = 0 if exact else got.finished.usage.vision_tokens
        assert got.finished.usage.recomputed_image_tokens == want_recomputed
        low = ask(cluster, prompt, image, recompute_ratio=0.0, mode="none")
        assert low.finished.usage.image_cache_hit and low.finished.usage.recompute_ratio < 0.05
    assert holder.image_cache.stats().hits == 6
    assert sum(len(w.servicer.image_cache) for w in workers.values()) == 1


def test_status_shows_each_prefill_workers_cache(cluster):
    ask(cluster, "<image> what shape", random_png(72))
    st = admin_pb2_grpc.AdminStub(cluster.channel).GetStatus(admin_pb2.StatusRequest(), timeout=10)
    prefill = [w for w in st.workers if w.kind == "prefill"]
    assert len(prefill) == 2
    assert sum(w.image_cache.entries for w in prefill) >= 1
    assert all(w.image_cache.capacity_bytes == 256 << 20 for w in prefill)
    assert all(w.image_cache.bytes_held <= w.image_cache.capacity_bytes for w in prefill)


def test_a_much_busier_holder_is_passed_over(cluster):
    image = random_png(73)
    ask(cluster, "<image> what colour", image)
    router = cluster.gateway.servicer.router
    holder = next(w for w in router.prefill.values() if w.address in _holding(cluster, image))
    holder.in_flight += BUSY_MARGIN + 1  # as if it had that many more prefills in flight
    try:
        res = ask(cluster, "a <image> what colour", image)
    finally:
        holder.in_flight -= BUSY_MARGIN + 1
    assert not res.finished.usage.image_cache_hit  # prefilled on the other worker, which now holds it too
    assert len(_holding(cluster, image)) == 2


def test_invalid_reuse_settings_are_refused(cluster):
    import grpc

    for bad in (dict(reuse="sometimes"), dict(mode="magic"), dict(recompute_ratio=1.5)):
        with pytest.raises(grpc.RpcError) as err:
            ask(cluster, "<image> what colour", random_png(74), **bad)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def _holding(cluster, image: bytes) -> set[str]:
    from vlkv.common.model.inputs import decode_images, prepare_inputs
    from vlkv.common.reuse import image_hashes

    images = decode_images([image], cluster.cfg.limits)
    pixels = prepare_inputs(
        cluster.processor, images, "<image>", cluster.gateway.servicer.spec.image_token_id
    )
    digest = image_hashes(pixels.model_kwargs["pixel_values"])[0]
    out = set()
    for running in (cluster.prefill, cluster.second):
        if any(k.image_hash == digest for k in running.servicer.image_cache._entries):
            out.add(running.address)
    return out


def test_tenants_are_the_callers_token_identity(cluster):
    from vlkv.common.reuse import ANONYMOUS, tenant_of

    assert tenant_of("") == ANONYMOUS
    assert tenant_of("Bearer a") != tenant_of("Bearer b") and tenant_of("Bearer a") == tenant_of("Bearer a")
    assert "secret-token" not in tenant_of("Bearer secret-token")
    assert cluster.gateway.servicer.tenant("Bearer whatever") == ANONYMOUS  # no API token: one tenant


def test_prometheus_counts_hits_misses_bytes_and_evictions(cluster):
    metrics = cluster.gateway.servicer.metrics
    reg = metrics.registry
    before = reg.get_sample_value("vlkv_image_cache_requests_total", {"result": "hit"}) or 0
    misses = reg.get_sample_value("vlkv_image_cache_requests_total", {"result": "miss"}) or 0
    image = random_png(75)
    ask(cluster, "<image> what colour", image)
    ask(cluster, "a <image> what shape", image)
    assert reg.get_sample_value("vlkv_image_cache_requests_total", {"result": "hit"}) == before + 1
    assert reg.get_sample_value("vlkv_image_cache_requests_total", {"result": "miss"}) == misses + 1
    admin_pb2_grpc.AdminStub(cluster.channel).GetStatus(admin_pb2.StatusRequest(), timeout=10)  # polls loads
    for running in (cluster.prefill, cluster.second):
        stats = running.servicer.image_cache.stats()
        labels = {"address": running.address}
        assert reg.get_sample_value("vlkv_image_cache_bytes", labels) == stats.bytes_held
        for event in ("hits", "misses", "evictions"):
            value = reg.get_sample_value("vlkv_image_cache_events", {**labels, "event": event})
            assert value == getattr(stats, event)


def test_the_http_fronts_extra_body_carries_reuse_settings():
    from vlkv.services.openai_schema import ChatRequest, chat_to_proto, usage_json

    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "vlkv": {"reuse": "off", "recompute_ratio": 0.1, "reuse_mode": "mpic"},
    }
    pb = chat_to_proto(ChatRequest.model_validate(body), [], "r")
    assert pb.reuse.reuse == "off" and pb.reuse.mode == "mpic" and abs(pb.reuse.recompute_ratio - 0.1) < 1e-6
    usage = generate_pb2.Usage(image_cache_hit=True, recomputed_image_tokens=3, recompute_ratio=0.05)
    v = usage_json(usage)["vlkv"]
    assert v["image_cache_hit"] and v["recomputed_image_tokens"] == 3


def test_vlkv_status_prints_each_prefill_cache(cluster, capsys):
    from vlkv.deploy.cli.main import main

    ask(cluster, "<image> what colour", random_png(76))
    assert main(["status", "--address", cluster.gateway.address]) == 0
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("image cache ")]
    assert {x.split()[2].rstrip(":") for x in lines} == {cluster.prefill.address, cluster.second.address}
    assert all("MiB" in x and "hits" in x and "evictions" in x for x in lines)
