"""Continuation on the compressed cache through gRPC (``ReuseParams.conversation = "continue"``, opt-in): a
follow-up turn's new tokens appended to the compact cache of the previous turn. With nothing dropped it answers as
``model.generate()`` on the whole conversation; compressed, its cache is the earlier turn's kept tokens plus
every new token; a request that did not opt in is prefilled and compressed as usual; usage says a verified
follow-up continued. (The prefill engine's side: tests/unit/test_continuation_engine.py.)"""

from __future__ import annotations

import grpc
import pytest
from conversations import chat_request, conversation, conversation_cluster, png, reference, run


@pytest.fixture(scope="module")
def cluster(tiny_model_dirs):
    c = conversation_cluster(tiny_model_dirs("llava-gqa"))
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
