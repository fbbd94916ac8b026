"""Decode-phase re-compression (``--decode-budget``): the block manager's budget and ``shrink``, the pool's
in-place ``compact`` (fp and int8), and the decode core on a tiny random LLaVA: layers are cut back to
their budget by accumulated attention mass, blocks go back to the pool, and positions keep counting from
the true length.
"""

from __future__ import annotations

import pytest
import torch
from prefilled_caches import load_tiny, prefilled_caches
from vlkv.common.handoff.quantize import quantize_k, quantize_v
from vlkv.common.sampling import SamplingConfig
from vlkv.decode_worker.block_manager import BlockManager, recompress_budget, recompress_target
from vlkv.decode_worker.kv_cache import KVCache
from vlkv.deploy.inprocess import InProcessEngine


def test_budget_and_trigger():
    assert recompress_budget(100, 0.5, 16) == 66
    # a layer is cut back to its budget only once it holds a block (16) more than that
    assert recompress_target(100, 81, 0.5, 16, 16) == 81
    assert recompress_target(100, 82, 0.5, 16, 16) == 66
    assert recompress_target(100, 500, 0.0, 16, 16) == 500  # budget 0: off


def test_shrink_frees_the_blocks_past_the_kept_tokens():
    bm = BlockManager(20, 4)
    seq = bm.allocate([10, 3], 0)
    assert seq is not None and bm.num_free == 20 - 4
    first = list(seq.tables[0])
    assert bm.shrink(seq, 0, 5) == 1 and seq.tables[0] == first[:2] and bm.num_free == 20 - 3
    assert bm.shrink(seq, 1, 3) == 0
    bm.free(seq)
    assert bm.num_free == 20  # the shrunk-away block was not freed twice


@pytest.mark.parametrize("kv_dtype", ["fp16", "int8"])
def test_compact_keeps_the_chosen_tokens_in_order(kv_dtype):
    cache = KVCache(10, 4, 2, 8, torch.float32, kv_dtype=kv_dtype)
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 11, 8, generator=g), torch.randn(2, 11, 8, generator=g)
    table = [5, 1, 8]
    if kv_dtype == "int8":
        (k, ks), (v, vs) = quantize_k(k), quantize_v(v)
        cache.write(table, k, v, ks, vs)
    else:
        cache.write(table, k, v)
    keep = torch.tensor([0, 2, 3, 7, 9, 10])
    cache.compact(table, keep)
    got = cache.read(table, len(keep))
    assert torch.equal(got[0], k[:, keep]) and torch.equal(got[1], v[:, keep])
    if kv_dtype == "int8":
        assert torch.equal(got[2], ks) and torch.equal(got[3], vs[:, keep])


@pytest.fixture(scope="module")
def tiny(tiny_model_dirs):
    return load_tiny(tiny_model_dirs("llava-gqa"))


@pytest.mark.parametrize("kv_dtype", ["fp16", "int8"])
def test_core_cuts_layers_back_frees_blocks_and_keeps_positions(tiny, kv_dtype):
    model, proc = tiny
    kw = dict(pool_bytes=4 << 20, block_size=4, kv_dtype=kv_dtype)
    engine = InProcessEngine(model, proc, decode_budget=0.5, decode_window=8, **kw)
    caches = prefilled_caches(engine, 2)
    steps, positions = [], []
    real_step = engine.core.runner.step

    def spy(batch, mass=False):
        assert mass  # re-compression asks the runner for the attention mass
        positions.append([s.position for s in batch])
        out = real_step(batch, mass)
        assert engine.core.runner.last_mass.shape[:2] == (len(batch), len(batch[0].tables))
        return out

    engine.core.runner.step = spy
    real_post = engine.core.postprocess

    def post(batch, logits):
        out = real_post(batch, logits)
        for s in batch:
            if s.finished:  # its last token: the core freed its blocks
                continue
            budgets = [recompress_budget(n, 0.5, 8) for n in s.prompt_lengths]
            assert all(n < b + 4 for n, b in zip(s.lengths, budgets, strict=True))  # never a block past
            assert [len(t) for t in s.blocks.tables] == [-(-n // 4) for n in s.lengths]  # no spare blocks
            steps.append(sum(s.lengths))
        return out

    engine.core.postprocess = post
    free_before = engine.blocks.num_free
    out = engine.decode_caches(caches, SamplingConfig(max_new_tokens=70), eos_ids=())
    assert [len(g) for g in out] == [70, 70]
    assert engine.core.evicted_tokens > 0
    # positions count from each prompt's true length, one per step, whatever the cache holds
    for i, c in enumerate(caches):
        assert [p[i] for p in positions] == list(range(c.prompt_length, c.prompt_length + 69))
    assert engine.blocks.num_free == free_before


def test_budget_never_reached_changes_nothing(tiny):
    model, proc = tiny
    kw = dict(pool_bytes=4 << 20, block_size=4)
    off = InProcessEngine(model, proc, **kw)
    on = InProcessEngine(model, proc, decode_budget=50.0, **kw)  # mass accumulated, no layer ever cut
    caches = prefilled_caches(off, 2)
    sampling = SamplingConfig(max_new_tokens=20)
    assert off.decode_caches(caches, sampling, ()) == on.decode_caches(caches, sampling, ())
    assert on.core.evicted_tokens == 0


def test_recompressed_sequence_still_decodes_sensibly(tiny):
    """Tokens before the first cut are the uncut run's (the cut happens only once a layer outgrows its
    budget by a block), and the run goes on to its full length afterwards."""
    model, proc = tiny
    kw = dict(pool_bytes=4 << 20, block_size=4)
    off = InProcessEngine(model, proc, **kw)
    on = InProcessEngine(model, proc, decode_budget=0.5, decode_window=8, **kw)
    caches = prefilled_caches(off, 1)
    sampling = SamplingConfig(max_new_tokens=40)
    a, b = off.decode_caches(caches, sampling, ())[0], on.decode_caches(caches, sampling, ())[0]
    first_cut = min(
        recompress_budget(n, 0.5, 8) + 4 - n for n in caches[0].layer_lengths
    )  # steps until the earliest layer is cut
    assert first_cut > 1 and a[:first_cut] == b[:first_cut] and len(b) == 40
