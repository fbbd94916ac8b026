"""Random PNG images for requests: the same bytes for the same seed."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image


def random_png(seed: int, size: int = 40) -> bytes:
    rng = np.random.default_rng(seed)
    img = Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()
