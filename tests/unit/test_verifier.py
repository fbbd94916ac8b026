"""Verified compression in the prefill engine: the kept cache is the candidate that reproduces the full cache's
draft best, the budget is raised only when the floor asks for it, and the outcomes teach a profile."""

from __future__ import annotations

import json

import pytest
import torch
from sample_images import random_png
from vlkv.common.compression.profile import read_profile
from vlkv.common.compression.registry import CompressionSettings, policy_from_dict
from vlkv.common.compression.verify import VERIFY_CANDIDATES, VerifyConfig
from vlkv.common.config import ModelConfig, ServerConfig
from vlkv.common.errors import ConfigError
from vlkv.common.model.loading import load_model, load_processor
from vlkv.common.sampling import SamplingConfig
from vlkv.deploy.inprocess import InProcessEngine
from vlkv.deploy.servers import load_learned_profile
from vlkv.prefill_worker.engine import PrefillEngine
from vlkv.prefill_worker.ledger import Ledger
from vlkv.prefill_worker.teacher_force import agreement

Q = "what colour is the square ?"


@pytest.fixture(scope="module")
def engine(tiny_model_dirs):
    cfg = ModelConfig(path=tiny_model_dirs("llava-gqa"))
    model, proc = load_model(cfg), load_processor(cfg.path)
    engine = InProcessEngine(model, proc, verify=VerifyConfig(learn_after=0))
    engine.model_dir = cfg.path
    return engine


def _run(engine, budget: float, image: int = 1, **verify):
    req = engine.prepare(
        [random_png(image)],
        question=Q,
        sampling=SamplingConfig(max_new_tokens=4),
        compression=CompressionSettings(budget=budget, explicit=False, **verify),
    )
    return engine.prefill.run(req)


def _fixed(engine, label: str, budget: float, image: int = 1):
    req = engine.prepare(
        [random_png(image)],
        question=Q,
        sampling=SamplingConfig(max_new_tokens=4),
        compression=CompressionSettings(budget=budget),
    )
    p = engine.prefill
    saved, p.candidates = p.candidates, [c for c in p.candidates if c.label == label]
    try:  # the same engine verifying one candidate only: its cache at the budget, as the fixed path keeps it
        return p.run_verified(req, p.verify_config.plan(CompressionSettings(budget=budget, verify="select")))
    finally:
        p.candidates = saved


def test_select_keeps_the_best_candidate_at_exactly_the_budget(engine):
    res = _run(engine, 0.1, verify="select")
    v = res.verdict
    assert v.mode == "select" and v.raises == 0 and v.budget == pytest.approx(0.1)
    assert v.draft_tokens == 16 and v.verified >= 1
    # the kept cache is that candidate's own cache at the requested budget: same realized ratio, same positions
    alone = _fixed(engine, v.candidate, 0.1)
    assert res.cache.layer_lengths == alone.cache.layer_lengths
    assert all(
        torch.equal(a, b) for a, b in zip(res.cache.kept_indices, alone.cache.kept_indices, strict=True)
    )
    # and no candidate scores better than the kept one
    for label, _ in VERIFY_CANDIDATES:
        other = _fixed(engine, label, 0.1).verdict
        assert (other.agreement, -other.kl) <= (v.agreement, -v.kl) or other.candidate == v.candidate


def test_a_floor_the_kept_cache_meets_is_not_raised(engine):
    at = _run(engine, 0.1, verify="select").verdict
    held = _run(engine, 0.1, verify="floor", fidelity_floor=at.agreement).verdict
    assert held.raises == 0 and held.floor_met and held.budget == pytest.approx(0.1)
    assert held.candidate == at.candidate


def test_a_floor_no_candidate_meets_raises_the_budget_and_says_so(engine):
    at = _run(engine, 0.02, verify="select").verdict
    assert at.agreement < 1.0, (
        "the tiny model must lose some draft tokens at 2% for this test to mean anything"
    )
    res = _run(engine, 0.02, verify="floor", fidelity_floor=1.0, max_budget=1.0)
    v = res.verdict
    assert v.raises >= 1 and v.budget > 0.02
    assert v.budget == pytest.approx(min(1.0, 0.02 * 2**v.raises), rel=1e-6)
    assert v.floor_met and v.agreement == 1.0  # the full cache at the latest reproduces its own draft
    assert res.cache.compression_ratio > at.budget


def test_a_floor_out_of_reach_is_served_at_the_cap(engine):
    at = _run(engine, 0.02, verify="select").verdict
    assert at.agreement < 1.0
    res = _run(engine, 0.02, verify="floor", fidelity_floor=1.0, max_budget=0.02)
    v = res.verdict
    assert not v.floor_met and v.raises == 0 and v.budget == pytest.approx(0.02)
    res = _run(engine, 0.01, verify="floor", fidelity_floor=1.0, max_budget=0.04)
    assert res.verdict.budget <= 0.04 + 1e-9


def test_a_named_policy_is_not_verified_unless_it_asks(engine):
    req = engine.prepare([random_png(1)], question=Q, compression=CompressionSettings("snapkv", 0.1))
    assert engine.prefill.run(req).verdict is None
    req = engine.prepare(
        [random_png(1)], question=Q, compression=CompressionSettings("snapkv", 0.1, verify="select")
    )
    assert engine.prefill.run(req).verdict is not None
    full = engine.prepare(
        [random_png(1)], question=Q, compression=CompressionSettings(budget=1.0, explicit=False)
    )
    assert engine.prefill.run(full).verdict is None


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"fidelity_floor": 1.5}, "fidelity_floor"),
        ({"max_budget": 0.0}, "max_budget"),
        ({"verify": "on"}, "verify"),
    ],
)
def test_out_of_range_values_name_their_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        CompressionSettings(**kwargs)


