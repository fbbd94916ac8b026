"""Synthetic visual question task for tiny LLaVA models (content-keyed questions, multi-token answers).

Each image is ``IMAGE_SIZE`` x ``IMAGE_SIZE`` on a dark background, divided into a ``GRID`` x ``GRID`` grid of
cells that line up with the vision tower's patches (one shape per cell, so one vision token per shape).
Questions are keyed to *content* (a shape or a colour), never to grid position, and always come after the
image(s) in the prompt. Answers are short sentences whose deciding word is NOT the first generated token
("it is blue .", "it is a circle .", "there are three ."): the first token is produced by the prefill
forward with the full cache, so only the later tokens show what KV compression kept.

Kinds:

- ``colour_of_shape``      1 image:  "what colour is the square ?"        -> "it is blue ."
- ``shape_of_colour``      1 image:  "what shape is the red one ?"        -> "it is a circle ."
- ``count``                1 image:  "how many shapes are there ?"        -> "there are three ."
- ``colour_of_shape_2img`` 2 images: "what colour is the triangle ?"      (the triangle is in exactly one
  of the two images)                                                      -> "it is green ."
- ``shape_of_colour_2img`` 2 images: "what shape is the yellow one ?"     (unique across both images)

Splits are disjoint by seed space: every example is drawn from its own ``random.Random`` keyed by
``(split, seed, index)``.
"""

from __future__ import annotations

import random
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

from PIL import Image, ImageDraw

IMAGE_SIZE = 72
PATCH_SIZE = 12
GRID = IMAGE_SIZE // PATCH_SIZE  # 6x6 patches = 36 vision tokens per image
SPAN = 2  # each shape covers SPAN x SPAN patches (4 vision tokens), aligned to patch boundaries
BOX = SPAN * PATCH_SIZE

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 180, 60),
    "blue": (50, 90, 235),
    "yellow": (235, 215, 50),
    "purple": (160, 60, 210),
}
SHAPES = ["square", "circle", "triangle", "cross"]
NUMBERS = {1: "one", 2: "two", 3: "three", 4: "four"}
BACKGROUND = (30, 30, 30)

KINDS = ["colour_of_shape", "shape_of_colour", "count", "colour_of_shape_2img", "shape_of_colour_2img"]
# Sampling weights of the kinds (about 30% two-image prompts).
KIND_WEIGHTS = [0.25, 0.25, 0.2, 0.15, 0.15]

_FIXED_WORDS = "what colour shape is the one how many shapes are there it a".split()
VOCAB: list[str] = list(
    dict.fromkeys([*_FIXED_WORDS, *COLOURS, *SHAPES, *NUMBERS.values(), "?", "."])
)  # all task words (the tokenizer adds special tokens and chat-frame words)

CATEGORY_WORDS = {
    "colour": set(COLOURS),
    "shape": set(SHAPES),
    "number": set(NUMBERS.values()),
}


@dataclass(frozen=True)
class Obj:
    shape: str
    colour: str
    cell: tuple[int, int]  # (row, col); only used for drawing


@dataclass
class Example:
    images: list[Image.Image]
    question: str  # text after the image(s)
    answer: str  # full target sentence, e.g. "it is blue ."
    target: str  # the deciding word, e.g. "blue"
    category: str  # "colour" | "shape" | "number"
    kind: str
    objects: list[list[Obj]] = field(default_factory=list)  # per image

    @property
    def messages(self) -> list[dict]:
        """Chat messages: the images first, then the question."""
        content = [{"type": "image"} for _ in self.images] + [{"type": "text", "text": self.question}]
        return [{"role": "user", "content": content}]


def _draw_shape(draw: ImageDraw.ImageDraw, obj: Obj, rgb: tuple[int, int, int]) -> None:
    r, c = obj.cell
    x0, y0 = c * PATCH_SIZE, r * PATCH_SIZE
    x1, y1 = x0 + BOX - 1, y0 + BOX - 1
    if obj.shape == "square":
        draw.rectangle([x0 + 3, y0 + 3, x1 - 3, y1 - 3], fill=rgb)
    elif obj.shape == "circle":
        draw.ellipse([x0 + 1, y0 + 1, x1 - 1, y1 - 1], fill=rgb)
    elif obj.shape == "triangle":
        draw.polygon([((x0 + x1) / 2, y0 + 1), (x0 + 1, y1 - 1), (x1 - 1, y1 - 1)], fill=rgb)
    elif obj.shape == "cross":
        arm = BOX // 6  # half-width of the bars
        mx, my = x0 + BOX // 2, y0 + BOX // 2
        draw.rectangle([mx - arm, y0 + 1, mx + arm - 1, y1 - 1], fill=rgb)
        draw.rectangle([x0 + 1, my - arm, x1 - 1, my + arm - 1], fill=rgb)
    else:  # pragma: no cover - guarded by SHAPES
        raise ValueError(obj.shape)


