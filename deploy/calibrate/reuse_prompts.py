"""Prompts for image-reuse measurements: a synthetic-task example asked after a varying text prefix.

The prefix is the system message, rendered by the model's own chat template, with the system prompt's first
sentence said zero to three times before its second: the same image sits at a different position (7-21
tokens apart) from one request to the next, while the prompt stays the kind the default model was trained
on (its held-out accuracy is the same under each; random words there cost it half its accuracy)."""

from __future__ import annotations

import random

from vlkv.deploy.synthetic_task import SYSTEM_PROMPT, Example

_FIRST, _SECOND = (s.strip() + " ." for s in SYSTEM_PROMPT.rstrip(" .").split(" . ", 1))


def random_prefix(rng: random.Random, other: str | None = None) -> str:
    """A system message: the first sentence of the system prompt 0-3 times, then the second; never ``other``
    (so the image moves)."""
    while True:
        prefix = " ".join([_FIRST] * rng.randint(0, 3) + [_SECOND])
        if prefix != other:
            return prefix


def prompt_with_prefix(processor, example: Example, prefix: str) -> str:
    """The example's chat prompt (images, then the question) after a system message ``prefix``."""
    user = {"role": "user", "content": [*({"type": "image"} for _ in example.images)]}
    user["content"].append({"type": "text", "text": example.question})
    messages = [{"role": "system", "content": [{"type": "text", "text": prefix}]}] if prefix else []
    return processor.apply_chat_template([*messages, user], add_generation_prompt=True)
