"""Scenes shared by the zoo members ``grid16`` and ``longprompt``: objects on a patch grid, their images and
the per-patch labels training's vision probe uses.

The pixels follow the default task's visual language (``tools/task/synthetic_task``: dark background, a
light outline, a colour with a darker texture whose period puts two repeats in every 14-pixel patch), so
the default model's vision tower starts out knowing colours and textures; what differs is the grid, the
object set and what the questions read out.

An object is ``synthetic_task.Obj(shape, colour, cell)``; ``shape`` names either a silhouette (``SHAPES``,
each with its own texture, drawn by ``synthetic_task.render_image``) or, for ``render_cards``, a card's
pattern (``PATTERNS``: every card is a square, only its pattern and colour differ).
"""

from __future__ import annotations

import random

import numpy as np
from PIL import Image, ImageDraw
from vlkv.tools.task.synthetic_task import BACKGROUND, COLOURS, OUTLINE, SHAPES, Geometry, Obj, render_image

PATTERNS = ("rows", "columns", "checks", "plain")
"""Card patterns: stripes across, stripes down, a checkerboard, none."""
PATTERN_PERIOD = 7  # pixels, as the default task's textures: two repeats per 14-pixel patch
CARD_INSET = 3  # pixels between a card and its box, so neighbouring cards never touch

__all__ = ["COLOURS", "PATTERNS", "SHAPES", "Geometry", "Obj", "patch_labels", "place", "render_cards"]


def place(rng: random.Random, pairs: list[tuple[str, str]], g: Geometry) -> list[Obj]:
    """Non-overlapping ``g.span`` x ``g.span`` placements (top-left patch cells) for (shape, colour) pairs,
    aligned to patch boundaries; greedy, starting over when it paints itself into a corner."""
    n, span = g.grid, g.span
    while True:
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


def render_shapes(objects: list[Obj], rng: random.Random, g: Geometry) -> Image.Image:
    """Silhouettes with their textures (the default task's drawing) on a ``g.image`` canvas."""
    return render_image(objects, rng, g)


def _jitter(rgb: tuple[int, int, int], rng: random.Random, amount: int) -> tuple[int, int, int]:
    return tuple(max(0, min(255, v + rng.randint(-amount, amount))) for v in rgb)  # type: ignore[return-value]


def render_cards(objects: list[Obj], rng: random.Random, g: Geometry) -> Image.Image:
    """Square cards filled with their pattern (``obj.shape`` in ``PATTERNS``) in their colour, outlined."""
    img = Image.new("RGB", (g.image, g.image), _jitter(BACKGROUND, rng, 6))
    draw = ImageDraw.Draw(img)
    p, h = PATTERN_PERIOD, PATTERN_PERIOD // 2
    for obj in objects:
        rgb = _jitter(COLOURS[obj.colour], rng, 20)
        dark = tuple(v // 2 for v in rgb)
        r, c = obj.cell
        x0, y0 = c * g.patch + CARD_INSET, r * g.patch + CARD_INSET
        x1, y1 = x0 + g.box - 1 - 2 * CARD_INSET, y0 + g.box - 1 - 2 * CARD_INSET
        draw.rectangle([x0, y0, x1, y1], fill=rgb)
        for i in range(0, g.box, p):
            if obj.shape == "rows":
                draw.rectangle([x0, y0 + i, x1, min(y1, y0 + i + h - 1)], fill=dark)
            elif obj.shape == "columns":
                draw.rectangle([x0 + i, y0, min(x1, x0 + i + h - 1), y1], fill=dark)
            elif obj.shape == "checks":
                for j in range(0, g.box, p):
                    if (i // p + j // p) % 2 == 0:
                        draw.rectangle(
                            [x0 + i, y0 + j, min(x1, x0 + i + p - 1), min(y1, y0 + j + p - 1)], dark
                        )
            elif obj.shape != "plain":
                raise ValueError(f"unknown pattern {obj.shape!r}")
        draw.rectangle([x0, y0, x1, y1], outline=OUTLINE, width=2)
    return img


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