def render_image(objects: list[Obj], rng: random.Random) -> Image.Image:
    """Draw objects on a plain background; colours get a small per-object jitter."""
    bg = tuple(max(0, min(255, v + rng.randint(-6, 6))) for v in BACKGROUND)
    img = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), bg)
    draw = ImageDraw.Draw(img)
    for obj in objects:
        rgb = tuple(max(0, min(255, v + rng.randint(-20, 20))) for v in COLOURS[obj.colour])
        _draw_shape(draw, obj, rgb)
    return img


def _place(rng: random.Random, pairs: list[tuple[str, str]]) -> list[Obj]:
    """Non-overlapping SPAN x SPAN placements (top-left patch cells) for (shape, colour) pairs."""
    while True:  # greedy placement can (rarely) paint itself into a corner: start over
        free = [(r, c) for r in range(GRID - SPAN + 1) for c in range(GRID - SPAN + 1)]
        objs: list[Obj] = []
        for shape, colour in pairs:
            if not free:
                break
            cell = rng.choice(free)
            objs.append(Obj(shape=shape, colour=colour, cell=cell))
            free = [(r, c) for r, c in free if abs(r - cell[0]) >= SPAN or abs(c - cell[1]) >= SPAN]
        if len(objs) == len(pairs):
            return objs


def _single_scene(rng: random.Random, n: int) -> list[Obj]:
    """n objects with pairwise distinct shapes and pairwise distinct colours."""
    shapes = rng.sample(SHAPES, n)
    colours = rng.sample(list(COLOURS), n)
    return _place(rng, list(zip(shapes, colours, strict=True)))


def _scene_without(
    rng: random.Random, n: int, avoid_shape: str | None, avoid_colour: str | None
) -> list[Obj]:
    shapes = [s for s in SHAPES if s != avoid_shape]
    colours = [c for c in COLOURS if c != avoid_colour]
    return _place(rng, list(zip(rng.sample(shapes, n), rng.sample(colours, n), strict=True)))


def _example(rng: random.Random, kind: str) -> Example:
    if kind in ("colour_of_shape", "shape_of_colour", "count"):
        n = rng.randint(2, 4)
        objs = _single_scene(rng, n)
        scenes = [objs]
        if kind == "count":
            question, answer, target, cat = (
                "how many shapes are there ?",
                f"there are {NUMBERS[n]} .",
                NUMBERS[n],
                "number",
            )
        else:
            t = rng.choice(objs)
            if kind == "colour_of_shape":
                question, answer, target, cat = (
                    f"what colour is the {t.shape} ?",
                    f"it is {t.colour} .",
                    t.colour,
                    "colour",
                )
            else:
                question, answer, target, cat = (
                    f"what shape is the {t.colour} one ?",
                    f"it is a {t.shape} .",
                    t.shape,
                    "shape",
                )
    else:
        shape, colour = rng.choice(SHAPES), rng.choice(list(COLOURS))
        which = rng.randrange(2)
        n_with, n_other = rng.randint(1, 3), rng.randint(1, 3)
        by_shape = kind == "colour_of_shape_2img"
        # the image holding the target: target + (n_with-1) objects avoiding the key (and the target's values)
        others = [c for c in COLOURS if c != colour]
        shapes = rng.sample([x for x in SHAPES if x != shape], n_with - 1)
        pairs = [*zip(shapes, rng.sample(others, n_with - 1), strict=True), (shape, colour)]
        rng.shuffle(pairs)
        with_target = _place(rng, pairs)
        # the other image: avoid the key only (other values may repeat across images)
        other = _scene_without(rng, n_other, shape if by_shape else None, None if by_shape else colour)
        scenes = [with_target, other] if which == 0 else [other, with_target]
        if by_shape:
            question, answer, target, cat = (
                f"what colour is the {shape} ?",
                f"it is {colour} .",
                colour,
                "colour",
            )
        else:
            question, answer, target, cat = (
                f"what shape is the {colour} one ?",
                f"it is a {shape} .",
                shape,
                "shape",
            )
    images = [render_image(objs, rng) for objs in scenes]
    return Example(images, question, answer, target, cat, kind, scenes)


