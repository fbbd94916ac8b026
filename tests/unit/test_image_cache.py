"""The image cache (bytes bound, LRU, tenants, refusing foreign or corrupt entries) and the reuse schedule."""

from __future__ import annotations

import pytest
import torch
from vlkv.prefill_worker.image_cache import ImageCache, ImageEntry, ImageKey
from vlkv.prefill_worker.reuse_schedule import (
    Calibration,
    default_sensitivity,
    greedy_ratios,
    layer_ratios,
    load_calibration,
    recomputed_counts,
)

LAYOUT = (2, 2, 4)  # layers, kv heads, head dim
HIDDEN = 8


def entry(n: int = 3, fp: str = "fp", fill: float = 1.0) -> ImageEntry:
    layers, heads, dim = LAYOUT
    return ImageEntry(
        fingerprint=fp,
        features=torch.full((n, HIDDEN), fill),
        keys=[torch.full((heads, n, dim), fill) for _ in range(layers)],
        values=[torch.full((heads, n, dim), fill) for _ in range(layers)],
        start=5,
        prefix_hash="p",
    )


def get(cache: ImageCache, key: ImageKey, n: int = 3):
    return cache.get(key, num_tokens=n, layout=LAYOUT, hidden=HIDDEN)


def test_never_exceeds_its_bytes_and_evicts_least_recently_used():
    size = entry().nbytes
    cache = ImageCache(3 * size + size // 2)
    keys = [ImageKey("fp", f"img{i}", "t") for i in range(6)]
    for k in keys[:3]:
        assert cache.put(k, entry())
    assert get(cache, keys[0]) is not None  # keys[0] is now the most recently used
    for k in keys[3:]:
        cache.put(k, entry())
        assert cache.bytes_held <= cache.capacity
    assert len(cache) == 3 and cache.bytes_held == 3 * size
    assert keys[0] not in cache or keys[1] not in cache
    assert keys[5] in cache and keys[4] in cache and keys[1] not in cache and keys[2] not in cache
    stats = cache.stats()
    assert stats.evictions == 3 and stats.bytes_held == 3 * size


def test_an_entry_larger_than_the_cache_is_not_stored_and_evicts_nothing():
    small = ImageCache(entry().nbytes)
    small.put(ImageKey("fp", "a", "t"), entry())
    assert not small.put(ImageKey("fp", "b", "t"), entry(n=10))
    assert ImageKey("fp", "a", "t") in small and small.stats().evictions == 0
    assert not ImageCache(0).enabled


def test_tenants_never_share_entries():
    cache = ImageCache(1 << 20)
    cache.put(ImageKey("fp", "img", "alice"), entry(fill=1.0))
    assert get(cache, ImageKey("fp", "img", "bob")) is None
    cache.put(ImageKey("fp", "img", "bob"), entry(fill=2.0))
    assert float(get(cache, ImageKey("fp", "img", "alice")).features[0, 0]) == 1.0
    assert float(get(cache, ImageKey("fp", "img", "bob")).features[0, 0]) == 2.0


@pytest.mark.parametrize(
    "bad",
    [
        lambda e: setattr(e, "fingerprint", "other-model"),
        lambda e: e.keys.pop(),  # a layer missing
        lambda e: e.values.__setitem__(1, torch.zeros(2, 4, 4)),  # wrong token count
        lambda e: e.keys.__setitem__(0, torch.zeros(3, 3, 4)),  # wrong KV heads
        lambda e: setattr(e, "features", torch.zeros(3, HIDDEN + 1)),  # wrong hidden size
        lambda e: e.features.__setitem__((0, 0), float("nan")),  # corrupt numbers
    ],
)
def test_a_foreign_or_corrupt_entry_is_never_served_and_is_dropped(bad):
    cache = ImageCache(1 << 20)
    key = ImageKey("fp", "img", "t")
    e = entry()
    cache.put(key, e)
    bad(e)  # corrupted in place after it was stored
    assert get(cache, key) is None
    assert key not in cache and cache.stats().rejected == 1


def test_an_entry_is_looked_up_for_the_model_that_asks():
    cache = ImageCache(1 << 20)
    cache.put(ImageKey("fp", "img", "t"), entry())
    assert get(cache, ImageKey("fp2", "img", "t")) is None  # another model's key: its own namespace
    assert get(cache, ImageKey("fp", "img", "t"), n=4) is None  # a different token count: refused
    with pytest.raises(ValueError):
        cache.put(ImageKey("fp2", "x", "t"), entry(fp="fp"))


def test_greedy_ratios_are_tenths_non_increasing_and_within_budget():
    sens = default_sensitivity(6)
    for steps in range(0, 61):
        r = greedy_ratios(sens, steps)
        assert all(abs(x * 10 - round(x * 10)) < 1e-9 for x in r)
        assert all(a >= b for a, b in zip(r, r[1:], strict=False))
        assert abs(sum(r) - steps / 10) < 1e-9
    # a sensitive deep layer pulls budget down to it (through the layers above it)
    sens = [[1.0 - k / 10 * 0.01 for k in range(11)] for _ in range(3)]
    sens[2] = [1.0 - k / 10 for k in range(11)]
    assert greedy_ratios(sens, 6) == [0.2, 0.2, 0.2]


def test_layer_ratios_by_mode_and_counts():
    assert layer_ratios("none", 0.5, 4) == [0.0] * 4
    assert layer_ratios("mpic", 0.05, 4) == [0.05] * 4
    assert layer_ratios("layerwise", 1.0, 4) == [1.0] * 4
    assert layer_ratios("layerwise", 0.1, 4) == [0.1, 0.1, 0.1, 0.1]
    assert layer_ratios("layerwise", 0.05, 4) == [0.1, 0.1, 0.0, 0.0]  # layer 0 alone would change nothing
    assert sum(layer_ratios("layerwise", 0.05, 4)) == pytest.approx(0.2)
    assert recomputed_counts([0.2, 0.1, 0.0], 36) == [8, 4, 0]
    assert recomputed_counts([0.05] * 2, 36) == [2, 2]
    assert recomputed_counts([1.0, 1.0], 36) == [36, 36]


def test_calibration_is_json_beside_the_model_and_only_for_that_model(tmp_path):
    cal = Calibration("fp", [[1.0 - k / 10 for k in range(11)]] * 2, examples=3, metric="kl")
    (tmp_path / "reuse_calibration.json").write_text(cal.to_json())
    assert load_calibration(tmp_path, "fp", 2) == cal
    assert load_calibration(tmp_path, "other", 2) is None
    assert load_calibration(tmp_path, "fp", 3) is None
    (tmp_path / "reuse_calibration.json").write_text('{"fingerprint": "fp", "sensitivity": [[1, 2]]}')
    assert load_calibration(tmp_path, "fp", 1) is None
    assert load_calibration(tmp_path / "missing", "fp", 2) is None
