"""The lab's policy ``vlcache_lab`` (``vlkv_lab.eval.lab_policy``): vlcache with the options no default,
candidate or baseline uses (``post_vision_max``, ``post_vision_layers``, ``question_min``/``question_max``,
``chunk_size``). It equals vlcache until an option is set, the product's vlcache refuses those options, and a
policy registered in a process is a request's choice there (``registry.register_policy``)."""

from __future__ import annotations

import pytest
import torch
import vlkv_lab.eval.lab_policy  # noqa: F401  (registers vlcache_lab)
from policy_stats import column_stats
from vlkv.common.compression import ByBudget, get_policy, policy_from_dict, preset
from vlkv.common.compression.registry import (
    POLICY_NAMES,
    CompressionSettings,
    policy_names,
    register_policy,
)
from vlkv.common.compression.vlcache import VLCachePolicy
from vlkv_lab.eval.lab_policy import VLCacheLabPolicy

LAB_OPTIONS = ("post_vision_max", "post_vision_layers", "question_min", "question_max", "chunk_size")


def test_the_product_policy_refuses_the_lab_options_and_the_lab_policy_is_registered_here_only():
    for option in LAB_OPTIONS:
        with pytest.raises(ValueError, match=option):
            get_policy("vlcache", **{option: 2})
        with pytest.raises(ValueError, match=option):
            policy_from_dict({"policy": "vlcache", option: 2})
        assert not hasattr(VLCachePolicy(), option)
    assert "vlcache_lab" in policy_names() and "vlcache_lab" not in POLICY_NAMES
    assert (
        CompressionSettings("vlcache_lab", 0.1).build_policy().text.name != "vlcache_lab"
    )  # vlcache's route
    lab = get_policy("vlcache_lab", chunk_size=4, question_max=30)
    assert policy_from_dict(lab.to_dict()) == lab


@pytest.mark.parametrize("tau", [20, 120])
def test_with_every_option_off_it_is_vlcache(tau):
    m, layers = 120, 3
    gen = torch.Generator().manual_seed(7)
    keys = [torch.randn(2, m, 4, generator=gen) for _ in range(layers)]
    plain, lab = get_policy("vlcache", lookahead=0), get_policy("vlcache_lab", lookahead=0)
    assert plain.query_start(m, tau, 30) == lab.query_start(m, tau, 30)
    stats = [
        column_stats(torch.rand(4, m, generator=gen), m - plain.query_start(m, tau)) for _ in range(layers)
    ]
    ours = lab.compress(stats, keys, keys, alpha=0.2, m=m, tau=tau, question=30)
    theirs = plain.compress(stats, keys, keys, alpha=0.2, m=m, tau=tau, question=30)
    assert all(torch.equal(a, b) for a, b in zip(ours.kept_indices, theirs.kept_indices, strict=True))


def test_register_policy_refuses_a_taken_name_and_what_is_not_a_policy():
    register_policy(VLCacheLabPolicy)  # the same class again (a re-imported module): a no-op

    class Other(VLCachePolicy):
        name = "vlcache_lab"

    for bad in (Other, int, VLCachePolicy.__mro__[1]):
        with pytest.raises(ValueError):
            register_policy(bad)
    with pytest.raises(ValueError, match="text preset"):

        class Fresh(VLCachePolicy):
            name = "fresh_lab_policy"

        register_policy(Fresh, text_preset="no_such_preset")
    assert "fresh_lab_policy" not in policy_names()


def test_a_budget_switch_refuses_halves_whose_question_windows_differ():
    high = preset("vlcache_text_span")
    low = get_policy("vlcache_lab", text_preset="", text_window=24, question_max=40)
    with pytest.raises(ValueError, match="statistics rows"):
        ByBudget(high=high, low=low, below=0.05)
    same = get_policy("vlcache_lab", text_preset="", text_window=24)  # the option off: the same rows
    assert ByBudget(high=high, low=same, below=0.05).low is same


