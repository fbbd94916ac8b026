"""Continuation on the compressed cache in the prefill engine (``ReuseSettings.conversation = "continue"``): only a
prompt that extends the kept one of the same tenant continues; the appended forward is teacher forcing's last
row; a verified follow-up continues only where the continued cache meets the floor. (Through gRPC:
tests/integration/test_continuation.py.)"""

from __future__ import annotations

import torch
from conversations import VLCACHE, png, prefill, prompts
from vlkv.common.config import ModelConfig
from vlkv.common.model.forced import append_tokens
from vlkv.common.model.loading import load_model, load_processor
from vlkv.common.reuse import ReuseSettings
from vlkv.deploy.inprocess import InProcessEngine
from vlkv.prefill_worker.teacher_force import forced_logprobs


def _continue(req):
    req.reuse = ReuseSettings(conversation="continue")
    return req


def test_only_a_prompt_that_extends_the_kept_one_of_the_same_tenant_continues():
    cfg = ModelConfig()
    eng = InProcessEngine(load_model(cfg), load_processor(cfg.path))
    img = [png(45)]
    pe = prefill(eng)
    first = _continue(eng.prepare(img, prompt=prompts(1), compression=VLCACHE))
    first.tenant = "alice"
    pe.run(first)
    other = _continue(eng.prepare(img, prompt=prompts(2), compression=VLCACHE))
    other.tenant = "bob"
    assert pe.run(other).continued_tokens == 0  # another tenant: recompressed
    changed = _continue(
        eng.prepare(img, prompt=prompts(2).replace("what is in", "what was in"), compression=VLCACHE)
    )
    changed.tenant = "alice"
    assert pe.run(changed).continued_tokens == 0  # its history differs from the kept prompt
    same = _continue(eng.prepare(img, prompt=prompts(2), compression=VLCACHE))
    same.tenant = "alice"
    assert pe.run(same).continued_tokens > 0


def test_append_tokens_matches_teacher_forcing():
    """The appended forward's logits are teacher forcing's last row; its K/V extend the cache."""
    cfg = ModelConfig()
    eng = InProcessEngine(load_model(cfg), load_processor(cfg.path))
    res = eng.prefill.run(eng.prepare([png(46)], prompt=prompts(1), compression=VLCACHE))
    tokens = [5, 17, 9, 30]
    ckv, logits = append_tokens(eng.model, res.cache, tokens)
    _, logq = next(forced_logprobs(eng.model, [res.cache], [tokens]))
    torch.testing.assert_close(torch.log_softmax(logits, -1), logq[-1], rtol=1e-4, atol=1e-4)
    assert ckv.layer_lengths == [k + len(tokens) for k in res.cache.layer_lengths]
    assert ckv.prompt_length == res.cache.prompt_length + len(tokens)
    for a, b in zip(ckv.keys, res.cache.keys, strict=True):
        assert torch.equal(a[:, : b.shape[1]], b)


def _verified_turns(floor: float, spoil: bool = False):
    """A first turn and its follow-up, both ``continue`` and verified at ``floor``; ``spoil`` zeroes the kept
    compact cache's values before the follow-up (a cache that cannot reproduce the draft)."""
    from vlkv.common.compression.registry import CompressionSettings
    from vlkv.common.compression.verify import VerifyConfig
    from vlkv.prefill_worker.engine import PrefillEngine
    from vlkv.prefill_worker.prefix_cache import PrefixCache

    cfg = ModelConfig()
    eng = InProcessEngine(load_model(cfg), load_processor(cfg.path))
    pe = PrefillEngine(
        eng.model, eng.spec, None, verify_config=VerifyConfig(), prefix_cache=PrefixCache(64 << 20, 4)
    )
    settings = CompressionSettings("vlcache", 0.1, 0.01, verify="floor", fidelity_floor=floor, max_budget=0.1)
    img = [png(47)]
    first = pe.run(_continue(eng.prepare(img, prompt=prompts(1), compression=settings)))
    if spoil:
        for entry in pe.retained._entries.values():
            entry.cache.values = [torch.zeros_like(v) for v in entry.cache.values]
    follow = _continue(eng.prepare(img, prompt=prompts(2), compression=settings))
    fresh = PrefillEngine(
        eng.model, eng.spec, None, verify_config=VerifyConfig(), prefix_cache=PrefixCache(64 << 20, 4)
    )
    recompressed = fresh.run(eng.prepare(img, prompt=prompts(2), compression=settings))
    return first, pe.run(follow), recompressed


def test_a_verified_follow_up_continues_only_where_the_continued_cache_meets_the_floor():
    first, held, recompressed = _verified_turns(floor=0.0)
    new = held.cache.prompt_length - first.cache.prompt_length
    assert held.continued_tokens == new > 0 and not held.continue_refused
    assert held.verdict.candidate == "continue" and held.verdict.verified == 1 and held.verdict.floor_met
    assert held.cache.layer_lengths == [k + new for k in first.cache.layer_lengths]
    assert held.cache.first_token == recompressed.cache.first_token  # the full cache's first token
    _, refused, recompressed = _verified_turns(floor=1.0, spoil=True)
    assert refused.continue_refused and refused.continued_tokens == 0
    assert refused.verdict.candidate != "continue"
    assert refused.verdict.verified == recompressed.verdict.verified + 1  # the continued cache, then the set
    assert refused.cache.layer_lengths == recompressed.cache.layer_lengths
    assert refused.cache.first_token == recompressed.cache.first_token
