"""Eviction-robust training: attention masks under which the answer reads a random part of its prompt.

A decoder trained only on full caches learns to lean on *every* prompt token: on the default task the
~500 background patches of an image soak up the attention of the answer's tokens (the role a pretrained
LLM gives its first token, the attention sink), and counting reads the share of non-background patches.
Drop any of them and the answer's template breaks ("there , ."), whichever tokens a policy keeps: on the
model trained without this stage, keeping every text token and a uniformly random 20% of the vision tokens
gave 0.00 on counting and on the comparison, as did keeping every text token and every shape's patch.

This stage fine-tunes the model so that the tokens after the first answer token (the ones a compressed
cache serves, see DESIGN.md "Measuring what compression keeps") see only part of the prompt, drawn at
random per example and independent of any policy's scores:

- with probability ``FULL_SHARE`` nothing is dropped (the model still serves the full cache);
- otherwise half the examples keep a uniformly random share of their vision tokens (2-50%), and half keep a
  random share of the shapes' patches (15-100%) and of the background's (0-15%): any eviction that keeps
  more of the image's content than of its background looks like the second;
- the text before the first image (system prompt, BOS) is dropped token by token with a random rate
  (0-70%); the question after the image is always seen, as every policy's recent window keeps it.

The prefill itself (every prompt row, and the row that produces the first answer token) keeps full causal
attention, as a compressed prefill worker computes it.
"""

from __future__ import annotations

import random

import torch
from vlkv.tools.task.synthetic_task import Example, patch_labels

FULL_SHARE = 0.2
UNIFORM_KEEP = (0.02, 0.5)
CONTENT_KEEP = (0.15, 1.0)
BACKGROUND_KEEP = (0.0, 0.15)
SYSTEM_DROP = (0.0, 0.7)


def eviction_mask(
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    attention_mask: torch.Tensor,
    examples: list[Example],
    image_token_id: int,
    rng: random.Random,
) -> torch.Tensor:
    """``[B, 1, S, S]`` boolean mask (True: attend) for a right-padded batch: causal over the valid tokens,
    and for each example not drawn as full, its rows from the first answer token on lose a random part of
    the prompt (module docstring). The draws use ``rng`` and torch's global generator."""
    batch, seq = input_ids.shape
    valid = attention_mask.bool()
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    mask = (causal[None] & valid[:, None, :]) | torch.eye(seq, dtype=torch.bool)[None]
    for b, ex in enumerate(examples):
        if rng.random() < FULL_SHARE:
            continue
        first_answer = int((labels[b] != -100).nonzero()[0])
        vision = (input_ids[b] == image_token_id).nonzero().flatten()
        content = torch.tensor([o is not None for objs in ex.objects for o in patch_labels(objs)])
        if rng.random() < 0.5:
            drop = torch.rand(len(vision)) > rng.uniform(*UNIFORM_KEEP)
        else:
            keep_content, keep_background = rng.uniform(*CONTENT_KEEP), rng.uniform(*BACKGROUND_KEEP)
            u = torch.rand(len(vision))
            drop = torch.where(content, u > keep_content, u > keep_background)
        rate = rng.uniform(*SYSTEM_DROP)
        first_image = int(vision[0])
        system_drop = torch.tensor([rng.random() < rate for _ in range(first_image)], dtype=torch.bool)
        mask[b, first_answer:, vision[drop]] = False
        mask[b, first_answer:, :first_image] &= ~system_drop
    return mask[:, None]
