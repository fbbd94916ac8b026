"""Per-request image-KV reuse settings (public API ``ReuseParams``), validated once at the gateway.

``enabled`` (``reuse: auto``, the default) lets the prefill worker reuse a cached image's K/V; ``off``
neither reads nor fills the cache. ``mode`` picks how much of a reused image is recomputed:

- ``vlcache`` (default): per-layer ratios, non-increasing with depth in steps of 0.1, chosen greedily under
  the total budget ``ratio`` (the mean over layers) from the calibrated per-layer sensitivities;
- ``mpic``: the same share ``ratio`` of every image's earliest tokens recomputed in every layer;
- ``none``: nothing of the image recomputed (only the text).

An exact prefix hit (the same ids and images before and including the image) recomputes nothing of it.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch

REUSE_MODES = ("layerwise", "mpic", "none")
CONVERSATION_MODES = ("recompress", "continue")  # a follow-up turn: re-compressed, or appended (opt-in)
# "vlcache" named the layer-aware mode until it also named a compression policy; requests may still send it
REUSE_MODE_ALIASES = {"vlcache": "layerwise"}
DEFAULT_RECOMPUTE_RATIO = 0.05
ANONYMOUS = "anonymous"  # the tenant of callers without an API token
TENANT_KEY = "vlkv-tenant"  # metadata key of the caller's tenant on the gateway's Prefill calls
RETAINED_KEY = "vlkv-retained"  # a decode worker's Decode trailer: the positions of the cache it kept
MAX_TENANT_CHARS = 128


@dataclass(frozen=True, slots=True)
class ReuseSettings:
    enabled: bool = True
    mode: str = "layerwise"
    ratio: float = DEFAULT_RECOMPUTE_RATIO  # share of the image's token-layers recomputed, in [0, 1]
    conversation: str = "recompress"  # a follow-up turn (CONVERSATION_MODES; ReuseParams.conversation)

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", REUSE_MODE_ALIASES.get(self.mode, self.mode))
        if self.mode not in REUSE_MODES:
            raise ValueError(f"reuse mode must be one of {', '.join(REUSE_MODES)}, got {self.mode!r}")
        if not (math.isfinite(self.ratio) and 0.0 <= self.ratio <= 1.0):
            raise ValueError(f"reuse recompute ratio must be in [0, 1], got {self.ratio}")
        if self.conversation not in CONVERSATION_MODES:
            raise ValueError(
                f"conversation must be one of {', '.join(CONVERSATION_MODES)}, got {self.conversation!r}"
            )


def image_hashes(pixel_values: torch.Tensor | None, image_sizes: torch.Tensor | None = None) -> list[str]:
    """One digest per image of the processor's pixel values (``[images, ...]``) and, where the model takes
    them (LLaVA-NeXT), its ``image_sizes`` row: what the image's features are computed from. The prefill
    worker keys its image cache on the digest it computes from the pixels it runs; the gateway's (of the
    same tensors) only routes a request to the worker likely to hold its images."""
    if pixel_values is None:
        return []
    out = []
    for i, img in enumerate(pixel_values):
        t = img.detach().cpu().contiguous()
        h = hashlib.blake2b(digest_size=16)
        h.update(f"{t.dtype}:{tuple(t.shape)}|".encode())
        if image_sizes is not None:
            h.update(f"{[int(v) for v in image_sizes[i].tolist()]}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        out.append(h.hexdigest())
    return out


def tenant_of(token: str) -> str:
    """The image cache's tenant for a caller's API token: a digest of it, ``anonymous`` without one."""
    if not token:
        return ANONYMOUS
    return "t-" + hashlib.blake2b(token.encode(), digest_size=12).hexdigest()
