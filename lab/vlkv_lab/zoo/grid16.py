"""Zoo member ``grid16``: 256 vision tokens per image (16x16 patches), a one-line question, short answers.

The task (its own, not the default's): a 224 x 224 image (patch 14: **16 x 16 = 256 vision tokens**) holds
1-5 shapes (square, circle, triangle, cross, each 4 x 4 patches with its texture) in pairwise distinct
colours; shapes may repeat, so a shape is never a key. The question names colours and the answer reads out
shapes (the default task goes the other way):

- ``shape_of_colour``       "which shape is red ?" -> "the red circle ." (the deciding word is the 3rd
  generated token)
- ``shapes_of_two_colours`` "which shapes are red and blue ?" -> "the red circle and the blue square ."
  (two regions; deciding words are the 3rd and 7th tokens)

The answer repeats the colour right before the shape, so each look-up is one hop from the key token. The
prompt has no system prompt: ``<s> USER : <image> which shape is red ? ASSISTANT :``, 266-271 tokens.

Scoring (``is_correct``): the colour and shape words of the generated text (up to the first eos), in order,
must equal the reference answer's.

Training: ``python -m vlkv_lab.zoo.grid16 --out lab/vlkv_lab/zoo/models/grid16`` (``lab/vlkv_lab/zoo/training.py``):
a vision probe, then one-shape scenes growing to five over the first 40% of steps, the two-colour kind
joining at 30%.
"""

from __future__ import annotations

from vlkv.deploy.synthetic_task import COLOURS, SHAPES, Example, Geometry

from vlkv_lab.zoo.interface import Member
from vlkv_lab.zoo.scenes import example_rng, place, render_image
from vlkv_lab.zoo.trainer import main
from vlkv_lab.zoo.training import Arch, small_llava

NAME = "grid16"
GEOM = Geometry(image=224, patch=14, span=4)  # 16 x 16 patches; a shape covers 4 x 4 of them
MAX_NEW_TOKENS = 10  # the longest answer is 8 words + eos
GEOMETRY = (
    "LLaVA-1.5, 256 vision tokens/image (16x16, 224 px), 4 layers, MHA 4/4; no system prompt, a one-line "
    "question after the image, 4-8 token answers (shape keyed by colour, one or two regions)"
)
KINDS = ("shape_of_colour", "shapes_of_two_colours")
KIND_WEIGHTS = (0.6, 0.4)
MAX_OBJECTS = 5
QUESTIONS = {
    "shape_of_colour": ("which shape is {a} ?", "what shape is the {a} one ?"),
    "shapes_of_two_colours": ("which shapes are {a} and {b} ?", "what shapes are the {a} and the {b} ones ?"),
}
WORDS: list[str] = list(
    dict.fromkeys("which what shape shapes is are the one ones and".split() + [*COLOURS, *SHAPES, "?", "."])
)
ARCH = Arch(geometry=GEOM, layers=4, hidden=128, heads=4, kv_heads=4, rope_theta=1e6)


def make_example(
    index: int, seed: int = 0, split: str = "heldout", kind: str | None = None, max_objects: int = MAX_OBJECTS
) -> Example:
    """The ``index``-th example of the stream ``(split, seed)``; ``kind`` forces a kind, ``max_objects``
    caps the scene (training's warm-up)."""
    rng = example_rng(NAME, split, seed, index)
    drawn = rng.choices(KINDS, weights=KIND_WEIGHTS)[0]
    kind = kind or drawn
    lo = 2 if kind == "shapes_of_two_colours" else 1
    n = rng.randint(lo, max(lo, max_objects))
    colours = rng.sample(list(COLOURS), n)
    objs = place(rng, [(rng.choice(SHAPES), c) for c in colours], GEOM)
    asked = rng.sample(objs, 2 if kind == "shapes_of_two_colours" else 1)
    template = rng.choice(QUESTIONS[kind])
    question = template.format(a=asked[0].colour, b=asked[-1].colour)
    answer = " and ".join(f"the {o.colour} {o.shape}" for o in asked) + " ."
    image = render_image(objs, rng, GEOM)
    return Example([image], question, answer, asked[-1].shape, "shape", kind, [objs], [(0, o) for o in asked])


def make_examples(n: int, seed: int = 0, split: str = "heldout") -> list[Example]:
    """``n`` deterministic examples of the split (``"train"`` or ``"heldout"``: disjoint seed spaces)."""
    return [make_example(i, seed, split) for i in range(n)]


def train_example(index: int, frac: float) -> Example:
    """Training's curriculum at progress ``frac``: scenes grow from one shape to five over the first 40% of
    training (one shape teaches the read-out, more the look-up by colour); two-colour questions from 30%."""
    max_objects = min(MAX_OBJECTS, 1 + int(frac / 0.4 * MAX_OBJECTS))
    kind = "shape_of_colour" if frac < 0.3 else None
    return make_example(index, 0, "train", kind=kind, max_objects=max_objects)


MEMBER = Member.shipped(NAME, MAX_NEW_TOKENS, GEOMETRY, make_examples)
RECIPE = small_llava(MEMBER, WORDS, None, ARCH, train_example, tuple(SHAPES), steps=800, probe_steps=50)

if __name__ == "__main__":
    main(RECIPE)
