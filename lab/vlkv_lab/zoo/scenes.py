"""The zoo's one scene library: objects on a patch grid in the default task's visual language, their images,
the questions the members ask about them, and the per-patch labels training's vision probe uses.

The pixels and the placement are the default task's (``lab/vlkv_lab/task/synthetic_task``: ``render_image``,
``place``; a dark background, a light outline, a colour with a darker texture whose period puts two repeats
in every 14-pixel patch), so the default model's vision tower starts out knowing colours and textures; what
differs per member is the canvas, the grid, the object size, which attributes key a question and which one
it reads out.

An object is ``synthetic_task.Obj(shape, colour, cell)``: a silhouette (``SHAPES``, each with its own
texture) in a colour, its top-left patch at ``cell``; every object of one image is ``span`` patches wide.

``next_anyres`` and ``deep8`` ask the default task's look-up (``qa_one`` / ``qa_two``: the question names a
shape, unique in the image; the answer repeats it and names its colour). What did not train in time there
(kept as the lesson): the *inverse* look-up, colour-keyed ("what shape is the red one ?" -> "the red cross
."). Fine-tuned from the default model, the answer's copy of the colour key did not form: after 100 steps
(batch 8, 1-3 objects, 168 px) its loss was still 0.92 nats on two-object scenes and 1.58 on three-object
ones (the model named a colour it saw in the image, not the one asked: the default copies shape words, not
colour words), and 450 steps of the whole recipe reached 0.36 held-out on 336 px images (``deep8``: 0.047
after 370 steps). ``grid16`` and ``longprompt``, trained from a fresh decoder, learned it.
"""

from __future__ import annotations

import random

import numpy as np
from PIL import Image
from vlkv.deploy.synthetic_task import COLOURS, SHAPES, Geometry, Obj, place, render_image

__all__ = [
    "COLOURS",
    "PATCH",
    "SHAPES",
    "Geometry",
    "Obj",
    "example_rng",
    "free_cells",
    "patch_labels",
    "place",
    "qa_one",
    "qa_two",
    "render",
    "render_image",
]

PATCH = 14


def example_rng(member: str, split: str, seed: int, index: int) -> random.Random:
    """One ``random.Random`` per example (seeded by the SHA-512 of the string); the split name keeps train
    and held-out seed spaces disjoint."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    return random.Random(f"vlkv-zoo-{member}/{split}/{seed}/{index}")


def render(objects: list[Obj], rng: random.Random, span: int, width: int, height: int) -> Image.Image:
    """A ``width`` x ``height`` image of ``span``-patch objects (``synthetic_task.render_image``)."""
    return render_image(objects, rng, Geometry(max(width, height), PATCH, span), size=(width, height))


def free_cells(rows: int, cols: int, span: int, taken: list[Obj], gap: int = 1) -> list[tuple[int, int]]:
    """Top-left cells where a ``span``-wide object fits in a ``rows`` x ``cols`` patch grid without touching
    (``gap`` patches apart from) any ``span``-wide object in ``taken``."""
    out = []
    for r in range(rows - span + 1):
        for c in range(cols - span + 1):
            if all(
                r + span + gap <= t.cell[0]
                or t.cell[0] + span + gap <= r
                or c + span + gap <= t.cell[1]
                or t.cell[1] + span + gap <= c
                for t in taken
            ):
                out.append((r, c))
    return out


def qa_one(obj: Obj) -> tuple[str, str]:
    """The colour of one shape: ``"what colour is the cross ?" -> "the cross red ."``."""
    return f"what colour is the {obj.shape} ?", f"the {obj.shape} {obj.colour} ."


def qa_two(a: Obj, b: Obj) -> tuple[str, str]:
    """The colours of two shapes: ``"what colour are the cross and the circle ?" -> "the cross red and the
    circle blue ."``."""
    return (
        f"what colour are the {a.shape} and the {b.shape} ?",
        f"the {a.shape} {a.colour} and the {b.shape} {b.colour} .",
    )


def patch_labels(
    image: Image.Image, objects: list[Obj], g: Geometry, kinds: tuple[str, ...], min_cover: float = 0.3
) -> list[tuple[int, int]]:
    """Per vision token (row-major over the ``g.grid`` x ``g.grid`` patches) its ``(kind, colour)`` class:
    the index in ``kinds`` and in ``COLOURS`` of the object that covers at least ``min_cover`` of the patch,
    ``(len(kinds), len(COLOURS))`` for background. Coverage is read off the image (pixels away from the
    background colour, whose corner pixel no object ever reaches)."""
    px = np.asarray(image, dtype=np.int16)
    fg = np.abs(px - px[0, 0]).max(axis=-1) > 24  # [H, W]
    n, p = g.grid, g.patch
    cover = fg[: n * p, : n * p].reshape(n, p, n, p).mean(axis=(1, 3))  # [grid, grid]
    colours = list(COLOURS)
    out = [(len(kinds), len(colours))] * (n * n)
    for obj in objects:
        r0, c0 = obj.cell
        for r in range(r0, r0 + g.span):
            for c in range(c0, c0 + g.span):
                if cover[r, c] >= min_cover:
                    out[r * n + c] = (kinds.index(obj.shape), colours.index(obj.colour))
    return out
