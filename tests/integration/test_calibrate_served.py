"""A profile ``vlkv calibrate`` wrote for the default model, served through the public API: each budget gets the
profile's entry and the in-process engine's answer under the same profile, a request naming its own settings
overrides it, and a prefill worker of another model refuses it at start-up. (The calibration itself:
tests/unit/test_calibrate.py.)"""

from __future__ import annotations

import asyncio

import pytest
from inproc_cluster import InProcCluster
from vlkv.common.compression.profile import read_profile
from vlkv.common.compression.registry import CompressionSettings
from vlkv.common.config import DEFAULT_MODEL_DIR, ConfigError, ModelConfig, PoolConfig, ServerConfig
from vlkv.common.model.loading import load_model, load_processor
from vlkv.common.sampling import SamplingConfig
from vlkv.deploy import synthetic_task
from vlkv.deploy.client import build_request, generate, png_bytes
from vlkv.deploy.inprocess import InProcessEngine
from vlkv.deploy.servers import start_prefill_worker
from vlkv_lab.zoo import member


@pytest.fixture(scope="module")
def served(calibrated_profile):
    cfg = ServerConfig(
        model=ModelConfig(path=str(DEFAULT_MODEL_DIR)),
        pool=PoolConfig(pool_bytes=16 << 20),
        compression_profile=str(calibrated_profile),
    )
    c = InProcCluster(cfg)
    yield c
    c.close()


def test_a_calibrated_profile_is_served_through_the_public_api(served, calibrated_profile):
    profile = read_profile(calibrated_profile)
    ex = synthetic_task.make_examples(1, seed=11, split="heldout")[0]
    images = [png_bytes(i) for i in ex.images]
    local = InProcessEngine(served.model, served.processor, pool_bytes=16 << 20, profile=profile)
    for budget in (0.05, 0.1, 0.07):
        req = build_request(images=images, question=ex.question, max_new_tokens=4, budget=budget)
        out = generate(served.stub, req, timeout=120)
        usage, entry = out.finished.usage, profile.entry_for(budget)
        assert usage.compression_profile == profile.label and usage.policy == entry.policy.name
        if not entry.policy.allocator.needs_stats:  # then its budgets are known before the prefill
            layers = len(usage.layer_budgets)
            assert list(usage.layer_budgets) == entry.policy.allocate(
                None, budget, usage.prompt_tokens, layers
            )
        # the served answer is the in-process engine's under the same profile (no policy named: explicit False)
        mine = local.generate(
            images,
            question=ex.question,
            sampling=SamplingConfig(max_new_tokens=4),
            compression=CompressionSettings(budget=budget, explicit=False),
        )
        assert mine.token_ids == list(out.token_ids) and mine.policy == entry.policy.name
    # a request that names its own settings overrides the profile
    req = build_request(images=images, question=ex.question, max_new_tokens=4, budget=0.05, policy="snapkv")
    usage = generate(served.stub, req, timeout=120).finished.usage
    assert usage.compression_profile == "" and usage.policy == "snapkv"
    assert served.prefill.servicer.load().compression_profile == profile.label


def test_another_models_profile_is_refused_at_start_up(calibrated_profile):
    other = str(member("deep8").model_dir)  # a zoo member: another checkpoint
    cfg = ServerConfig(model=ModelConfig(path=other), compression_profile=str(calibrated_profile))
    with pytest.raises(ConfigError, match="calibrated on another model"):
        asyncio.run(start_prefill_worker(cfg, model=load_model(cfg.model), processor=load_processor(other)))
