"""Synthetic visual question task at LLaVA-1.5's geometry (content-keyed questions, multi-token answers).

Each image is ``IMAGE_SIZE`` x ``IMAGE_SIZE`` pixels (336, as LLaVA-1.5) on a dark background and is seen by
the vision tower as a ``GRID`` x ``GRID`` grid of ``PATCH_SIZE`` patches: **576 vision tokens per image**. It
holds 1-4 shapes (square, circle, triangle, cross) in 5 colours; each shape covers ``SPAN`` x ``SPAN``
patches (36 of the 576 vision tokens) at a random patch-aligned place. A shape is drawn as its silhouette
with a light outline and filled with its own texture (stripes one way or the other, a checker, plain), so
every patch of a shape shows which shape it belongs to as well as its colour. Within one image shapes are
pairwise distinct; colours too, except that ``colour_of_two_shapes`` scenes may repeat one on purpose.

Questions are keyed to *content* (a shape), never to grid position, and come after the image(s). The answer
is a short phrase whose deciding words are never the first generated token (that one comes from the prefill
forward over the full cache, so only later tokens show what KV compression kept).

Kinds (``KINDS``):

- ``colour_of_shape``      1 image:  "what colour is the square ?"  -> "the square blue ."
- ``count``                1 image:  "how many shapes are there ?"  -> "there are three ." / "there is one ."
- ``colour_of_shape_2img`` 2 images: "what colour is the triangle ?" -> "the triangle green ."
  (the only triangle in the two images; the other image may repeat its colour)
- ``colour_of_two_shapes`` 1 image, two regions: "what colour are the square and the circle ?" ->
  "the square red , the circle blue ." (half the scenes give the two shapes one colour). The answer depends
  on two separate regions of the image, and the second deciding word is the 7th generated token.
- ``colour_of_shape_long`` (``LONG_KIND``, not in the main mix: ``vlkv eval kv-table``'s long answers)
  1 image: "look at the image and answer the question : what colour is the square ?" -> a 68-word answer
  that walks through the question (naming the square four times) and ends "so the square red ." The one
  deciding word is the 67th generated token, after 66 tokens of the sequence's own text: what decode-phase
  re-compression keeps of the image while those are generated decides it.

Scoring (``is_correct``): the colour and number words of the generated text, in order, must equal those of
the reference answer (shape words are keys the answer repeats and are not scored; the vocabulary's unused
verdict words count, so a stray one is wrong).

Why these choices (what trains from scratch on a 2-core CPU within the budget):

- the answer repeats the key right before the deciding word, so each look-up happens at the key token
  itself (one hop); the two-region kind needs two such look-ups, never a two-hop look-up inside the image;
- no same/different verdict: a comparison of the two written colours did not train (the first 576-token
  model read both colours right and got the verdict right 0.69 of the time; trained on the text alone, the
  verdict's loss stayed at chance for 600 steps), so the two-region kind states both colours;
- textures carry the shape in every patch of it; a silhouette alone needs the vision tower to combine
  neighbouring patches, which did not train within the budget at 36 tokens per image already;
- shapes have one size, so the share of non-background tokens counts them;
- colour-of-shape is learned before the other kinds join the mix (``train_default_model`` does that).

Splits are disjoint by seed space: every example is drawn from its own ``random.Random`` keyed by the string
``(split, seed, index)``.

Product code because ``vlkv demo`` asks the embedded default model (``common/default_model``, trained on it)
its held-out questions; the lab's evaluation, training and zoo build on it.
"""

from __future__ import annotations

import functools
import random
import re
from collections import Counter
from dataclasses import dataclass, field

from PIL import Image, ImageDraw

IMAGE_SIZE = 336
PATCH_SIZE = 14
GRID = IMAGE_SIZE // PATCH_SIZE  # 24x24 patches = 576 vision tokens per image
TOKENS_PER_IMAGE = GRID * GRID
SPAN = 6  # each shape covers SPAN x SPAN patches (36 vision tokens), aligned to patch boundaries
BOX = SPAN * PATCH_SIZE


@dataclass(frozen=True)
class Geometry:
    """Where shapes go: an ``image`` x ``image`` canvas of ``patch``-pixel patches, shapes ``span`` patches wide."""

    image: int
    patch: int
    span: int

    @property
    def grid(self) -> int:
        return self.image // self.patch

    @property
    def box(self) -> int:
        return self.span * self.patch


