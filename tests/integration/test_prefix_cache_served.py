"""The prefill worker's prefix cache through gRPC: a follow-up turn prefills only the tokens after the cached
prefix of its prompt, and with compression off its greedy tokens equal ``model.generate()`` on the whole
conversation; ``reuse = "off"`` neither reads nor fills the cache. (The engine itself:
tests/unit/test_prefix_cache.py.)"""

from __future__ import annotations

import pytest
from conversations import chat_request, conversation, png, reference, run
from inproc_cluster import InProcCluster
from vlkv.common.config import ModelConfig, PoolConfig, ServerConfig


@pytest.fixture(scope="module")
def cluster(tiny_model_dirs):
    cfg = ServerConfig(
        model=ModelConfig(path=tiny_model_dirs("llava-gqa")),
        pool=PoolConfig(pool_bytes=8 << 20),
        image_cache_mb=0,  # the prefix cache alone
        prefix_block=4,
    )
    c = InProcCluster(cfg)
    yield c
    c.close()


def test_follow_up_turns_equal_generate_on_the_whole_conversation(cluster):
    image = png(1)
    for turns in (1, 2, 3):
        messages = conversation(turns)
        got, usage = run(cluster.stub, chat_request(messages, image))
        want = reference(cluster, messages, image)
        assert got == want, (turns, got, want)
        if turns == 1:
            assert usage.cached_prompt_tokens == 0
        else:  # the earlier turns' prompt came from the cache, only the rest was prefilled
            assert 0 < usage.cached_prompt_tokens < usage.prompt_tokens
    stats = cluster.prefill.servicer.load().prefix_cache
    assert stats.hits >= 2 and stats.blocks > 0 and stats.bytes_held <= stats.capacity_bytes


def test_reuse_off_neither_reads_nor_fills(cluster):
    image = png(2)
    req = chat_request(conversation(2), image)
    req.reuse.reuse = "off"
    before = cluster.prefill.servicer.load().prefix_cache
    _, usage = run(cluster.stub, req)
    after = cluster.prefill.servicer.load().prefix_cache
    assert usage.cached_prompt_tokens == 0
    assert (after.lookups, after.blocks) == (before.lookups, before.blocks)
