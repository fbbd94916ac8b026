"""``PoolConfig.batch_invariant``: each sequence's decode step is the one it would get decoding alone.

A matmul's rounding depends on how many rows it multiplies, so a batched step's logits differ in their last
bits from a sequence's solo step (here in float32; in bfloat16 on a real model such a difference flips
greedy tokens, ``vlkv eval api``). With the option the decode worker runs every step on CPU in groups of
one shape, each sequence attending alone: the same bits whatever else is decoding.
"""

from __future__ import annotations

import pytest
import torch
from vlkv.common.config import ModelConfig, PoolConfig
from vlkv.common.model.loading import load_model
from vlkv.common.model.spec import ModelSpec
from vlkv.decode_worker.core import DecodeCore
from vlkv.decode_worker.kv_cache import KVCache
from vlkv.decode_worker.model_runner import ModelRunner, StepInput

LENGTHS = [9, 14, 5, 22, 11, 7, 30, 3]  # tokens cached per sequence (every layer)


@pytest.fixture(scope="module")
def model(tiny_model_dirs):
    return load_model(ModelConfig(path=tiny_model_dirs("llava-gqa")))


def _cache_and_batch(model) -> tuple[KVCache, list[StepInput]]:
    layers = model.config.text_config.num_hidden_layers
    cache = KVCache(256, 4, num_kv_heads=2, head_dim=16)
    g = torch.Generator().manual_seed(0)
    cache.k.copy_(torch.randn(cache.k.shape, generator=g))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g))
    batch, first = [], 0
    for i, n in enumerate(LENGTHS):
        blocks = (n + 1 + 3) // 4  # room for this step's token
        tables = [list(range(first + j * blocks, first + (j + 1) * blocks)) for j in range(layers)]
        first += layers * blocks
        batch.append(StepInput(token=3 + i, position=n + 5, tables=tables, lengths=[n] * layers))
    return cache, batch


def test_each_sequence_gets_its_solo_logits_and_mass(model):
    cache, batch = _cache_and_batch(model)
    runner = ModelRunner(model, cache, batch_invariant=True)
    solo, solo_mass = [], []
    for seq in batch:  # a step writes the token's K/V at its next slot: the same values each time
        solo.append(runner.step([seq], mass=True))
        solo_mass.append(runner.last_mass)
    logits = runner.step(batch, mass=True)
    assert logits.shape == (len(batch), model.config.text_config.vocab_size)
    for i, (one, mass) in enumerate(zip(solo, solo_mass, strict=True)):
        assert torch.equal(logits[i : i + 1], one), f"sequence {i}: batched logits differ from its solo step"
        width = mass.shape[-1]
        assert torch.equal(runner.last_mass[i : i + 1, :, :width], mass)
        assert not runner.last_mass[i, :, width:].any()  # padding past its own blocks


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("group", [3, 5])
def test_groups_and_padding_rows_keep_the_solo_bits(model, monkeypatch, group, threads):
    """A batch longer than a group runs as several groups, the last padded with rows that touch no cache:
    still every sequence's solo bits, and the cache holds what solo steps wrote; also when torch has two
    threads (the step runs on one: with two, row 4 of a group of 5 got other bits than its solo step)."""
    monkeypatch.setattr(ModelRunner, "INVARIANT_ROWS", group)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        cache, batch = _cache_and_batch(model)
        runner = ModelRunner(model, cache, batch_invariant=True)
        solo = [runner.step([seq]) for seq in batch]
        k, v = cache.k.clone(), cache.v.clone()
        logits = runner.step(batch)
        assert torch.get_num_threads() == threads  # the step gives back the threads it took
    finally:
        torch.set_num_threads(before)
    for i, one in enumerate(solo):
        assert torch.equal(logits[i : i + 1], one), f"sequence {i}: batched logits differ from its solo step"
    assert torch.equal(cache.k, k) and torch.equal(cache.v, v)  # the padding rows wrote nothing


def test_batched_step_agrees_with_invariant_one_closely(model):
    """The ordinary batched step computes the same thing up to rounding (so the option changes no result
    beyond the last bits, only where they come from)."""
    cache, batch = _cache_and_batch(model)
    fast = ModelRunner(model, cache).step(batch)
    exact = ModelRunner(model, cache, batch_invariant=True).step(batch)
    torch.testing.assert_close(fast, exact, rtol=1e-4, atol=1e-4)


def test_pool_config_reaches_the_runner(model, tiny_model_dirs):
    spec = ModelSpec.from_model(model)
    core = DecodeCore.from_config(model, spec, PoolConfig(pool_bytes=1 << 20, batch_invariant=True))
    assert core.runner.batch_invariant
    assert not DecodeCore.from_config(model, spec, PoolConfig(pool_bytes=1 << 20)).runner.batch_invariant
