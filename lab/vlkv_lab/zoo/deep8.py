"""Zoo member ``deep8``: 8 decoder layers (dense early, sparse later) and answers that read two far-apart regions.

Task (scenes from ``scenes``): a 336x336 image holds one object (5x5 patches, 70 px) in each of its four corners,
pairwise distinct in shape and in colour. The question names the shapes of two objects in *opposite* corners
(top-left and bottom-right, or top-right and bottom-left; 15-19 patches apart on both axes), the answer names
both colours: ``"what colour are the cross and the circle ?" -> "the cross red and the circle blue ."``
(deciding words: the 3rd and the 7th generated tokens; the second look-up lands on the far corner). The
question kind is the default task's two-shape one; what is new is that the two regions are always far apart
(see ``scenes``: the colour-keyed inverse did not train in time).

Geometry: plain LLaVA, 576 vision tokens per image (24x24), **8 decoder layers**, GQA 4/2. The 8 layers start
from the default model's 4, each used twice with half its residual output (o_proj and down_proj x 0.5, so the
pair approximates the original layer), and the query projections scaled per layer at initialisation
(``Q_SCALE``: 0.5 in layers 0-1, 2.5-3 after) so that the post-vision attention is dense in the first two
layers and sparse in the later ones, as LLaVA-7B's is; training then is the ordinary next-token loss on the
answer with full attention (no eviction-robust stage): stage 0 on 168 px images (144 tokens; one-key
questions with one occupied corner at first, four by mid-stage, then half two-key), stage 1 at 336 px (20%
one-key). ``python -m vlkv_lab.zoo.deep8 --out DIR`` prints
the per-layer sparsity of the result (``sparsity.layer_sparsities``).
"""

from __future__ import annotations

import torch
from vlkv.deploy.synthetic_task import COLOURS, SHAPES, Example, Obj

from vlkv_lab.zoo.batching import consecutive
from vlkv_lab.zoo.interface import Member
from vlkv_lab.zoo.scenes import PATCH, example_rng, qa_one, qa_two, render
from vlkv_lab.zoo.sparsity import layer_sparsities
from vlkv_lab.zoo.trainer import Recipe, Stage, interpolate_positions, main

NAME = "deep8"
MAX_NEW_TOKENS = 12  # "the red cross and the blue circle ." is 8 tokens + eos
SIZE = 336
LOW_SIZE = 168  # training stage 0: 12 x 12 patches
GRID = SIZE // PATCH  # 24
SPAN = 5
CORNER_JITTER = 2  # an object's top-left cell lies within 2 patches of its corner's extreme place
LAYER_MAP = (0, 0, 1, 1, 2, 2, 3, 3)  # default-model layer each of the 8 layers starts from
Q_SCALE = (0.5, 0.5, 3.0, 3.0, 2.5, 2.5, 3.0, 3.0)  # query-projection scale at initialisation
GEOMETRY = (
    "LLaVA-1.5, 576 vision tokens/image (24x24), 8 layers (dense early, sparse later), GQA 4/2; "
    "the answer reads two objects in opposite corners"
)
KIND = "colours_of_two_far"
SINGLE = "colour_of_shape"  # training's warm-up kind: one key


def corner_cells(
    rng, grid: int = GRID, span: int = SPAN, jitter: int = CORNER_JITTER
) -> list[tuple[int, int]]:
    """Top-left cells of the four corner objects: top-left, top-right, bottom-right, bottom-left."""
    far = grid - span

    def j():
        return rng.randint(0, jitter)

    return [(j(), j()), (j(), far - j()), (far - j(), far - j()), (far - j(), j())]


def make_example(
    index: int, seed: int = 0, split: str = "train", single: bool = False, low: bool = False, corners: int = 4
) -> Example:
    """The ``index``-th example of ``(split, seed)``. Training's variants: ``single``, a one-key question
    about one corner object; ``low``, a 168 x 168 image (12 x 12 patches, objects 3 x 3 patches, no centre
    object); ``corners``, fewer occupied corners (a ``single`` question only)."""
    tag = ("-single" if single else "") + ("-low" if low else "") + (f"-{corners}" if corners != 4 else "")
    rng = example_rng(NAME + tag, split, seed, index)
    size, span, jitter = (LOW_SIZE, 3, 1) if low else (SIZE, SPAN, CORNER_JITTER)
    grid = size // PATCH
    cells = corner_cells(rng, grid, span, jitter)
    first = rng.randrange(4)
    cells = [cells[(first + k) % 4] for k in (0, 2, 1, 3)][:corners]  # opposite corners first
    colours = rng.sample(list(COLOURS), len(cells))
    shapes = rng.sample(SHAPES, len(cells))
    objs = [Obj(s, c, cell) for s, c, cell in zip(shapes, colours, cells, strict=True)]
    if single:
        a = rng.choice(objs[:corners])
        question, answer = qa_one(a)
        focus, kind, target = [a], SINGLE, a.colour
    else:
        a, b = objs[0], objs[1]  # opposite corners
        question, answer = qa_two(a, b)
        focus, kind, target = [a, b], KIND, b.colour
    image = render(objs, rng, span, size, size)
    return Example([image], question, answer, target, "colour", kind, [objs], [(0, f) for f in focus])


