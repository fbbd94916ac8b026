"""``sample_tokens``: one call per decode step for the whole batch, greedy and sampled rows together."""

from __future__ import annotations

import torch
from vlkv.common.sampling import NonFiniteLogits, SamplingConfig, make_generator, sample_tokens

HOT = SamplingConfig(temperature=0.8, top_p=0.9, top_k=5, seed=3)


def _logits(rows: int, vocab: int = 50) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)) * 3


def test_greedy_rows_are_the_argmax_and_a_sampled_row_does_not_depend_on_its_batch():
    logits = _logits(4)
    cfgs = [SamplingConfig(), HOT, SamplingConfig(), SamplingConfig(temperature=1.5, seed=7)]
    got = sample_tokens(logits, cfgs, [None if c.greedy else make_generator(c.seed) for c in cfgs])
    assert [got[0], got[2]] == [int(logits[0].argmax()), int(logits[2].argmax())]
    for i in (1, 3):
        alone = sample_tokens(logits[i : i + 1], [cfgs[i]], [make_generator(cfgs[i].seed)])
        assert alone == [got[i]]


def test_top_k_and_top_p_keep_only_the_most_likely_tokens():
    logits = _logits(1, 1000)
    best = set(torch.topk(logits[0], 5).indices.tolist())
    g = make_generator(0)
    drawn = {sample_tokens(logits, [HOT], [g])[0] for _ in range(200)}
    assert drawn <= best and len(drawn) > 1
    tight = SamplingConfig(temperature=1.0, top_p=1e-6, seed=1)  # only the most likely token reaches it
    assert {sample_tokens(logits, [tight], [g])[0] for _ in range(20)} == {int(logits[0].argmax())}


def test_a_broken_row_fails_alone():
    logits = _logits(3)
    logits[1, 4] = float("nan")
    got = sample_tokens(logits, [SamplingConfig(), HOT, HOT], [None, make_generator(1), make_generator(2)])
    assert isinstance(got[1], NonFiniteLogits)
    assert isinstance(got[0], int) and isinstance(got[2], int)
