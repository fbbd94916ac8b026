"""KVPool accounting and layout."""

from __future__ import annotations

import random

import pytest
import torch
from vlkv.decode_worker.kv_pool import KVPool


def test_random_allocate_free_keeps_exact_accounting():
    pool = KVPool(num_blocks=300, block_size=4, num_kv_heads=2, head_dim=8)
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
    pool = KVPool(num_blocks=120, block_size=4, num_kv_heads=1, head_dim=2)
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
    pool = KVPool(8, 4, 1, 2)
    s = pool.allocate([3], 0)
    pool.free(s)
    with pytest.raises(RuntimeError):
        pool.free(type(s)([[s_id for s_id in range(1)]]))


@pytest.mark.parametrize("n", [1, 4, 5, 13])
def test_write_read_roundtrip(n):
    pool = KVPool(64, 4, num_kv_heads=2, head_dim=8)
    s = pool.allocate([n], 3)
    k, v = torch.randn(2, n, 8), torch.randn(2, n, 8)
    pool.write(s.tables[0], k, v)
    rk, rv = pool.read(s.tables[0], n)
    assert torch.equal(rk, k) and torch.equal(rv, v)


def test_from_bytes_sizes_pool():
    pool = KVPool.from_bytes(1 << 20, 16, 2, 64, torch.float16)
    assert pool.num_blocks == (1 << 20) // (2 * 2 * 16 * 64 * 2)
    with pytest.raises(ValueError):
        KVPool.from_bytes(10, 16, 2, 64, torch.float16)
