"""Unverified ``continue`` turns on the decode worker's own cache of the previous turn, through the gateway's
public API over real gRPC: with nothing dropped a follow-up answers as ``model.generate()`` on the whole
conversation, whether its answer is a fixed one or the model's own (whose positions the kept cache then
serves); compressed, the cache is the first turn's kept tokens plus every later one; a verified turn stays on
the prefill worker; a kept cache that is gone is served the usual way, with the same tokens."""

from __future__ import annotations

import pytest
from conversations import MAX_NEW, chat_request, conversation, conversation_cluster, png, reference, run


@pytest.fixture(scope="module")
def cluster(tiny_model_dirs):
    c = conversation_cluster(tiny_model_dirs("llava-gqa"))
    yield c
    c.close()


def ask(cluster, messages, image: bytes, **kw):
    req = chat_request(messages, image, **kw)
    req.reuse.conversation = "continue"
    return run(cluster.stub, req)


def kept(cluster):
    return cluster.decode.servicer.engine.core.retained


def own_answer(messages, answer: str) -> list[dict]:
    """``messages`` (ending with a user turn) answered with ``answer``, then asked the next question."""
    return [
        *messages,
        {"role": "assistant", "content": [{"type": "text", "text": answer}]},
        {"role": "user", "content": [{"type": "text", "text": "and the other one ?"}]},
    ]


def test_full_cache_turns_on_the_decode_workers_cache_equal_generate(cluster):
    image = png(51)
    for turns in (1, 2, 3):
        got, usage = ask(cluster, conversation(turns), image)
        assert got == reference(cluster, conversation(turns), image), turns
        assert usage.continued_on == ("decode" if turns > 1 else "")
        assert usage.compression_ratio == pytest.approx(1.0)
    assert kept(cluster).continued >= 2 and cluster.decode.servicer.load().retained >= 1


def test_the_models_own_answer_is_served_from_the_kept_positions(cluster):
    image = png(52)
    first = conversation(1)
    tokens, usage1 = ask(cluster, first, image)
    answer = cluster.processor.tokenizer.decode(tokens, skip_special_tokens=True)
    follow = own_answer(first, answer)
    got, usage2 = ask(cluster, follow, image)
    assert got == reference(cluster, follow, image)
    assert usage2.continued_on == "decode"
    # the answer's tokens were in the kept cache (all but its last, which never went in), not fed again
    assert usage2.cached_prompt_tokens > usage1.prompt_tokens
    assert usage2.cached_prompt_tokens <= usage1.prompt_tokens + len(tokens)


def test_a_compressed_turn_keeps_the_first_turns_tokens_and_every_later_one(cluster):
    image = png(53)
    _, first = ask(cluster, conversation(1), image, policy="vlcache", budget=0.1)
    _, second = ask(cluster, conversation(2), image, policy="vlcache", budget=0.1)
    new = second.prompt_tokens - first.prompt_tokens
    assert second.continued_on == "decode" and second.continued_tokens == new > 0
    assert list(second.layer_budgets) == [k + new for k in first.layer_budgets]
    assert second.compression_ratio < 1.0


def test_a_verified_turn_stays_on_the_prefill_worker(cluster):
    image = png(54)
    ask(cluster, conversation(1), image, policy="vlcache", budget=0.1)
    req = chat_request(conversation(2), image, policy="vlcache", budget=0.1)
    req.reuse.conversation = "continue"
    req.compression.verify = "select"
    _, usage = run(cluster.stub, req)
    assert usage.verify == "select" and usage.continued_on != "decode"


def test_a_kept_cache_that_is_gone_is_served_the_usual_way(cluster):
    image = png(55)
    ask(cluster, conversation(1), image)
    cluster.run(_give_back(cluster))  # as a burst of other requests would take its blocks
    assert len(kept(cluster)) == 0
    metrics = cluster.gateway.servicer.metrics
    before = metrics.kept_turns.labels("gone")._value.get()
    got, usage = ask(cluster, conversation(2), image)
    assert got == reference(cluster, conversation(2), image)
    assert usage.continued_on != "decode" and len(got) <= MAX_NEW
    assert metrics.kept_turns.labels("gone")._value.get() == before + 1


async def _give_back(cluster) -> None:
    kept(cluster).clear()


def test_status_and_metrics_report_the_kept_turns(cluster):
    from vlkv.v1 import admin_pb2, admin_pb2_grpc

    reg = cluster.gateway.servicer.metrics.registry

    def events(name: str) -> float:
        return reg.get_sample_value("vlkv_kept_turns_total", {"event": name}) or 0

    before = {e: events(e) for e in ("kept", "continued")}
    image = png(56)
    ask(cluster, conversation(1), image)
    ask(cluster, conversation(2), image)
    assert events("kept") - before["kept"] == 2 and events("continued") - before["continued"] == 1
    status = admin_pb2_grpc.AdminStub(cluster.channel).GetStatus(admin_pb2.StatusRequest(), timeout=10)
    (decode,) = [w for w in status.workers if w.kind == "decode"]
    assert decode.retained == len(kept(cluster)) >= 1
    assert decode.retained_blocks == kept(cluster).held > 0


def test_vlkv_status_prints_each_decode_workers_kept_turns(cluster, capsys):
    from types import SimpleNamespace

    from vlkv.deploy.cli.status import cmd_status

    ask(cluster, conversation(1), png(57))
    args = SimpleNamespace(address=cluster.gateway.address, token="", tls_ca="", events=5)
    assert cmd_status(args) == 0
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("kept turns ")]
    caches, blocks = (int(w) for w in line.split(": ")[1].split()[0:4:3])  # "N caches in B idle blocks"
    assert caches >= 1 and blocks >= caches and "given back whenever a request needs them" in line
