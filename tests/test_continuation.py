"""Continuation on the compressed cache (``ReuseParams.conversation = "continue"``, opt-in): a follow-up
turn's new tokens appended to the compact cache of the previous turn. With nothing dropped it answers as
``model.generate()`` on the whole conversation; compressed, its cache is the earlier turn's kept tokens plus
every new token; a prompt that does not extend the kept one, another tenant's, or a request that did not
opt in is prefilled and compressed as usual."""

from __future__ import annotations

import grpc
import pytest
import torch
from inproc_cluster import InProcCluster
from test_prefix_cache import (
    VLCACHE,
    chat_request,
    conversation,
    png,
    prefill,
    prompts,
    reference,
    run,
)
from vlkv.common.config import ModelConfig, PoolConfig, ServerConfig
from vlkv.common.reuse import ReuseSettings
from vlkv.prefill_worker.continuation import append_tokens
from vlkv.prefill_worker.teacher_force import forced_logprobs


@pytest.fixture(scope="module")
def cluster(tiny_model_dirs):
    cfg = ServerConfig(
        model=ModelConfig(path=tiny_model_dirs("llava-gqa")), pool=PoolConfig(pool_bytes=8 << 20)
    )
    c = InProcCluster(cfg)
    yield c
    c.close()


def ask(cluster, turns: int, image: bytes, conversation_mode: str = "continue", **kw):
    req = chat_request(conversation(turns), image, **kw)
    req.reuse.conversation = conversation_mode
    return run(cluster.stub, req)


def test_continuing_a_full_cache_equals_generate_on_the_whole_conversation(cluster):
    image = png(41)
    for turns in (1, 2, 3):
        got, usage = ask(cluster, turns, image)
        assert got == reference(cluster, conversation(turns), image), turns
        assert (usage.continued_tokens > 0) == (turns > 1)
        assert usage.compression_ratio == pytest.approx(1.0)


def test_a_compressed_continuation_keeps_the_earlier_turn_and_every_new_token(cluster):
    image = png(42)
    _, first = ask(cluster, 1, image, policy="vlcache", budget=0.1)
    _, second = ask(cluster, 2, image, policy="vlcache", budget=0.1)
    new = second.prompt_tokens - first.prompt_tokens
    assert second.continued_tokens == new > 0
    assert list(second.layer_budgets) == [k + new for k in first.layer_budgets]
    kept = sum(second.layer_budgets)
    assert second.compression_ratio == pytest.approx(
        kept / (len(second.layer_budgets) * second.prompt_tokens)
    )


def test_without_opting_in_a_follow_up_is_recompressed(cluster):
    image = png(43)
    ask(cluster, 1, image, policy="vlcache", budget=0.1)
    _, usage = ask(cluster, 2, image, conversation_mode="", policy="vlcache", budget=0.1)
    assert usage.continued_tokens == 0 and usage.cached_prompt_tokens > 0  # from the prefix cache instead


def test_a_verified_follow_up_says_through_the_api_that_it_continued(cluster):
    image = png(48)

    def verified(turns):
        req = chat_request(conversation(turns), image, policy="vlcache", budget=0.1)
        req.reuse.conversation = "continue"
        req.compression.verify, req.compression.fidelity_floor = "floor", 0.0
        return run(cluster.stub, req)[1]

    first, second = verified(1), verified(2)
    assert first.continued_tokens == 0 and first.verified_candidate != "continue"
    assert second.verified_candidate == "continue" and second.continued_tokens > 0
    assert not second.continue_refused and second.floor_met and second.draft_tokens > 0
    new = second.prompt_tokens - first.prompt_tokens
    assert list(second.layer_budgets) == [k + new for k in first.layer_budgets]


def test_a_bad_conversation_mode_is_invalid_argument(cluster):
    with pytest.raises(grpc.RpcError) as err:
        ask(cluster, 1, png(44), conversation_mode="sometimes")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "conversation" in err.value.details()


def _continue(req):
    req.reuse = ReuseSettings(conversation="continue")
    return req


def test_only_a_prompt_that_extends_the_kept_one_of_the_same_tenant_continues():
    from test_prefix_cache import InProcessEngine, load_model, load_processor

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
    from test_prefix_cache import InProcessEngine, load_model, load_processor

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
    from test_prefix_cache import InProcessEngine, load_model, load_processor
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