FULL = Geometry(IMAGE_SIZE, PATCH_SIZE, SPAN)
# Training's first stage: the same patches (a shape's patch looks exactly as at full size: same colours, same
# texture period) on an 8x8 grid, shapes 2x2 patches: 64 vision tokens per image, so prompts are short while
# the copy and look-up circuits form, and the vision tower runs with interpolated position embeddings.
LOW = Geometry(8 * PATCH_SIZE, PATCH_SIZE, 2)
MAX_NEW_TOKENS = 12  # the longest short answer ("the square red , the circle red .") is 8 words + eos

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 180, 60),
    "blue": (50, 90, 235),
    "yellow": (235, 215, 50),
    "purple": (160, 60, 210),
}
SHAPES = ["square", "circle", "triangle", "cross"]
TEXTURES = {"square": "hstripes", "circle": "plain", "triangle": "vstripes", "cross": "checker"}
TEXTURE_PERIOD = 7  # pixels: two periods per patch, so every patch of a shape shows its texture
NUMBERS = {1: "one", 2: "two", 3: "three", 4: "four"}
VERDICTS = ("same", "different")  # in the vocabulary (the tokenizer's ids stay put); no answer uses them
BACKGROUND = (30, 30, 30)
OUTLINE = (255, 255, 255)
OUTLINE_WIDTH = 2

LONG_KIND = "colour_of_shape_long"
# the long kind weighs 0 in the main mix (the evaluation table's examples and training's stages 1-5 never
# draw it: a trailing zero weight leaves ``random.choices`` picking exactly as before)
KINDS = ["colour_of_shape", "count", "colour_of_shape_2img", "colour_of_two_shapes", LONG_KIND]
KIND_WEIGHTS = [0.3, 0.15, 0.3, 0.25, 0.0]
LONG_MAX_NEW_TOKENS = 72  # the long answer is 68 words + eos

SYSTEM_PROMPT = (
    "you are a careful visual assistant . look at the image and answer the question in one short sentence ."
)
_FIXED_WORDS = (
    "what colour shape is the one how many shapes are there do and match so you a careful visual "
    "assistant look at image answer question in short sentence"
).split()
VOCAB: list[str] = list(
    dict.fromkeys([*_FIXED_WORDS, *COLOURS, *SHAPES, *NUMBERS.values(), *VERDICTS, "?", ".", ","])
)
"""All task words (the tokenizer adds the special tokens and the chat-frame words)."""

DECIDING_WORDS = frozenset(COLOURS) | frozenset(NUMBERS.values()) | frozenset(VERDICTS)
"""The words this task scores (shape words are keys the answer repeats)."""
CONTENT_WORDS = frozenset(COLOURS) | frozenset(SHAPES)
"""The words the zoo's other members score: colours and shapes."""


@dataclass(frozen=True)
class Obj:
    shape: str
    colour: str
    cell: tuple[int, int]  # (row, col) of the top-left patch; only used for drawing and analysis


@dataclass(frozen=True)
class QA:
    kind: str
    question: str
    answer: str
    target: str  # the last deciding word
    category: str  # "colour" | "number"


@dataclass
class Example:
    images: list[Image.Image]
    question: str  # text after the image(s)
    answer: str  # full target answer, e.g. "the square blue ."
    target: str  # the last deciding word, e.g. "blue"
    category: str  # "colour" | "number"
    kind: str
    objects: list[list[Obj]] = field(default_factory=list)  # per image
    focus: list[tuple[int, Obj]] = field(default_factory=list)  # (image, object) the answer reads

    @property
    def messages(self) -> list[dict]:
        """Chat messages: the images first, then the question (the template adds the system prompt)."""
        content = [{"type": "image"} for _ in self.images] + [{"type": "text", "text": self.question}]
        return [{"role": "user", "content": content}]


# --- questions ------------------------------------------------------------------------------------------


def qa_colour_of_shape(obj: Obj, two_images: bool = False) -> QA:
    kind = "colour_of_shape_2img" if two_images else "colour_of_shape"
    return QA(
        kind, f"what colour is the {obj.shape} ?", f"the {obj.shape} {obj.colour} .", obj.colour, "colour"
    )


def qa_count(n: int) -> QA:
    verb = "is" if n == 1 else "are"
    return QA("count", "how many shapes are there ?", f"there {verb} {NUMBERS[n]} .", NUMBERS[n], "number")


