"""Block keys of a prompt's prefix: the chain of digests the prefill worker's prefix cache and the gateway's
prefix index key a prompt's full blocks on (as vLLM's automatic prefix caching hashes blocks).

Block ``i`` holds tokens ``i*B .. (i+1)*B-1``; its key is a digest of the key before it (the seed for block
0), its ``B`` token ids, and the digests of the images whose first token falls in it. Equal keys at block
``i`` mean an equal prompt up to the end of block ``i``: the same ids and the same images (by the digest of
their pixel values) at the same places. The seed holds the model fingerprint and the tenant, so a key never
matches across models, nor across tenants unless they are configured to share one seed.

Torch-free: the gateway (ids from the processor, its image digests) and the prefill worker (the ids and the
digests of the pixel values it runs) compute the same keys; only the worker's are ever a cache key.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

DEFAULT_BLOCK = 16  # tokens per prefix block


def image_runs(ids: Sequence[int] | np.ndarray, image_token_id: int) -> list[int]:
    """Where each contiguous run of image tokens starts."""
    arr = np.asarray(ids, dtype=np.int64).reshape(-1)
    is_img = arr == image_token_id
    if not is_img.any():
        return []
    edges = np.flatnonzero(is_img & ~np.concatenate(([False], is_img[:-1])))
    return [int(e) for e in edges]


def image_starts(
    ids: Sequence[int] | np.ndarray, image_token_id: int, counts: Sequence[int], num_images: int
) -> list[int]:
    """Each image's first token: from its token count when known (``counts``, the processor's), else one
    image per run of image tokens; when neither fits, every image at the first image token (the keys stay
    exact: a block's key then carries all the digests at once; with no image token, at 0)."""
    arr = np.asarray(ids, dtype=np.int64).reshape(-1)
    where = np.flatnonzero(arr == image_token_id)
    if num_images == 0:
        return []
    if where.size == 0:
        return [0] * num_images
    if len(counts) == num_images and sum(counts) == where.size:
        firsts = np.cumsum([0, *counts[:-1]])
        return [int(where[f]) for f in firsts]
    runs = image_runs(arr, image_token_id)
    return runs if len(runs) == num_images else [int(where[0])] * num_images


def prefix_seed(fingerprint: str, tenant: str, block: int) -> bytes:
    return f"vlkv-prefix|{fingerprint}|{tenant}|{block}".encode()


def block_keys(
    ids: Sequence[int] | np.ndarray,
    image_digests: Sequence[str],
    starts: Sequence[int],
    seed: bytes,
    block: int = DEFAULT_BLOCK,
) -> list[str]:
    """The key of every full block of ``ids`` (``len(ids) // block`` keys), image ``j`` (digest
    ``image_digests[j]``) starting at ``starts[j]``."""
    if block < 1:
        raise ValueError("block must be >= 1")
    if len(image_digests) != len(starts):
        raise ValueError("one start per image digest")
    arr = np.asarray(ids, dtype="<i8").reshape(-1)
    keys: list[str] = []
    parent = hashlib.blake2b(seed, digest_size=16).digest()
    for b in range(arr.size // block):
        lo, hi = b * block, (b + 1) * block
        h = hashlib.blake2b(parent, digest_size=16)
        h.update(arr[lo:hi].tobytes())
        for digest, start in zip(image_digests, starts, strict=True):
            if lo <= start < hi:
                h.update(b"|img:" + digest.encode())
        parent = h.digest()
        keys.append(parent.hex())
    return keys