def make_examples(n: int, seed: int = 0, split: str = "heldout") -> list[Example]:
    """``n`` deterministic two-key examples of ``split`` (``"train"`` or ``"heldout"``, disjoint seed spaces)."""
    return [make_example(i, seed, split) for i in range(n)]


MEMBER = Member.shipped(NAME, MAX_NEW_TOKENS, GEOMETRY, make_examples)


def build_model(seed: int):
    """An 8-layer LLaVA from the default model (``LAYER_MAP``, half residuals, ``Q_SCALE``)."""
    from transformers import AutoConfig, LlavaForConditionalGeneration
    from vlkv.common.config import DEFAULT_MODEL_DIR

    base = LlavaForConditionalGeneration.from_pretrained(str(DEFAULT_MODEL_DIR), dtype=torch.float32)
    cfg = AutoConfig.from_pretrained(str(DEFAULT_MODEL_DIR))
    cfg.text_config.num_hidden_layers = len(LAYER_MAP)
    if getattr(cfg.text_config, "layer_types", None):
        cfg.text_config.layer_types = [cfg.text_config.layer_types[0]] * len(LAYER_MAP)
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(cfg)
    state = {k: v for k, v in base.state_dict().items() if ".language_model.layers." not in k}
    for i, src in enumerate(LAYER_MAP):
        prefix = f"model.language_model.layers.{src}."
        for k, v in base.state_dict().items():
            if k.startswith(prefix):
                name = k[len(prefix) :]
                w = v.clone()
                if name in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
                    w *= 0.5
                if name == "self_attn.q_proj.weight":
                    w *= Q_SCALE[i]
                state[f"model.language_model.layers.{i}.{name}"] = w
    model.load_state_dict(state, strict=True)
    return model


def build(args):
    """Stage 0 on 168 px images (144 tokens; one-key questions with one occupied corner at first and four by
    the middle of the stage, then half the questions two-key), stage 1 at 336 px (``single_percent`` one-key)."""
    from vlkv.common.config import DEFAULT_MODEL_DIR
    from vlkv.common.model.loading import load_processor

    from vlkv_lab.task.tiny_llava import build_processor as tiny_processor

    processor = load_processor(str(DEFAULT_MODEL_DIR))
    model = build_model(args.seed)
    low_proc = tiny_processor(processor.tokenizer, image_size=LOW_SIZE, patch_size=PATCH)
    low_proc.chat_template = processor.chat_template
    interpolate_positions(model)
    ramp = max(1, args.low_steps * args.batch_size // 2)
    bs = args.batch_size

    def low(i: int) -> Example:
        if i < ramp or (i * 7919) % 100 < 50:
            return make_example(i, args.data_seed, "train", True, True, min(4, 1 + 4 * i // ramp))
        return make_example(i, args.data_seed, "train", low=True)

    def full(i: int) -> Example:
        return make_example(i, args.data_seed, "train", single=(i * 7919) % 100 < args.single_percent)

    return (
        model,
        processor,
        [
            Stage("168 px", args.low_steps, args.lr, lambda n: consecutive(low, bs), args.warmup, low_proc),
            Stage("336 px", args.steps, args.full_lr, lambda n: consecutive(full, bs), args.warmup),
        ],
    )


def report(model, processor, args) -> dict:
    """The per-layer post-vision sparsity of the result."""
    sparsity = layer_sparsities(model, processor, make_examples(args.sparsity_n, 0, "heldout"))
    print("per-layer post-vision sparsity (p=0.01):", [round(x, 3) for x in sparsity], flush=True)
    return {"layer_map": LAYER_MAP, "q_scale": Q_SCALE, "layer_sparsity": [round(x, 4) for x in sparsity]}


RECIPE = Recipe(
    MEMBER,
    dict(low_steps=100, steps=60, single_percent=20, lr=1e-3, full_lr=5e-4, sparsity_n=50)
    | dict(batch_size=8, warmup=20, seed=0, data_seed=0, threads=1, eval_n=300),
    build,
    report,
)

if __name__ == "__main__":
    main(RECIPE)