def qa_two_shapes(a: Obj, b: Obj) -> QA:
    return QA(
        "colour_of_two_shapes",
        f"what colour are the {a.shape} and the {b.shape} ?",
        f"the {a.shape} {a.colour} , the {b.shape} {b.colour} .",
        b.colour,
        "colour",
    )


def long_answer(shape: str, colour: str) -> str:
    """The long kind's answer: 66 words of the model's own text about the question, then the colour."""
    s = shape
    return (
        f"you look at the image . you look at the {s} in the image . the {s} is there in the image . "
        f"you look at the shape . you look at the colour . what colour is the {s} ? you answer the question . "
        f"a careful visual assistant look at the {s} and answer the question in a short sentence . "
        f"so the {s} {colour} ."
    )


def qa_colour_long(obj: Obj) -> QA:
    return QA(
        LONG_KIND,
        f"look at the image and answer the question : what colour is the {obj.shape} ?",
        long_answer(obj.shape, obj.colour),
        obj.colour,
        "colour",
    )


def scene_questions(objects: list[list[Obj]]) -> list[QA]:
    """Every well-posed question about a scene of one or two images (keys that occur exactly once)."""
    flat = [o for objs in objects for o in objs]
    two = len(objects) == 2
    shape_counts = Counter(o.shape for o in flat)
    unique = [o for o in flat if shape_counts[o.shape] == 1]
    out = [qa_colour_of_shape(o, two) for o in unique]
    if not two:
        out.append(qa_count(len(flat)))
        out += [qa_two_shapes(a, b) for a in unique for b in unique if a is not b]
    return out


# --- images ---------------------------------------------------------------------------------------------


def _silhouette(draw: ImageDraw.ImageDraw, shape: str, x0: int, y0: int, x1: int, y1: int, **style) -> None:
    box = x1 - x0 + 1
    if shape == "square":
        draw.rectangle([x0 + 4, y0 + 4, x1 - 4, y1 - 4], **style)
    elif shape == "circle":
        draw.ellipse([x0 + 2, y0 + 2, x1 - 2, y1 - 2], **style)
    elif shape == "triangle":
        draw.polygon([((x0 + x1) / 2, y0 + 2), (x0 + 2, y1 - 2), (x1 - 2, y1 - 2)], **style)
    elif shape == "cross":
        a = box // 5  # half-width of the bars
        mx, my = x0 + box // 2, y0 + box // 2
        lf, tp, rt, bt = x0 + 2, y0 + 2, x1 - 2, y1 - 2
        pts = [
            (mx - a, tp),
            (mx + a, tp),
            (mx + a, my - a),
            (rt, my - a),
            (rt, my + a),
            (mx + a, my + a),
            (mx + a, bt),
            (mx - a, bt),
            (mx - a, my + a),
            (lf, my + a),
            (lf, my - a),
            (mx - a, my - a),
        ]
        draw.polygon(pts, **style)
    else:  # pragma: no cover - guarded by SHAPES
        raise ValueError(shape)


