"""Zoo member ``next_anyres``: a LLaVA-NeXT checkpoint with any-res tiles, small objects only the tiles resolve.

Task (``next_scenes``): a wide (672x336) or tall (336x672) image holds 3-4 small objects (3x3 patches of 14 px,
42 px; in the 336 px base view 21 px along the squeezed axis), pairwise distinct in shape and in colour; the
question names one shape, the answer repeats it and names its colour: ``"what colour is the cross ?" -> "the
cross red ."`` (the deciding colour word is the 3rd generated token). The question kind is the default task's
colour-of-shape; what is new is where it looks (see next_scenes: the colour-keyed inverse did not train in time).

Geometry: ``LlavaNextForConditionalGeneration``, grid pinpoints 1x2, 2x1 and 2x2 tiles of 336. A 672x336 image
is a 336x336 base view (576 tokens) plus two full-resolution 336x336 tiles (1,152 tokens) and one
``image_newline`` token per tile row (24): **1,752 vision tokens per image**. The base view squeezes the image
2:1, so the texture that names a shape (stripes one way or the other, checks, plain) is lost along the squeezed
axis there (vertical stripes blur to plain, checks to stripes): the key shape is told apart only in the tiles.

Training (``python -m vlkv.tools.zoo.next_anyres --out tools/zoo/models/next_anyres``): the default model
(``common/default_model``) fine-tuned with the next-token loss on the answer, full attention (no
eviction-robust stage), deterministic for the same ``--threads``: stage 0 as plain LLaVA on 168 px images
(144 tokens, 1-3 objects), stage 1 on 336 px images (one tile's view, 1-4 objects), stage 2 its weights in the
LLaVA-NeXT wrapper (the new ``image_newline`` vector from the seed) at the member's geometry.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from vlkv.tools.task.synthetic_task import COLOURS, SHAPES, Example
from vlkv.tools.zoo import next_scenes as ns
from vlkv.tools.zoo.accuracy import full_cache_accuracy
from vlkv.tools.zoo.interface import Member
from vlkv.tools.zoo.scenes import PATCH, Obj, example_rng, free_cells, qa_one, render

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


MEMBER = Member(
    name=NAME,
    model_dir=Path(__file__).resolve().parent / "models" / NAME,
    max_new_tokens=MAX_NEW_TOKENS,
    geometry=GEOMETRY,
    make_examples=make_examples,
    eviction_trained=True,  # fine-tuned from the default model, whose last stage was eviction-robust
)


def build_processor():
    """The default model's tokenizer and chat template in a real ``LlavaNextProcessor`` (336 px tiles)."""
    from vlkv.common.config import DEFAULT_MODEL_DIR
    from vlkv.common.model.loading import load_processor
    from vlkv.tools.task.tiny_llava import build_processor as tiny_processor

    base = load_processor(str(DEFAULT_MODEL_DIR))
    tok = base.tokenizer
    tok.chat_template = base.chat_template
    return tiny_processor(tok, image_size=TILE, patch_size=PATCH, kind="llava_next")


def build_model(seed: int):
    """``LlavaNextForConditionalGeneration`` holding the default model's weights (``image_newline`` new)."""
    from transformers import AutoConfig, LlavaForConditionalGeneration, LlavaNextConfig
    from transformers import LlavaNextForConditionalGeneration as Next
    from vlkv.common.config import DEFAULT_MODEL_DIR
    from vlkv.tools.task.tiny_llava import grid_pinpoints

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


