"""Zoo member ``next_anyres``: a LLaVA-NeXT checkpoint with any-res tiles, small objects only the tiles resolve.

Task (scenes from ``scenes``): a wide (672x336) or tall (336x672) image holds 3-4 small objects (3x3 patches of 14 px,
42 px; in the 336 px base view 21 px along the squeezed axis), pairwise distinct in shape and in colour; the
question names one shape, the answer repeats it and names its colour: ``"what colour is the cross ?" -> "the
cross red ."`` (the deciding colour word is the 3rd generated token). The question kind is the default task's
colour-of-shape; what is new is where it looks (see ``scenes``: the colour-keyed inverse did not train in time).

Geometry: ``LlavaNextForConditionalGeneration``, grid pinpoints 1x2, 2x1 and 2x2 tiles of 336. A 672x336 image
is a 336x336 base view (576 tokens) plus two full-resolution 336x336 tiles (1,152 tokens) and one
``image_newline`` token per tile row (24): **1,752 vision tokens per image**. The base view squeezes the image
2:1, so the texture that names a shape (stripes one way or the other, checks, plain) is lost along the squeezed
axis there (vertical stripes blur to plain, checks to stripes): the key shape is told apart only in the tiles.

Training (``python -m vlkv_lab.zoo.next_anyres --out lab/vlkv_lab/zoo/models/next_anyres``): the default model
(``common/default_model``) fine-tuned with the next-token loss on the answer, full attention (no
eviction-robust stage), deterministic for the same ``--threads``: stage 0 as plain LLaVA on 168 px images
(144 tokens, 1-3 objects), stage 1 on 336 px images (one tile's view, 1-4 objects), stage 2 its weights in the
LLaVA-NeXT wrapper (the new ``image_newline`` vector from the seed) at the member's geometry.
"""

from __future__ import annotations

import torch
from vlkv.deploy.synthetic_task import COLOURS, SHAPES, Example

from vlkv_lab.zoo.batching import consecutive
from vlkv_lab.zoo.interface import Member
from vlkv_lab.zoo.scenes import PATCH, Obj, example_rng, free_cells, qa_one, render
from vlkv_lab.zoo.trainer import Recipe, Stage, interpolate_positions, main

NAME = "next_anyres"
MAX_NEW_TOKENS = 8  # "the red cross ." is 4 tokens + eos
TILE = 336
SPAN = 3  # patches per object side
LOW_SIZE = 168  # training stage 0: 12 x 12 patches
VISION_TOKENS = {"wide": 1752, "tall": 1776}  # 576 base + 2 x 576 tiles + one newline per tile row (24 / 48)
GEOMETRY = (
    "LLaVA-NeXT anyres, 672x336 / 336x672 images: 576 base + 2x576 tile + 24 / 48 newline = 1,752 / 1,776 "
    "vision tokens/image, 4 layers, GQA 4/2; small objects whose shape only the full-resolution tiles show"
)
KIND = "colour_of_small_shape"


def make_example(
    index: int, seed: int = 0, split: str = "train", square: int = 0, max_objects: int = 4
) -> Example:
    """The ``index``-th example of the stream ``(split, seed)``. ``square``: instead a ``square`` x ``square``
    image with 1 to ``max_objects`` objects (training's plain-LLaVA stages: what a full-resolution tile
    shows)."""
    rng = example_rng(NAME + (f"-{square}" if square else ""), split, seed, index)
    wide = rng.randrange(2) == 0
    width, height = (square, square) if square else (2 * TILE, TILE) if wide else (TILE, 2 * TILE)
    rows, cols = height // PATCH, width // PATCH
    n = rng.randint(1, max_objects) if square else rng.randint(3, 4)
    colours = rng.sample(list(COLOURS), n)
    shapes = rng.sample(SHAPES, n)
    objs: list[Obj] = []
    for shape, colour in zip(shapes, colours, strict=True):
        objs.append(Obj(shape, colour, rng.choice(free_cells(rows, cols, SPAN, objs))))
    target = rng.choice(objs)
    question, answer = qa_one(target)
    image = render(objs, rng, SPAN, width, height)
    return Example([image], question, answer, target.colour, "colour", KIND, [objs], [(0, target)])


def make_examples(n: int, seed: int = 0, split: str = "heldout") -> list[Example]:
    """``n`` deterministic examples of ``split`` (``"train"`` or ``"heldout"``, disjoint seed spaces)."""
    return [make_example(i, seed, split) for i in range(n)]


# fine-tuned from the default model, whose last stage was eviction-robust
MEMBER = Member.shipped(NAME, MAX_NEW_TOKENS, GEOMETRY, make_examples, eviction_trained=True)


