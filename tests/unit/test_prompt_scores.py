"""Prompt-time scores: computed by ``Policy.compress``, carried in the KV header, checked by the decode
worker, and the start of re-compression's accumulated attention mass."""

from __future__ import annotations

import grpc
import pytest
import torch
from kv_wire_helpers import FakePool, encode, feed_all, make_ckv
from policy_stats import TAU, M, make_inputs, stats_for
from prefilled_caches import load_tiny, prefilled_caches
from vlkv.common.compression import get_policy
from vlkv.common.handoff.compact_kv import CompactKV
from vlkv.common.handoff.wire import PROMPT_SCORE_DTYPE, KVWireError, header_prompt_scores
from vlkv.common.sampling import SamplingConfig
from vlkv.deploy.inprocess import InProcessEngine


@pytest.fixture(scope="module")
def tiny(tiny_model_dirs):
    return load_tiny(tiny_model_dirs("llava-gqa"))


@pytest.mark.parametrize("name", ["vlcache", "h2o", "snapkv"])
def test_compress_scores_each_kept_position_per_covered_row(name):
    """Position t of layer l: the attention (column sum over the covered rows, every query head of its
    KV head's group) of the token each KV head keeps there, summed over the KV heads, per row."""
    policy = get_policy(name)
    qs, ks, vs = make_inputs(4, 2)
    stats = stats_for(policy, qs, ks)
    ckv = policy.compress(stats, ks, vs, alpha=0.3, m=M, tau=TAU)
    rows = M - policy.query_start(M, TAU)
    for st, kept, got in zip(stats, ckv.kept_indices, ckv.prompt_scores, strict=True):
        assert got.dtype == PROMPT_SCORE_DTYPE and got.shape == (kept.shape[1],)
        for t in range(kept.shape[1]):
            want = sum(st.col_sum[2 * h : 2 * h + 2, kept[h, t]].sum() for h in range(2)) / rows
            assert got[t].item() == pytest.approx(want.item(), rel=2e-3)


@pytest.mark.parametrize("name", ["streamingllm", "random"])
def test_policies_without_statistics_send_no_scores(name):
    qs, ks, vs = make_inputs(4, 2)
    ckv = get_policy(name).compress(None, ks, vs, alpha=0.3, m=M, tau=TAU)
    assert ckv.prompt_scores is None
    full = get_policy("vlcache").compress(None, ks, vs, alpha=1.0, m=M, tau=TAU)
    assert full.prompt_scores is None


def _scored(lengths=(1, 2, 5), m=5) -> CompactKV:
    ckv = make_ckv(torch.float16, list(lengths), m=m)
    ckv.prompt_scores = [torch.rand(n).to(PROMPT_SCORE_DTYPE) * 3 for n in lengths]
    return ckv


def test_scores_cross_the_wire_bit_for_bit():
    ckv = _scored()
    header, out = feed_all(FakePool(), ckv, encode(ckv))
    assert len(header.prompt_scores) == 3
    assert all(torch.equal(a, b) for a, b in zip(out.prompt_scores, ckv.prompt_scores, strict=True))
    plain = make_ckv(torch.float16, [1, 2, 5], m=5)
    assert feed_all(FakePool(), plain, encode(plain))[1].prompt_scores is None


@pytest.mark.parametrize(
    "edit",
    [
        lambda h: h.prompt_scores.pop(),  # one layer short
        lambda h: h.prompt_scores.__setitem__(1, h.prompt_scores[1][:-1]),  # a truncated layer
        lambda h: h.prompt_scores.__setitem__(
            0, torch.tensor([float("nan")], dtype=torch.float16).numpy().tobytes()
        ),
        lambda h: h.prompt_scores.__setitem__(0, torch.tensor([-1.0], dtype=torch.float16).numpy().tobytes()),
        lambda h: h.prompt_scores.__setitem__(2, b"\0" * 4096),  # more bytes than kept tokens
    ],
)
def test_bad_scores_are_refused_before_any_block_is_taken(edit):
    ckv = _scored()
    chunks = encode(ckv)
    edit(chunks[0].header)
    pool = FakePool()
    with pytest.raises(KVWireError) as exc:
        feed_all(pool, ckv, chunks)
    assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT and "prompt_scores" in exc.value.message
    assert pool.allocs == 0
    with pytest.raises(KVWireError):
        header_prompt_scores(chunks[0].header)


def test_seed_starts_the_mass_and_decides_which_prompt_tokens_outlast_decoding(tiny):
    """With a large prompt weight, the first cut of each layer keeps the prompt positions with the highest
    prompt-time scores (here made to be the earliest ones); with weight 0 the mass starts at zero."""
    model, proc = tiny
    kw = dict(pool_bytes=4 << 20, block_size=4, decode_budget=0.5, decode_window=8)
    heavy = InProcessEngine(model, proc, prompt_weight=1e4, **kw)
    (cache,) = prefilled_caches(heavy, 1)
    assert cache.prompt_scores is not None  # vlcache scored its kept tokens
    cache.prompt_scores = [torch.linspace(1, 0.5, n).to(PROMPT_SCORE_DTYPE) for n in cache.layer_lengths]
    seqs, cuts = [], {}
    real_add, real_compact = heavy.core.add, heavy.cache.compact

    def add(s):
        seqs.append(s)
        return real_add(s)

    def compact(table, keep):
        layer = next(i for i, t in enumerate(seqs[0].blocks.tables) if t is table)
        cuts.setdefault(layer, keep.clone())
        return real_compact(table, keep)

    heavy.core.add, heavy.cache.compact = add, compact
    heavy.decode_caches([cache], SamplingConfig(max_new_tokens=40), eos_ids=())
    assert cuts, "no layer was cut"
    for layer, keep in cuts.items():
        prompt = keep[keep < cache.layer_lengths[layer]]
        assert torch.equal(prompt, torch.arange(prompt.numel())), layer

    none = InProcessEngine(model, proc, prompt_weight=0.0, **kw)
    masses = []
    real = none.core.add
    none.core.add = lambda s: (masses.append(s.attn_mass), real(s))[1]
    none.decode_caches([cache], SamplingConfig(max_new_tokens=4), eos_ids=())
    assert masses == [None]


def test_seed_is_the_score_times_the_weight(tiny):
    model, proc = tiny
    engine = InProcessEngine(
        model, proc, pool_bytes=4 << 20, block_size=4, decode_budget=0.5, prompt_weight=3
    )
    (cache,) = prefilled_caches(engine, 1)
    masses = []
    real = engine.core.add
    engine.core.add = lambda s: (masses.append(s.attn_mass.clone()), real(s))[1]
    engine.decode_caches([cache], SamplingConfig(max_new_tokens=2), eos_ids=())
    for layer, scores in enumerate(cache.prompt_scores):
        n = scores.numel()
        assert torch.equal(masses[0][layer, :n], scores.float() * 3)
        assert not masses[0][layer, n:].any()
