"""Prompts of the image-reuse measurements: the image moves, the prompt stays the trained kind."""

from __future__ import annotations

import random

from vlkv.deploy.calibrate.reuse_prompts import random_prefix
from vlkv.deploy.synthetic_task import SYSTEM_PROMPT


def test_random_prefix_moves_the_image_and_keeps_the_system_prompt():
    rng = random.Random(0)
    lengths = set()
    for _ in range(50):
        first = random_prefix(rng)
        second = random_prefix(rng, other=first)
        assert second != first
        for p in (first, second):
            assert p.endswith(SYSTEM_PROMPT.split(" . ", 1)[1])
            assert set(p.split()) <= set(SYSTEM_PROMPT.split())
            lengths.add(len(p.split()))
    assert len(lengths) == 4  # the first sentence 0-3 times