def test_post_vision_window_in_the_first_layers_only():
    """post_vision_layers=1: layer 0 keeps the question's window, every later layer the recent window alone,
    through plan's layer index; the option round-trips and refuses a negative count."""
    from vlkv.common.compression import policy_from_dict

    m, k, tau, layers = 800, 40, 30, 3
    col = torch.arange(m, dtype=torch.float32).flip(0).repeat(2, 1)  # older tokens score higher
    stats = [column_stats(col, tau)] * layers
    keys = [torch.zeros(1, m, 4)] * layers
    params = {"pool_kernel": 1, "lookahead": 0, "allocator": "uniform"}
    first = get_policy("vlcache_lab", post_vision_layers=1, post_vision_window=True, **params)
    window = get_policy("vlcache_lab", post_vision_window=True, **params)
    none = get_policy("vlcache_lab", post_vision_window=False, **params)
    kept = first.plan(stats, keys, keys, alpha=k / m, m=m, tau=tau)
    with_window = torch.cat([torch.arange(k - 24), torch.arange(m - 24, m)])  # 20 of the question + 4 recent
    recent_only = torch.cat([torch.arange(k - 4), torch.arange(m - 4, m)])
    assert torch.equal(kept[0][0], with_window) and all(torch.equal(p[0], recent_only) for p in kept[1:])
    assert torch.equal(kept[0], window.plan(stats, keys, keys, alpha=k / m, m=m, tau=tau)[0])
    assert torch.equal(kept[2], none.plan(stats, keys, keys, alpha=k / m, m=m, tau=tau)[2])
    every = get_policy("vlcache_lab", post_vision_layers=5, post_vision_window=True, **params).plan(
        stats, keys, keys, alpha=k / m, m=m, tau=tau
    )
    assert all(torch.equal(p[0], with_window) for p in every)  # more layers than the model: every layer
    assert policy_from_dict(first.to_dict()) == first
    with pytest.raises(ValueError, match="post_vision_layers"):
        get_policy("vlcache_lab", post_vision_layers=-1)


def test_chunks_are_kept_whole_by_their_summed_score():
    m, k, chunk = 100, 12, 5  # recent window 2 (98, 99), 10 scored slots: two chunks
    scores = torch.zeros(1, m)
    scores[0, 33] = 3.0  # the best single token, alone in chunk 30..34 (sum 3)
    scores[0, 60:65] = 1.0  # chunk 60..64, sum 5
    scores[0, 10:15] = torch.tensor([0.1, 0.9, 0.8, 0.7, 0.6])  # chunk 10..14, sum 3.1
    kept = get_policy("vlcache_lab", text_preset="", chunk_size=chunk).select(scores, k, 0)[0].tolist()
    assert kept == list(range(10, 15)) + list(range(60, 65)) + [98, 99]
    # one slot fewer: the third chunk's best token goes, never a chunk before it; the budget stays exact
    kept = get_policy("vlcache_lab", text_preset="", chunk_size=chunk).select(scores, k - 1, 0)[0].tolist()
    assert kept == list(range(11, 15)) + list(range(60, 65)) + [98, 99]
    # sinks still come first
    sinks = get_policy("vlcache_lab", text_preset="", chunk_size=chunk, sink_tokens=2).select(scores, k, 0)[0]
    assert sinks.tolist() == [0, 1, 11, 12, 13] + list(range(60, 65)) + [98, 99]
    with pytest.raises(ValueError, match="chunk_size"):
        get_policy("vlcache_lab", chunk_size=0)


def test_span_and_chunk_options_round_trip_and_keep_the_budget():
    policy = get_policy("vlcache_lab", span_after=6, chunk_size=8)
    data = policy.to_dict()
    image = data["image"]
    assert image["span_after"] == 6 and image["chunk_size"] == 8 and policy_from_dict(data) == policy
    with pytest.raises(ValueError, match="chunk_size"):
        policy_from_dict({"policy": "vlcache_lab", "chunk_size": 2.0})
    m = 300
    scores = torch.rand(3, m, generator=torch.Generator().manual_seed(1))
    for k in (1, 7, 30, 299, 300):
        kept = policy.select(scores, k, 40)
        assert kept.shape == (3, k) and all(len(set(row.tolist())) == k for row in kept)
        assert bool((kept[:, 1:] > kept[:, :-1]).all()) and int(kept.max()) < m