@dataclass(frozen=True)
class QA:
    kind: str
    question: str
    answer: str
    target: str
    category: str


def scene_questions(objects: list[list[Obj]]) -> list[QA]:
    """Every well-posed question about a scene (one or two images): keys that occur exactly once."""
    flat = [o for objs in objects for o in objs]
    two = len(objects) == 2
    suffix = "_2img" if two else ""
    out: list[QA] = []
    shape_counts = Counter(o.shape for o in flat)
    colour_counts = Counter(o.colour for o in flat)
    for o in flat:
        if shape_counts[o.shape] == 1:
            out.append(
                QA(
                    f"colour_of_shape{suffix}",
                    f"what colour is the {o.shape} ?",
                    f"it is {o.colour} .",
                    o.colour,
                    "colour",
                )
            )
        if colour_counts[o.colour] == 1:
            out.append(
                QA(
                    f"shape_of_colour{suffix}",
                    f"what shape is the {o.colour} one ?",
                    f"it is a {o.shape} .",
                    o.shape,
                    "shape",
                )
            )
    if not two:
        n = NUMBERS[len(flat)]
        out.append(QA("count", "how many shapes are there ?", f"there are {n} .", n, "number"))
    return out


def _rng(split: str, seed: int, index: int) -> random.Random:
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    # str seeds are hashed with SHA-512 by random.Random: deterministic across runs and platforms, and the
    # split name keeps the two seed spaces disjoint.
    return random.Random(f"vlkv-synthetic/{split}/{seed}/{index}")


def make_example(index: int, seed: int = 0, split: str = "train", kind: str | None = None) -> Example:
    """The ``index``-th example of the stream ``(split, seed)``; ``kind`` forces a question kind."""
    rng = _rng(split, seed, index)
    k = rng.choices(KINDS, weights=KIND_WEIGHTS)[0]
    return _example(rng, kind or k)


def iter_examples(seed: int = 0, split: str = "train", start: int = 0) -> Iterator[Example]:
    i = start
    while True:
        yield make_example(i, seed, split)
        i += 1


def make_examples(n: int, seed: int = 0, split: str = "train") -> list[Example]:
    """``n`` deterministic examples of the given split."""
    return [make_example(i, seed, split) for i in range(n)]


_WORD_RE = re.compile(r"[a-z]+")


def is_correct(generated_text: str, example: Example) -> bool:
    """True iff the generated answer names the deciding word and no other word of the same category.

    ``generated_text`` is the decoded continuation (special tokens may or may not be stripped).
    """
    words = _WORD_RE.findall(generated_text.lower())
    named = [w for w in words if w in CATEGORY_WORDS[example.category]]
    return bool(named) and all(w == example.target for w in named)


# ---------------------------------------------------------------------------------------------------------
# Evaluation helpers (transformers imported lazily so the generator stays light).


def prompt_text(processor, example: Example) -> str:
    return processor.apply_chat_template(example.messages, add_generation_prompt=True)


def generate_answer(model, processor, example: Example, max_new_tokens: int = 6) -> str:
    import torch

    inputs = processor(images=example.images, text=prompt_text(processor, example), return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)


def evaluate(
    model, processor, examples: list[Example], max_new_tokens: int = 6
) -> tuple[float, dict[str, float]]:
    """Greedy full-cache accuracy overall and per kind."""
    hits: Counter[str] = Counter()
    totals: Counter[str] = Counter()
    for ex in examples:
        text = generate_answer(model, processor, ex, max_new_tokens)
        totals[ex.kind] += 1
        hits[ex.kind] += is_correct(text, ex)
    acc = sum(hits.values()) / max(1, sum(totals.values()))
    return acc, {k: hits[k] / totals[k] for k in sorted(totals)}


def evaluate_full_cache(model_dir: str, n: int = 200, seed: int = 0, max_new_tokens: int = 6) -> float:
    """Held-out accuracy of the saved model in ``model_dir`` with greedy decoding and the full KV cache."""
    import torch
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    torch.manual_seed(0)
    processor = AutoProcessor.from_pretrained(model_dir)
    model = LlavaForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    acc, _ = evaluate(model, processor, make_examples(n, seed, "heldout"), max_new_tokens)
    return acc