def test_teacher_forced_full_cache_agrees_with_its_own_draft(engine):
    """The scoring itself: the full cache through the teacher-forced decode step reproduces the draft."""
    res = _run(engine, 1.0)
    assert res.verdict is None
    from vlkv.prefill_worker.draft_queries import run_draft

    req = engine.prepare([random_png(2)], question=Q)
    logits, keys, values = engine.prefill.forward(req)
    draft = run_draft(
        engine.model, keys, values, int(logits.argmax()), 8, engine.spec.eos_token_ids, logprobs=True
    )
    full = engine.prefill.run_fixed(
        engine.prepare([random_png(2)], question=Q, compression=CompressionSettings("full", 1.0))
    ).cache
    [(agree, kl)] = agreement(engine.model, [full], draft.inputs, draft.tokens, draft.logprobs)
    assert agree == 1.0 and kl < 1e-4


def test_learned_order_verifies_fewer_and_the_profile_loads_at_restart(engine, tmp_path):
    spec = engine.spec
    cfg = VerifyConfig(learn_after=3)
    prefill = PrefillEngine(
        engine.model, spec, verify_config=cfg, learned_profile=str(tmp_path / "learned.json")
    )
    verdicts = [
        prefill.run(
            engine.prepare(
                [random_png(i)], question=Q, compression=CompressionSettings(budget=0.5, explicit=False)
            )
        ).verdict
        for i in range(4)
    ]
    assert [v.verified for v in verdicts[:3]] == [4, 4, 4]  # before the order is learned: every candidate
    # learned: the most-winning candidate alone, the others only when it misses the floor
    assert verdicts[3].verified == 1 if verdicts[3].agreement >= cfg.floor else verdicts[3].verified == 4
    ordered, learned = prefill.ledger.order(0.5)
    wins = prefill.ledger.snapshot()["wins"]
    assert learned and wins.get(ordered[0].label, 0) == max(wins.values())
    profile = read_profile(tmp_path / "learned.json")  # written after the 3rd verified request
    assert profile.measure["kind"] == "verifier" and profile.fingerprint == spec.fingerprint
    assert sum(r["prompts"] for r in profile.table) == 3
    assert (
        profile.entries[0].candidate
        == max((r for r in profile.table), key=lambda r: r["prompts"])["candidate"]
    )
    # a restart starts from it: the order is learned at once, from the profile's counts
    again = PrefillEngine(engine.model, spec, verify_config=cfg, learned=profile)
    assert again.ledger.order(0.5)[1]
    assert again.ledger.order(0.5)[0][0].label == profile.entries[0].candidate
    # another model's is refused at start-up
    data = json.loads((tmp_path / "learned.json").read_text())
    data["model"]["fingerprint"] = "another-model"
    (tmp_path / "other.json").write_text(json.dumps(data))
    model_dir = engine.model_dir
    server = ServerConfig(model=ModelConfig(path=model_dir), learned_profile=str(tmp_path / "other.json"))
    with pytest.raises(ConfigError, match="another model"):
        load_learned_profile(server, spec.fingerprint)
    assert load_learned_profile(
        ServerConfig(model=ModelConfig(path=model_dir), learned_profile=str(tmp_path / "learned.json")),
        spec.fingerprint,
    ).label


def test_ledger_learns_nothing_before_enough_requests():
    cands = [
        type("C", (), {"label": label, "policy": policy_from_dict(d)})() for label, d in VERIFY_CANDIDATES
    ]
    ledger = Ledger(cands, learn_after=2, fingerprint="f")
    assert ledger.order(0.1) == (cands, False)
    assert ledger.profile() is None


def test_calibrate_verifier_is_the_served_verifier_offline(tmp_path):
    """`vlkv calibrate --verifier`: every prompt at every budget through the prefill engine's verifier; the
    profile it writes is what `--learned-profile` loads, with the served ledger's counts."""
    from calib_prompts import synthetic_prompts
    from vlkv.common.config import DEFAULT_MODEL_DIR
    from vlkv.deploy.calibrate.verifier import calibrate_verified, format_learned

    prompts = synthetic_prompts(tmp_path, 3, seed=1)
    path, profile, _ = calibrate_verified(
        str(DEFAULT_MODEL_DIR), str(prompts), (0.05, 0.2), out=str(tmp_path / "learned.json"), progress=None
    )
    loaded = read_profile(path)
    assert loaded.measure["kind"] == "verifier" and loaded.prompts["count"] == 3
    assert [e.budget for e in loaded.entries] == [0.05, 0.2]
    for budget in (0.05, 0.2):
        rows = [r for r in loaded.table if r["budget"] == budget]
        assert sum(r["prompts"] for r in rows) == 3 and all(0 <= r["agreement"] <= 1 for r in rows)
        best = max(rows, key=lambda r: r["prompts"])
        assert loaded.entry_for(budget).candidate in {
            r["candidate"] for r in rows if r["prompts"] == best["prompts"]
        }
    assert "| 0.05 |" in format_learned(loaded)
    model = load_model(ModelConfig(path=str(DEFAULT_MODEL_DIR)))
    from vlkv.common.model.spec import ModelSpec

    spec = ModelSpec.from_model(model, load_processor(str(DEFAULT_MODEL_DIR)).tokenizer)
    loaded.check_model(spec.fingerprint)  # written for this model
    served = PrefillEngine(model, spec, verify_config=VerifyConfig(learn_after=3), learned=loaded)
    assert served.ledger.order(0.05)[1] and served.ledger.order(0.2)[1]