def _texture(shape: str, rgb: tuple[int, int, int], box: int = BOX) -> Image.Image:
    """A box x box tile of the shape's texture: its colour with darker stripes / checks."""
    tile = Image.new("RGB", (box, box), rgb)
    kind = TEXTURES[shape]
    if kind == "plain":
        return tile
    dark = tuple(v // 2 for v in rgb)
    draw = ImageDraw.Draw(tile)
    p, h = TEXTURE_PERIOD, TEXTURE_PERIOD // 2
    for i in range(0, box, p):
        if kind == "hstripes":
            draw.rectangle([0, i, box - 1, i + h - 1], fill=dark)
        elif kind == "vstripes":
            draw.rectangle([i, 0, i + h - 1, box - 1], fill=dark)
        else:  # checker
            for j in range(0, box, p):
                if (i // p + j // p) % 2 == 0:
                    draw.rectangle([i, j, i + p - 1, j + p - 1], fill=dark)
    return tile


def render_image(
    objects: list[Obj], rng: random.Random, g: Geometry = FULL, size: tuple[int, int] | None = None
) -> Image.Image:
    """Draw objects (each ``g.span`` patches wide) on a plain background of ``size`` (width, height; default
    ``g.image`` square); background and colours get a small jitter."""
    bg = tuple(max(0, min(255, v + rng.randint(-6, 6))) for v in BACKGROUND)
    img = Image.new("RGB", size or (g.image, g.image), bg)
    box = g.box
    draw = ImageDraw.Draw(img)
    for obj in objects:
        rgb = tuple(max(0, min(255, v + rng.randint(-20, 20))) for v in COLOURS[obj.colour])
        r, c = obj.cell
        x0, y0 = c * g.patch, r * g.patch
        mask = Image.new("L", (box, box), 0)
        _silhouette(ImageDraw.Draw(mask), obj.shape, 0, 0, box - 1, box - 1, fill=255)
        img.paste(_texture(obj.shape, rgb, box), (x0, y0), mask)
        _silhouette(draw, obj.shape, x0, y0, x0 + box - 1, y0 + box - 1, outline=OUTLINE, width=OUTLINE_WIDTH)
    return img


@functools.cache
def _cover(shape: str) -> tuple[tuple[float, ...], ...]:
    """Share of each of a shape's SPAN x SPAN patches its silhouette covers."""
    mask = Image.new("L", (BOX, BOX), 0)
    _silhouette(ImageDraw.Draw(mask), shape, 0, 0, BOX - 1, BOX - 1, fill=255)
    px = mask.load()
    return tuple(
        tuple(
            sum(
                px[x, y] > 0
                for y in range(dr * PATCH_SIZE, (dr + 1) * PATCH_SIZE)
                for x in range(dc * PATCH_SIZE, (dc + 1) * PATCH_SIZE)
            )
            / PATCH_SIZE**2
            for dc in range(SPAN)
        )
        for dr in range(SPAN)
    )


def patch_labels(objects: list[Obj], min_cover: float = 0.3) -> list[Obj | None]:
    """Per vision token (row-major over the ``GRID`` x ``GRID`` patches), the object covering at least
    ``min_cover`` of the patch, or None. Training uses it for the feature-alignment term."""
    out: list[Obj | None] = [None] * TOKENS_PER_IMAGE
    for obj in objects:
        cover = _cover(obj.shape)
        r0, c0 = obj.cell
        for dr in range(SPAN):
            for dc in range(SPAN):
                if cover[dr][dc] >= min_cover:
                    out[(r0 + dr) * GRID + c0 + dc] = obj
    return out


def place(rng: random.Random, pairs: list[tuple[str, str]], g: Geometry = FULL) -> list[Obj]:
    """Non-overlapping ``g.span`` x ``g.span`` placements (top-left patch cells) for (shape, colour) pairs,
    aligned to patch boundaries."""
    n, span = g.grid, g.span
    while True:  # greedy placement can (rarely) paint itself into a corner: start over
        free = [(r, c) for r in range(n - span + 1) for c in range(n - span + 1)]
        objs: list[Obj] = []
        for shape, colour in pairs:
            if not free:
                break
            cell = rng.choice(free)
            objs.append(Obj(shape=shape, colour=colour, cell=cell))
            free = [(r, c) for r, c in free if abs(r - cell[0]) >= span or abs(c - cell[1]) >= span]
        if len(objs) == len(pairs):
            return objs


def _scene(
    rng: random.Random,
    n: int,
    avoid_shape: str | None = None,
    avoid_colour: str | None = None,
    g: Geometry = FULL,
) -> list[Obj]:
    """n objects with pairwise distinct shapes and colours, none of ``avoid_shape`` / ``avoid_colour``."""
    shapes = rng.sample([s for s in SHAPES if s != avoid_shape], n)
    colours = rng.sample([c for c in COLOURS if c != avoid_colour], n)
    return place(rng, list(zip(shapes, colours, strict=True)), g)


# --- examples -------------------------------------------------------------------------------------------


def _example(rng: random.Random, kind: str, max_objects: int = 4, g: Geometry = FULL) -> Example:
    if kind in ("colour_of_shape", "count", LONG_KIND):
        # one-shape scenes are part of the mix: they teach the colour read-out that the keyed look-up in
        # busier scenes builds on
        objs = _scene(rng, rng.randint(1, max_objects), g=g)
        scenes = [objs]
        if kind == "count":
            qa, focus = qa_count(len(objs)), [(0, o) for o in objs]
        else:
            t = rng.choice(objs)
            qa, focus = (qa_colour_long(t) if kind == LONG_KIND else qa_colour_of_shape(t)), [(0, t)]
    elif kind == "colour_of_shape_2img":
        target = Obj(rng.choice(SHAPES), rng.choice(list(COLOURS)), (0, 0))
        n_with, n_other = rng.randint(1, 3), rng.randint(1, 3)
        rest = _scene(rng, n_with - 1, target.shape, target.colour, g)
        pairs = [(o.shape, o.colour) for o in rest] + [(target.shape, target.colour)]
        rng.shuffle(pairs)
        with_target = place(rng, pairs, g)
        # the other image has no shape of the key's kind (its colours may repeat the target's)
        other = _scene(rng, n_other, target.shape, None, g)
        first = rng.randrange(2) == 0
        scenes = [with_target, other] if first else [other, with_target]
        t = next(o for o in with_target if o.shape == target.shape)
        qa, focus = qa_colour_of_shape(t, True), [(0 if first else 1, t)]
    elif kind == "colour_of_two_shapes":
        n = rng.randint(2, 4)
        shapes = rng.sample(SHAPES, n)
        colours = rng.sample(list(COLOURS), n)
        if rng.randrange(2) == 0:  # half the scenes give the two asked shapes one colour
            colours[1] = colours[0]
        objs = place(rng, list(zip(shapes, colours, strict=True)), g)
        rng.shuffle(objs)
        a, b = next(o for o in objs if o.shape == shapes[0]), next(o for o in objs if o.shape == shapes[1])
        if rng.randrange(2) == 0:
            a, b = b, a
        scenes = [objs]
        qa, focus = qa_two_shapes(a, b), [(0, a), (0, b)]
    else:
        raise ValueError(f"unknown kind {kind!r}")
    images = [render_image(objs, rng, g) for objs in scenes]
    return Example(images, qa.question, qa.answer, qa.target, qa.category, qa.kind, scenes, focus)


def _rng(split: str, seed: int, index: int) -> random.Random:
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    # str seeds are hashed with SHA-512 by random.Random: deterministic across runs and platforms, and the
    # split name keeps the two seed spaces disjoint.
    return random.Random(f"vlkv-synthetic-576/{split}/{seed}/{index}")


def make_example(
    index: int,
    seed: int = 0,
    split: str = "train",
    kind: str | None = None,
    weights: list[float] | None = None,
    max_objects: int = 4,
    geometry: Geometry = FULL,
) -> Example:
    """The ``index``-th example of the stream ``(split, seed)``; ``kind`` forces a question kind,
    ``weights`` (one per entry of ``KINDS``) replaces ``KIND_WEIGHTS`` and ``max_objects`` caps the shapes of
    one-image colour and count scenes (training's warm-up)."""
    rng = _rng(split, seed, index)
    k = rng.choices(KINDS, weights=weights or KIND_WEIGHTS)[0]
    return _example(rng, kind or k, max_objects, geometry)


def make_examples(n: int, seed: int = 0, split: str = "train") -> list[Example]:
    """``n`` deterministic examples of the given split."""
    return [make_example(i, seed, split) for i in range(n)]


# --- scoring --------------------------------------------------------------------------------------------

_WORD_RE = re.compile(r"[a-z]+|[0-9]+")  # numbers: smol_codes' codes


def deciding_words(text: str, scored: frozenset[str] = DECIDING_WORDS) -> list[str]:
    """The ``scored`` words of ``text`` (by default the deciding words: colours, numbers, the unused
    verdicts), in order."""
    return [w for w in _WORD_RE.findall(text.lower()) if w in scored]


def is_correct(generated_text: str, example: Example, scored: frozenset[str] = DECIDING_WORDS) -> bool:
    """True iff the ``scored`` words of the generated text are exactly those of the reference answer, in
    order: the one scoring of this task and of every zoo member (``lab/vlkv_lab/zoo/interface.py``).

    By default shape words are keys the answer repeats and are not scored. ``generated_text`` is the decoded
    continuation (special tokens may or may not be stripped; text after the first eos is ignored).
    """
    text = generated_text.split("</s>")[0]
    return deciding_words(text, scored) == deciding_words(example.answer, scored)


# --- prompts --------------------------------------------------------------------------------------------


def prompt_text(processor, example: Example) -> str:
    """The rendered prompt: the checkpoint's chat template over the example's one user turn."""
    return processor.apply_chat_template(example.messages, add_generation_prompt=True)
