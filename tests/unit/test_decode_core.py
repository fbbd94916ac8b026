"""The synchronous decode core without a model: a fake runner whose next token depends on every cached K/V
value, so a swap-out/swap-in that lost or moved a value would change the tokens."""

from __future__ import annotations

import torch
from fake_runner import FakeRunner
from vlkv.common.sampling import SamplingConfig
from vlkv.decode_worker.block_manager import BlockManager
from vlkv.decode_worker.core import DecodeCore
from vlkv.decode_worker.kv_cache import KVCache
from vlkv.decode_worker.sequence import FinishReason, Sequence, SequenceStatus

MAX_NEW = 12


def _decode(num_blocks: int, n_seqs: int = 4) -> tuple[dict[str, list[int]], DecodeCore]:
    blocks, cache = BlockManager(num_blocks, 4), KVCache(num_blocks, 4, num_kv_heads=2, head_dim=3)
    core = DecodeCore(FakeRunner(cache), blocks, cache, max_batch=8, swap_bytes=1 << 20)
    g = torch.Generator().manual_seed(0)
    seqs = []
    for i in range(n_seqs):
        lengths = [9 + i, 5]
        seq_blocks = blocks.allocate(lengths, 0)
        for table, n in zip(seq_blocks.tables, lengths, strict=True):
            cache.write(
                table, torch.randint(0, 9, (2, n, 3), generator=g).float(), torch.randn(2, n, 3, generator=g)
            )
        seq = Sequence(f"r{i}", seq_blocks, lengths, 20 + i, i, SamplingConfig(max_new_tokens=MAX_NEW))
        assert core.add(seq).token_ids == [i] and seq.status is SequenceStatus.WAITING
        seqs.append(seq)
    finished = []
    while core.has_work:
        result = core.step()
        for delta in result.deltas:
            assert delta.seq.generated[-1] == delta.token_ids[0]
        finished += result.finished
    assert sorted(s.request_id for s in finished) == [s.request_id for s in seqs]
    assert all(
        s.status is SequenceStatus.FINISHED_LENGTH and s.finish_reason is FinishReason.LENGTH for s in seqs
    )
    assert blocks.num_free == num_blocks and core.scheduler.swap_used == 0
    return {s.request_id: s.generated for s in seqs}, core


def test_preempted_sequences_continue_bit_for_bit():
    roomy, big = _decode(200)
    tight, small = _decode(24)  # 4 + 2 blocks each at first, 6 + 6 at the end: they cannot all grow
    assert big.scheduler.preemptions == 0 and small.scheduler.preemptions > 0
    assert tight == roomy and all(len(t) == MAX_NEW for t in tight.values())
    assert [t[0] for t in tight.values()] == [0, 1, 2, 3]  # generated starts with the prefill's token


def test_step_without_work_is_empty():
    blocks, cache = BlockManager(4, 4), KVCache(4, 4, 1, 2)
    core = DecodeCore(FakeRunner(cache), blocks, cache, max_batch=2)
    assert not core.has_work and core.step().deltas == [] and core.step().finished == []


def _one(core: DecodeCore, blocks: BlockManager, cache: KVCache, **kw) -> Sequence:
    seq_blocks = blocks.allocate([5, 5], 0)
    for table in seq_blocks.tables:
        cache.write(table, torch.ones(2, 5, 3), torch.ones(2, 5, 3))
    return Sequence("r", seq_blocks, [5, 5], 20, 1, SamplingConfig(max_new_tokens=MAX_NEW), **kw)


def test_the_core_applies_the_stop_rules_and_frees_the_blocks():
    blocks, cache = BlockManager(64, 4), KVCache(64, 4, num_kv_heads=2, head_dim=3)
    core = DecodeCore(FakeRunner(cache), blocks, cache, max_batch=8)
    first = _one(core, blocks, cache, eos_token_ids=frozenset({1}))  # the prefill's token is an EOS
    assert core.add(first).token_ids == [] and first.status is SequenceStatus.FINISHED_EOS
    assert blocks.num_free == 64 and not core.has_work
    seq = _one(core, blocks, cache)
    core.add(seq)
    core.step()
    eos = seq.generated[-1]  # the fake runner is deterministic: the same cache gives the same token
    core.end(seq, FinishReason.CANCELLED)
    assert seq.status is SequenceStatus.FINISHED_CANCELLED and blocks.num_free == 64 and not core.has_work
    seq = _one(core, blocks, cache, eos_token_ids=frozenset({eos}))
    core.add(seq)
    out = core.step()
    assert out.finished == [seq] and seq.finish_reason is FinishReason.EOS and out.deltas[0].token_ids == []
    assert seq.usage.generated_tokens == 2 and blocks.num_free == 64
