"""Scenes shared by the zoo members ``grid16`` and ``longprompt``: objects on a patch grid, their images and
the per-patch labels training's vision probe uses.

The pixels follow the default task's visual language (``tools/task/synthetic_task``: dark background, a
light outline, a colour with a darker texture whose period puts two repeats in every 14-pixel patch), so
the default model's vision tower starts out knowing colours and textures; what differs is the grid, the
number of shapes, which attributes key a question and which one it reads out.

An object is ``synthetic_task.Obj(shape, colour, cell)``: a silhouette (``SHAPES``, each with its own
texture) in a colour, its top-left patch at ``cell``.
"""

from __future__ import annotations

import random

import numpy as np
from PIL import Image
from vlkv.tools.task.synthetic_task import COLOURS, SHAPES, Geometry, Obj, render_image

__all__ = ["COLOURS", "SHAPES", "Geometry", "Obj", "patch_labels", "place", "render_shapes"]


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
