"""Eviction-robust training: attention masks under which the answer reads a random part of its prompt.

A decoder trained only on full caches learns to lean on *every* prompt token: on the default task the
~500 background patches of an image soak up the attention of the answer's tokens (the role a pretrained
LLM gives its first token, the attention sink), and counting reads the share of non-background patches.
Drop any of them and the answer's template breaks ("there , ."), whichever tokens a policy keeps: on the
model trained without this stage, keeping every text token and a uniformly random 20% of the vision tokens
gave 0.00 on counting and on the comparison, as did keeping every text token and every shape's patch.

This stage fine-tunes the model so that the tokens after the first answer token (the ones a compressed
cache serves, see DESIGN.md "Measuring what compression keeps") see only part of the prompt, drawn at
random independently of any policy's scores, and drawn per layer, as every policy chooses per layer:

- with probability ``FULL_SHARE`` an example loses nothing in any layer (the model still serves the full
  cache);
- otherwise each layer draws one of three patterns for the vision tokens: a uniformly random share kept
  (2-50%); more of the image's content than of its background (shapes' patches 15-100%, background 0-15%);
  or focused on one or two of the objects (30-100% of theirs, 0-30% of the other objects', 0-10% of the
  background's), as a question about one or two shapes would keep;
- the text before the first image (system prompt, BOS) is dropped token by token with a random rate
  (0-70%) per layer; the question after the image is always seen, as every policy's recent window keeps it.

The prefill itself (every prompt row, and the row that produces the first answer token) keeps full causal
attention, as a compressed prefill worker computes it. ``layered_attention`` applies each layer's own mask
(transformers passes one attention mask to every layer).
"""

from __future__ import annotations

import random

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from vlkv.deploy.synthetic_task import Example, patch_labels

FULL_SHARE = 0.2
UNIFORM_KEEP = (0.02, 0.5)
CONTENT_KEEP = (0.15, 1.0)
BACKGROUND_KEEP = (0.0, 0.15)
FOCUS_KEEP = (0.3, 1.0)
OTHER_KEEP = (0.0, 0.3)
FOCUS_BACKGROUND_KEEP = (0.0, 0.1)
SYSTEM_DROP = (0.0, 0.7)
ATTN_IMPLEMENTATION = "vlkv-evict"


def layered_attention(module, query, key, value, attention_mask, **kwargs):
    """SDPA with the layer's own mask when the forward carries ``evict_masks`` (one mask per layer)."""
    masks = kwargs.pop("evict_masks", None)
    if masks is not None:
        attention_mask = masks[module.layer_idx]
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def use_layered_attention(model) -> None:
    """Switch the language model to ``layered_attention`` (training only; ``model.set_attn_implementation(
    {"text_config": "sdpa"})`` switches back)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, layered_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)
    model.set_attn_implementation({"text_config": ATTN_IMPLEMENTATION})


def _vision_drop(
    content: torch.Tensor, objects: torch.Tensor, n_objects: int, rng: random.Random
) -> torch.Tensor:
    """Which vision tokens one layer loses: one of three patterns, drawn at random."""
    u = torch.rand(len(content))
    mode = rng.randrange(3)
    if mode == 0:  # uniform
        return u > rng.uniform(*UNIFORM_KEEP)
    if mode == 1:  # more of the content than of the background
        keep_content, keep_background = rng.uniform(*CONTENT_KEEP), rng.uniform(*BACKGROUND_KEEP)
        return torch.where(content, u > keep_content, u > keep_background)
    # focused: one or two of the objects kept well, the others and the background sparsely
    focus = rng.sample(range(n_objects), min(n_objects, rng.randint(1, 2)))
    focused = torch.isin(objects, torch.tensor(focus))
    keep = torch.where(
        focused,
        rng.uniform(*FOCUS_KEEP),
        torch.where(content, rng.uniform(*OTHER_KEEP), rng.uniform(*FOCUS_BACKGROUND_KEEP)),
    )
    return u > keep


def eviction_masks(
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    attention_mask: torch.Tensor,
    examples: list[Example],
    image_token_id: int,
    num_layers: int,
    rng: random.Random,
) -> list[torch.Tensor]:
    """Per layer a ``[B, 1, S, S]`` boolean mask (True: attend) for a right-padded batch: causal over the
    valid tokens, and for each example not drawn as full, its rows from the first answer token on lose a
    part of the prompt drawn for that layer (module docstring). The draws use ``rng`` and torch's global
    generator."""
    batch, seq = input_ids.shape
    valid = attention_mask.bool()
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    base = (causal[None] & valid[:, None, :]) | torch.eye(seq, dtype=torch.bool)[None]
    masks = [base.clone() for _ in range(num_layers)]
    for b, ex in enumerate(examples):
        if rng.random() < FULL_SHARE:
            continue
        first_answer = int((labels[b] != -100).nonzero()[0])
        vision = (input_ids[b] == image_token_id).nonzero().flatten()
        flat = [o for objs in ex.objects for o in objs]
        index = {id(o): i for i, o in enumerate(flat)}
        labels_of = [o for objs in ex.objects for o in patch_labels(objs)]
        content = torch.tensor([o is not None for o in labels_of])
        objects = torch.tensor([-1 if o is None else index[id(o)] for o in labels_of])
        first_image = int(vision[0])
        for mask in masks:
            drop = _vision_drop(content, objects, len(flat), rng)
            rate = rng.uniform(*SYSTEM_DROP)
            system_drop = torch.tensor([rng.random() < rate for _ in range(first_image)], dtype=torch.bool)
            mask[b, first_answer:, vision[drop]] = False
            mask[b, first_answer:, :first_image] &= ~system_drop
    return [m[:, None] for m in masks]
