"""Prompts for image-reuse measurements: a synthetic-task example asked after a varying text prefix.

The prefix is a system message of random task words, rendered by the model's own chat template, so the
same image sits at a different position (after different text) from one request to the next."""

from __future__ import annotations

import random

from vlkv.tools.task.synthetic_task import VOCAB, Example


def random_prefix(rng: random.Random, min_words: int = 2, max_words: int = 12) -> str:
    return " ".join(rng.choice(VOCAB) for _ in range(rng.randint(min_words, max_words)))


def prompt_with_prefix(processor, example: Example, prefix: str) -> str:
    """The example's chat prompt (images, then the question) after a system message ``prefix``."""
    user = {"role": "user", "content": [*({"type": "image"} for _ in example.images)]}
    user["content"].append({"type": "text", "text": example.question})
    messages = [{"role": "system", "content": [{"type": "text", "text": prefix}]}] if prefix else []
    return processor.apply_chat_template([*messages, user], add_generation_prompt=True)
