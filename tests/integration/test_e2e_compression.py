"""Every policy runs through Generate and really decodes from its compressed cache."""

from __future__ import annotations

import grpc
import pytest
from inproc_cluster import InProcCluster
from sample_images import random_png
from vlkv.common.compression.registry import POLICY_NAMES
from vlkv.common.config import ModelConfig, PoolConfig, ServerConfig
from vlkv.deploy.client import build_request, generate

Q = "what colour is the square ?"


@pytest.fixture(scope="module", params=["llava-gqa", "llava-mha"])
def cluster(request, tiny_model_dirs):
    cfg = ServerConfig(
        model=ModelConfig(path=tiny_model_dirs(request.param)), pool=PoolConfig(pool_bytes=4 << 20)
    )
    c = InProcCluster(cfg)
    yield c
    c.close()


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_policy_through_generate(cluster, policy):
    free = cluster.pool.num_free
    req = build_request(images=[random_png(3)], question=Q, max_new_tokens=6, policy=policy, budget=0.25)
    out = generate(cluster.stub, req, timeout=60)
    usage = out.finished.usage
    m, layers = usage.prompt_tokens, len(usage.layer_budgets)
    assert layers == 3 and usage.policy == policy
    assert sum(usage.layer_budgets) / (layers * m) == pytest.approx(usage.compression_ratio, rel=1e-5)
    if policy == "full":
        assert list(usage.layer_budgets) == [m] * layers
    else:
        assert all(1 <= k < m for k in usage.layer_budgets)
        assert usage.kv_bytes_kept < 0.5 * usage.kv_bytes_full
    assert cluster.pool.num_free == free


@pytest.mark.parametrize("policy", ["vlcache", "snapkv", "h2o"])
def test_budget_one_reproduces_full_cache_tokens(cluster, policy):
    images = [random_png(4), random_png(5)]
    full = generate(cluster.stub, build_request(images=images, question=Q, max_new_tokens=8, policy="full"))
    same = generate(
        cluster.stub, build_request(images=images, question=Q, max_new_tokens=8, policy=policy, budget=1.0)
    )
    assert same.token_ids == full.token_ids
    assert same.finished.usage.compression_ratio == 1.0


def test_a_request_naming_no_policy_is_verified_and_usage_says_so(cluster):
    free = cluster.pool.num_free
    out = generate(
        cluster.stub, build_request(images=[random_png(6)], question=Q, max_new_tokens=6, budget=0.1)
    )
    u = out.finished.usage
    assert u.verify == "floor" and u.verified_candidate and u.draft_tokens > 0
    assert 0.0 <= u.verified_agreement <= 1.0 and u.verified_kl >= 0.0
    assert u.verified_budget == pytest.approx(min(0.25, 0.1 * 2**u.budget_raises), rel=1e-5)
    assert u.floor_met == (u.verified_agreement >= 0.9)
    assert u.compression_ratio <= u.verified_budget + 1.0 / u.prompt_tokens
    assert cluster.pool.num_free == free
    named = generate(
        cluster.stub, build_request(images=[random_png(6)], question=Q, max_new_tokens=2, policy="vlcache")
    )
    assert named.finished.usage.verify == "" and named.finished.usage.verified_candidate == ""


@pytest.mark.parametrize(
    "field, value", [("fidelity_floor", 1.5), ("max_budget", 0.0), ("max_budget", 1.5), ("verify", "always")]
)
def test_bad_verification_values_are_invalid_argument(cluster, field, value):
    req = build_request(images=[random_png(6)], question=Q, max_new_tokens=2)
    setattr(req.compression, field, value)
    with pytest.raises(grpc.RpcError) as err:
        generate(cluster.stub, req)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in err.value.details()
    ok = generate(cluster.stub, build_request(images=[random_png(6)], question=Q, max_new_tokens=2))
    assert ok.finished.usage.generated_tokens == 2
