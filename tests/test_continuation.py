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
