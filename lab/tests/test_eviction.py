"""Eviction-robust training masks (lab/vlkv_lab/task/eviction.py): what the answer may and may not see."""

from __future__ import annotations

import random

import torch
from vlkv.deploy.synthetic_task import make_example
from vlkv_lab.task.eviction import eviction_masks

IMG = 9


def _batch(n_vision: int, n_system: int, n_question: int, n_answer: int):
    ids = [1] * n_system + [IMG] * n_vision + [2] * n_question + [3] * n_answer
    labels = [-100] * (len(ids) - n_answer) + [3] * n_answer
    return torch.tensor([ids]), torch.tensor([labels])


def test_masks_are_causal_and_only_the_answer_loses_vision_and_system_tokens():
    ex = make_example(0, 0, "train", kind="count")
    n_vision = 576 * len(ex.images)
    ids, labels = _batch(n_vision, 5, 6, 4)
    seq = ids.shape[1]
    first_answer = seq - 4
    torch.manual_seed(0)
    dropped_any = set()
    for seed in range(20):
        masks = eviction_masks(ids, labels, torch.ones_like(ids), [ex], IMG, 4, random.Random(seed))
        assert len(masks) == 4
        causal = torch.ones(seq, seq, dtype=torch.bool).tril()
        for layer, m in enumerate(masks):
            m = m[0, 0]
            assert m.shape == (seq, seq)
            assert not (m & ~causal).any()  # never sees the future
            assert torch.equal(m[:first_answer], causal[:first_answer])  # the prefill rows see everything
            rows = m[first_answer:]
            assert rows[:, 5 + n_vision :].equal(causal[first_answer:, 5 + n_vision :])  # question, answer
            if not rows.all(dim=0)[: 5 + n_vision].all():
                dropped_any.add(layer)
    assert dropped_any == {0, 1, 2, 3}
    # layers draw their own subsets
    masks = eviction_masks(ids, labels, torch.ones_like(ids), [ex], IMG, 4, random.Random(3))
    assert len({tuple(m[0, 0, -1].tolist()) for m in masks}) > 1


def test_padding_is_never_attended():
    ex = make_example(1, 0, "train", kind="colour_of_shape")
    ids, labels = _batch(576, 3, 5, 3)
    ids = torch.cat([ids, torch.zeros(1, 4, dtype=torch.long)], 1)
    labels = torch.cat([labels, torch.full((1, 4), -100)], 1)
    attn = torch.ones_like(ids)
    attn[0, -4:] = 0
    for m in eviction_masks(ids, labels, attn, [ex], IMG, 2, random.Random(0)):
        assert not m[0, 0, :-4, -4:].any()