def build_processor():
    """The default model's tokenizer and chat template in a real ``LlavaNextProcessor`` (336 px tiles)."""
    from vlkv.common.config import DEFAULT_MODEL_DIR
    from vlkv.common.model.loading import load_processor

    from vlkv_lab.task.tiny_llava import build_processor as tiny_processor

    base = load_processor(str(DEFAULT_MODEL_DIR))
    tok = base.tokenizer
    tok.chat_template = base.chat_template
    return tiny_processor(tok, image_size=TILE, patch_size=PATCH, kind="llava_next")


def build_model(seed: int):
    """``LlavaNextForConditionalGeneration`` holding the default model's weights (``image_newline`` new)."""
    from transformers import AutoConfig, LlavaForConditionalGeneration, LlavaNextConfig
    from transformers import LlavaNextForConditionalGeneration as Next
    from vlkv.common.config import DEFAULT_MODEL_DIR

    from vlkv_lab.task.tiny_llava import grid_pinpoints

    base_cfg = AutoConfig.from_pretrained(str(DEFAULT_MODEL_DIR))
    cfg = LlavaNextConfig(
        vision_config=base_cfg.vision_config.to_dict(),
        text_config=base_cfg.text_config.to_dict(),
        image_token_index=base_cfg.image_token_index,
        projector_hidden_act=base_cfg.projector_hidden_act,
        vision_feature_select_strategy=base_cfg.vision_feature_select_strategy,
        vision_feature_layer=base_cfg.vision_feature_layer,
        image_grid_pinpoints=grid_pinpoints(TILE),
        tie_word_embeddings=False,
    )
    for k in ("pad_token_id", "bos_token_id", "eos_token_id"):
        setattr(cfg, k, getattr(base_cfg, k))
    torch.manual_seed(seed)
    model = Next(cfg)
    base = LlavaForConditionalGeneration.from_pretrained(str(DEFAULT_MODEL_DIR), dtype=torch.float32)
    missing, unexpected = model.load_state_dict(base.state_dict(), strict=False)
    if unexpected or missing != ["model.image_newline"]:
        raise RuntimeError(f"weights do not map: missing {missing}, unexpected {unexpected}")
    return model


def build(args):
    """The stages: 0 and 1 train the default model as plain LLaVA (its own class and processor) on the
    colour-keyed look-up of a small object's shape, stage 0 on 168 x 168 images (144 tokens, the tower's
    position embeddings interpolated; one object at first and up to three by the end of its first half: one
    object teaches the shape read-out, two or more the colour key), stage 1 on 336 x 336 images with 1-4
    objects, each like one full-resolution tile of the member's images; stage 2 moves the weights into the
    LLaVA-NeXT wrapper and trains at the member's geometry (base view + two tiles + newlines)."""
    from transformers import LlavaForConditionalGeneration
    from vlkv.common.config import DEFAULT_MODEL_DIR
    from vlkv.common.model.loading import load_processor

    from vlkv_lab.task.tiny_llava import build_processor as tiny_processor

    plain = LlavaForConditionalGeneration.from_pretrained(str(DEFAULT_MODEL_DIR), dtype=torch.float32)
    interpolate_positions(plain)
    plain_proc = load_processor(str(DEFAULT_MODEL_DIR))
    low_proc = tiny_processor(plain_proc.tokenizer, image_size=LOW_SIZE, patch_size=PATCH)
    low_proc.chat_template = plain_proc.chat_template
    ramp = max(1, args.low_steps * args.batch_size // 2)
    bs = args.batch_size

    def to_next(plain):
        model = build_model(args.seed)
        missing, unexpected = model.load_state_dict(plain.state_dict(), strict=False)
        assert missing == ["model.image_newline"] and not unexpected, (missing, unexpected)
        return model

    def low(i: int) -> Example:
        return make_example(i, args.data_seed, "train", LOW_SIZE, min(3, 1 + 3 * i // ramp))

    stages = [
        Stage("168 px", args.low_steps, args.lr, lambda n: consecutive(low, bs), args.warmup, low_proc),
        Stage(
            "336 px tiles",
            args.tile_steps,
            args.lr,
            lambda n: consecutive(lambda i: make_example(i, args.data_seed, "train", TILE), bs),
            args.warmup,
            plain_proc,
        ),
        Stage(
            "LLaVA-NeXT any-res",
            args.steps,
            args.next_lr,
            lambda n: consecutive(lambda i: make_example(i, args.data_seed, "train"), bs),
            args.warmup,
            model=to_next,
        ),
    ]
    return plain, build_processor(), stages


RECIPE = Recipe(
    MEMBER,
    dict(low_steps=100, tile_steps=40, steps=12, lr=1e-3, next_lr=5e-4)
    | dict(batch_size=8, warmup=20, seed=0, data_seed=0, threads=1, eval_n=300),
    build,
    lambda model, processor, args: {"vision_tokens_per_image": VISION_TOKENS},
)

if __name__ == "__main__":
    main(RECIPE)
