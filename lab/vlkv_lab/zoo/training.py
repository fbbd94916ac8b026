"""The stages of the zoo's small LLaVA members trained from the default model's vision side (``grid16``,
``longprompt``), for the one trainer (``lab/vlkv_lab/zoo/trainer.py``):

1. The vision tower and projector start from the default model's (``common/default_model``), the tower's
   position embeddings resized (bicubic) to the member's patch grid; the decoder, embeddings and head start
   from random init (the default's decoder was fine-tuned to tolerate KV eviction, a user's is not), or
   from another member's checkpoint (``init_from``: decoder, shared words, vision side).
2. One stage: its first ``--probe-steps`` train the tower and projector alone with a linear probe naming
   each vision token's object kind and colour, background included (``lab/vlkv_lab/task/train_default_model``'s
   lesson), the rest next-token loss on the answers, full attention (no eviction-robust stage), batches
   drawn by the member's curriculum (``train_example(index, progress)``).

Deterministic: fixed seeds and data order, deterministic algorithms; bit-exact for the same ``--threads``
(1 by default: the lab machine's 2 cores are shared).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoTokenizer, LlavaForConditionalGeneration
from vlkv.common.config import DEFAULT_MODEL_DIR
from vlkv.deploy.synthetic_task import Example, Geometry

from vlkv_lab.task.tiny_llava import build_tiny, tokens_per_image
from vlkv_lab.zoo.batching import one_turn
from vlkv_lab.zoo.interface import Member
from vlkv_lab.zoo.scenes import patch_labels
from vlkv_lab.zoo.trainer import Probe, Recipe, Stage


@dataclass(frozen=True)
class Arch:
    """The member's model: image geometry and decoder shape (vision tower as the default's, to reuse it)."""

    geometry: Geometry
    layers: int = 4
    hidden: int = 128
    heads: int = 4
    kv_heads: int = 2
    rope_theta: float = 1e6


def init_vision_from_default(model: LlavaForConditionalGeneration, default_dir: str = str(DEFAULT_MODEL_DIR)):
    """Copy the default model's vision tower and projector into ``model``, position embeddings resized."""
    src = LlavaForConditionalGeneration.from_pretrained(default_dir, dtype=torch.float32)
    tower = src.model.vision_tower.state_dict()
    key = "embeddings.position_embedding.weight"
    pe = tower[key]  # [1 + old*old, dim]: CLS first
    old = math.isqrt(pe.shape[0] - 1)
    new = math.isqrt(model.model.vision_tower.state_dict()[key].shape[0] - 1)
    grid = pe[1:].reshape(1, old, old, -1).permute(0, 3, 1, 2)
    grid = torch.nn.functional.interpolate(grid, size=(new, new), mode="bicubic", align_corners=False)
    tower[key] = torch.cat([pe[:1], grid.permute(0, 2, 3, 1).reshape(new * new, -1)])
    model.model.vision_tower.load_state_dict(tower)
    model.model.multi_modal_projector.load_state_dict(src.model.multi_modal_projector.state_dict())


def init_from_member(model: LlavaForConditionalGeneration, tokenizer, src_dir: Path) -> None:
    """Start from another member's checkpoint: its vision tower and projector (position embeddings resized),
    decoder layers and final norm, and the embedding and output rows of every word both vocabularies share
    (the new words keep their random init)."""
    init_vision_from_default(model, str(src_dir))
    src = LlavaForConditionalGeneration.from_pretrained(src_dir, dtype=torch.float32)
    src_vocab = AutoTokenizer.from_pretrained(src_dir).get_vocab()
    dst_lm, src_lm = model.model.language_model, src.model.language_model
    dst_lm.layers.load_state_dict(src_lm.layers.state_dict())
    dst_lm.norm.load_state_dict(src_lm.norm.state_dict())
    pairs = [(i, src_vocab[w]) for w, i in tokenizer.get_vocab().items() if w in src_vocab]
    dst_ids, src_ids = (torch.tensor(x) for x in zip(*pairs, strict=True))
    with torch.no_grad():
        dst_lm.embed_tokens.weight[dst_ids] = src_lm.embed_tokens.weight[src_ids]
        model.lm_head.weight[dst_ids] = src.lm_head.weight[src_ids]


def small_llava(
    member: Member,
    words: list[str],
    system_prompt: str | None,
    arch: Arch,
    train_example: Callable[[int, float], Example],  # (index, training progress in [0, 1)) -> example
    object_kinds: tuple[str, ...],  # the probe's first class set, in class order
    steps: int,
    probe_steps: int,
    batch_size: int = 16,
    lr: float = 1e-3,
    warmup: int = 50,
    init_from: Path | None = None,
) -> Recipe:
    """The member's training command: one stage (probe first) over its curriculum."""
    g = arch.geometry
    decoder = dict(num_heads=arch.heads, num_kv_heads=arch.kv_heads, hidden=arch.hidden, layers=arch.layers)

    def targets(chats) -> torch.Tensor:
        rows = [
            patch_labels(img, objs, g, object_kinds)
            for ex, _ in chats
            for img, objs in zip(ex.images, ex.objects, strict=True)
        ]
        return torch.tensor(rows, dtype=torch.long)

    def build(args):
        tok, processor, cfg = build_tiny(
            words,
            image_size=g.image,
            patch_size=g.patch,
            system_prompt=system_prompt,
            rope_theta=arch.rope_theta,
            **decoder,
        )
        torch.manual_seed(args.seed)
        model = LlavaForConditionalGeneration(cfg)
        if init_from is not None:
            init_from_member(model, tok, init_from)
        else:
            init_vision_from_default(model)

        def batches(n: int):
            for step in itertools.count():
                yield one_turn(
                    [train_example(step * args.batch_size + j, step / n) for j in range(args.batch_size)]
                )

        probe = Probe(args.probe_steps, len(object_kinds), targets) if args.probe_steps else None
        return model, processor, [Stage("train", args.steps, args.lr, batches, args.warmup, probe=probe)]

    def report(model, processor, args) -> dict:
        prompts = [
            len(processor(images=ex.images, text=member.prompt_text(processor, ex))["input_ids"][0])
            for ex in member.make_examples(args.eval_n, args.eval_seed, "heldout")
        ]
        return {
            "init_from": init_from.name if init_from else None,
            "tokens_per_image": tokens_per_image(g.image, g.patch),
            "prompt_tokens": {"min": min(prompts), "max": max(prompts)},
            "text": decoder,
        }

    defaults = dict(steps=steps, probe_steps=probe_steps, batch_size=batch_size, lr=lr, warmup=warmup)
    defaults |= dict(seed=1234, threads=1, eval_n=300)
    return Recipe(member, defaults, build, report)
