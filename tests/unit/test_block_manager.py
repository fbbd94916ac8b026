"""Block manager accounting (exact block ids, refusals) and the K/V cache layout."""

from __future__ import annotations

import random

import pytest
import torch
from vlkv.decode_worker.block_manager import AdmissionPolicy, AdmissionRefusal, BlockManager, RefusalKind
from vlkv.decode_worker.kv_cache import KVCache


def test_random_allocate_free_keeps_exact_accounting():
    pool = BlockManager(num_blocks=300, block_size=4)
    rng = random.Random(0)
    live = []
    for _ in range(5000):
        if live and (rng.random() < 0.45 or pool.num_free < 20):
            pool.free(live.pop(rng.randrange(len(live))))
        else:
            lengths = [rng.randint(1, 20) for _ in range(rng.randint(1, 4))]
            extra = rng.randint(0, 6)
            need = pool.blocks_needed(lengths, extra)
            before = pool.num_free
            got = pool.allocate(lengths, extra)
            if need > before:
                assert got is None and pool.num_free == before
            else:
                assert got is not None and pool.num_free == before - need
                assert [len(t) for t in got.tables] == [-(-(n + extra) // 4) for n in lengths]
                live.append(got)
        owned = [b for s in live for t in s.tables for b in t]
        assert len(owned) == len(set(owned)), "a block is owned twice"
        assert len(owned) + pool.num_free == pool.num_blocks
    for s in live:
        pool.free(s)
    assert pool.num_free == pool.num_blocks


def test_random_allocate_append_free_keeps_exact_accounting():
    pool = BlockManager(num_blocks=120, block_size=4)
    rng = random.Random(1)
    live: list[tuple[object, list[int]]] = []  # (blocks, per layer tokens)
    appended = refused = 0
    for _ in range(5000):
        r = rng.random()
        if live and r < 0.2:
            pool.free(live.pop(rng.randrange(len(live)))[0])
        elif live and r < 0.8:
            blocks, lengths = live[rng.randrange(len(live))]
            need = pool.blocks_to_append(blocks, lengths)
            before = pool.num_free
            if pool.append(blocks, lengths):
                appended += 1
                assert pool.num_free == before - need
                lengths[:] = [n + 1 for n in lengths]
            else:
                refused += 1
                assert need > before and pool.num_free == before  # all or nothing
        else:
            lengths = [rng.randint(1, 9) for _ in range(3)]
            got = pool.allocate(lengths, 0)
            if got is not None:
                live.append((got, lengths))
        for blocks, lengths in live:  # every token has a slot; no layer holds a block it does not need
            assert all(-(-n // 4) == len(t) for t, n in zip(blocks.tables, lengths, strict=True))
        owned = [b for s, _ in live for t in s.tables for b in t]
        assert len(owned) == len(set(owned)) and len(owned) + pool.num_free == pool.num_blocks
    assert appended > 1000 and refused > 0
    for blocks, _ in live:
        pool.free(blocks)
    assert pool.num_free == pool.num_blocks


def test_double_free_raises():
    pool = BlockManager(8, 4)
    s = pool.allocate([3], 0)
    pool.free(s)
    with pytest.raises(RuntimeError):
        pool.free(type(s)([[s_id for s_id in range(1)]]))


@pytest.mark.parametrize("n", [1, 4, 5, 13])
def test_write_read_roundtrip(n):
    pool, cache = BlockManager(64, 4), KVCache(64, 4, num_kv_heads=2, head_dim=8)
    s = pool.allocate([n], 3)
    k, v = torch.randn(2, n, 8), torch.randn(2, n, 8)
    cache.write(s.tables[0], k, v)
    rk, rv = cache.read(s.tables[0], n)
    assert torch.equal(rk, k) and torch.equal(rv, v)


def test_from_bytes_sizes_pool():
    pool = KVCache.from_bytes(1 << 20, 16, 2, 64, torch.float16)
    assert pool.num_blocks == (1 << 20) // (2 * 2 * 16 * 64 * 2)
    with pytest.raises(ValueError):
        KVCache.from_bytes(10, 16, 2, 64, torch.float16)


# -- exact block ids and refusals on tiny pools (vLLM v1 kv_cache_manager style) ----------------------------


def test_blocks_are_handed_out_lowest_first_and_come_back_in_holding_order():
    pool = BlockManager(8, 4)
    s = pool.allocate([5, 1], 0)
    assert s.tables == [[0, 1], [2]] and pool.num_free == 5
    assert pool.blocks_to_append(s, [5, 1]) == 0 and pool.append(s, [5, 1]) and s.tables == [[0, 1], [2]]
    assert pool.can_append(s, [8, 4]) and pool.blocks_to_append(s, [8, 4]) == 2
    assert pool.append(s, [8, 4]) and s.tables == [[0, 1, 3], [2, 4]] and pool.num_free == 3
    pool.free(s)
    assert s.tables == [[], []] and pool.num_free == 8
    assert pool.allocate([20], 0).tables == [[0, 1, 3, 2, 4]]  # freed blocks are reused first
    assert pool.allocate([13], 0) is None and pool.num_free == 3  # 4 blocks wanted, 3 free: nothing taken
    assert pool.allocate([9], 0).tables == [[5, 6, 7]] and pool.num_free == 0


def test_append_is_all_or_nothing_across_layers():
    pool = BlockManager(3, 2)
    s = pool.allocate([2, 2], 0)
    assert s.tables == [[0], [1]]
    assert not pool.can_append(s, [2, 2]) and not pool.append(s, [2, 2])  # two layers full, one block free
    assert s.tables == [[0], [1]] and pool.num_free == 1
    assert pool.append(s, [2, 1]) and s.tables == [[0, 2], [1]] and pool.num_free == 0


def test_admission_refusals_carry_their_kind():
    grow = BlockManager(10, 4, AdmissionPolicy.from_config("grow", 0.1, 10))
    assert grow.policy == AdmissionPolicy(reserve=False, watermark_blocks=1) and not grow.reserves_new_tokens
    never = grow.admit([30], 20)  # 13 blocks with its new tokens: more than the whole pool
    assert isinstance(never, AdmissionRefusal) and never.kind is RefusalKind.NEVER_FITS
    assert "the pool has 10" in never.message and grow.num_free == 10
    assert grow.admit([8, 8], 10).tables == [[0, 1], [2, 3]]  # grow: only the cache's own blocks
    assert grow.admit_room() == 5 and grow.admit_room(swapped=1) == 0
    full = grow.admit([4], 1, swapped=1)  # preempted sequences waiting: no room for new caches
    assert isinstance(full, AdmissionRefusal) and full.kind is RefusalKind.POOL_FULL
    assert full.message.startswith("KV pool full") and grow.num_free == 6
    assert grow.admit([20], 0).tables == [[4, 5, 6, 7, 8]]  # leaves the 1-block watermark
    assert grow.admit([1], 0).kind is RefusalKind.POOL_FULL and grow.num_free == 1
    reserve = BlockManager(10, 4, AdmissionPolicy.from_config("reserve", 0.1, 10))
    assert reserve.reserves_new_tokens and reserve.admit_need([4], 4) == 2
    assert reserve.admit([4], 4).tables == [[0, 1]] and reserve.admit_room() == 8