def train(args: argparse.Namespace) -> dict:
    from transformers import LlavaForConditionalGeneration
    from vlkv.common.config import DEFAULT_MODEL_DIR
    from vlkv.common.model.loading import load_processor
    from vlkv.tools.task.tiny_llava import build_processor as tiny_processor

    ns.set_determinism(args.seed, args.threads)
    processor = build_processor()
    model = build_model(args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    t0 = time.time()
    # Stages 0 and 1, plain LLaVA (the default model's own class, 336 px processor): the colour-keyed look-up of
    # a small object's shape. Stage 0 on 168 x 168 images (144 tokens, the vision tower's position embeddings
    # interpolated), one object at first and up to three by the end of its first half (one object teaches the
    # shape read-out, two or more the colour key); stage 1 on 336 x 336 images with 1-4 objects, each like
    # one full-resolution tile of the member's images.
    plain = LlavaForConditionalGeneration.from_pretrained(str(DEFAULT_MODEL_DIR), dtype=torch.float32)
    plain.model.vision_tower.embeddings.register_forward_pre_hook(
        lambda mod, a, kw: (a, {**kw, "interpolate_pos_encoding": True}), with_kwargs=True
    )
    plain_proc = load_processor(str(DEFAULT_MODEL_DIR))
    low = LOW_SIZE // PATCH
    low_proc = tiny_processor(plain_proc.tokenizer, image_size=LOW_SIZE, patch_size=PATCH)
    low_proc.chat_template = plain_proc.chat_template
    ramp = max(1, args.low_steps * args.batch_size // 2)

    def low_example(i: int) -> Example:
        return make_example(i, args.data_seed, "train", LOW_SIZE, min(3, 1 + 3 * i // ramp))

    s0 = ns.finetune(
        plain, low_proc, ns.batches(low_example, args.batch_size), args.low_steps, args.lr, args.warmup
    )
    assert low * low == 144
    tiles = ns.batches(lambda i: make_example(i, args.data_seed, "train", TILE), args.batch_size)
    s1 = ns.finetune(plain, plain_proc, tiles, args.tile_steps, args.lr, args.warmup)
    if args.eval_every:
        held = [make_example(i, 1, "heldout", TILE) for i in range(50)]
        print(
            f"  stage 1 held-out (336 px, n=50): {full_cache_accuracy(MEMBER, plain, plain_proc, held)[0]:.3f}",
            flush=True,
        )
    missing, _ = model.load_state_dict(plain.state_dict(), strict=False)
    assert missing == ["model.image_newline"], missing
    del plain
    # Stage 2, LLaVA-NeXT at the member's geometry (base view + two tiles + newlines).
    stream = ns.batches(lambda i: make_example(i, args.data_seed, "train"), args.batch_size)

    def peek(step: int) -> None:
        if args.eval_every and step and step % args.eval_every == 0:
            model.eval()
            acc, _ = full_cache_accuracy(MEMBER, model, processor, make_examples(50, 1, "heldout"))
            print(f"  eval@{step}: {acc:.3f}", flush=True)

    s2 = ns.finetune(model, processor, stream, args.steps, args.next_lr, args.warmup, on_log=peek)
    train_s = time.time() - t0
    t1 = time.time()
    acc, per_kind = full_cache_accuracy(MEMBER, model, processor, make_examples(args.eval_n, 0, "heldout"))
    eval_s = time.time() - t1
    print(f"held-out accuracy {acc:.4f} on {args.eval_n} ({eval_s:.0f}s)", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file() and f.suffix not in (".md", ".json"))
    record = {
        "command": f"python -m vlkv.tools.zoo.{NAME} " + " ".join(sys.argv[1:]),
        "train_seconds": round(train_s, 1),
        "stage_seconds": [round(s0, 1), round(s1, 1), round(s2, 1)],
        "command_seconds": round(time.time() - t0, 1),
        **{k: v for k, v in vars(args).items() if k != "out"},
        "params": n_params,
        "size_bytes": size,
        "vision_tokens_per_image": VISION_TOKENS,
        "heldout_accuracy": round(acc, 4),
        "heldout_n": args.eval_n,
        "heldout_per_kind": per_kind,
        "torch": torch.__version__,
    }
    (out / "TRAINING.json").write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record, indent=1), flush=True)
    return record


DEFAULTS = dict(
    low_steps=100,
    tile_steps=40,
    steps=12,
    batch_size=8,
    lr=1e-3,
    next_lr=5e-4,
    warmup=20,
    seed=0,
    data_seed=0,
    threads=1,
    eval_n=300,
    eval_every=0,
)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    for k, v in DEFAULTS.items():
        p.add_argument("--" + k.replace("_", "-"), dest=k, type=type(v), default=v)
    train(p.parse_args(argv))


if __name__ == "__main__":
    main()
