"""Block arithmetic shared by the decode pool (``decode_worker``), the gateway's router and the NIXL block
layout: a layer of a cache of n tokens takes ``ceil(n / block_size)`` blocks, each layer its own table.

A sliding-window layer (window ``W`` > 0, ``common/model/families.py``) is a ring in the decode pool: the
decode attention reads the last ``W`` entries of its cache only, so the blocks wholly before them are given
back as the cache grows (``dead_blocks``) and the layer never holds more than ``ring_blocks(W)``
blocks, however long the generation (``layer_blocks``).

No torch here: the router sizes requests with it (``pyproject.toml``'s torch-free contract)."""

from collections.abc import Sequence


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` for integers, exact (no float)."""
    return -(-a // b)


def ring_blocks(window: int, block_size: int) -> int:
    """The most blocks a layer with sliding window ``window`` holds while decoding: its next step reads its
    last ``W - 1`` entries and the new token's slot, which span at most ``ceil((W - 1) / P) + 1`` blocks."""
    return ceil_div(window - 1, block_size) + 1


def dead_blocks(length: int, window: int, block_size: int) -> int:
    """Leading blocks of a layer of ``length`` entries that no later step reads: the next step appends at
    index ``length`` and reads entries ``length + 1 - W .. length``, every later one beyond; 0 without a
    window."""
    if window <= 0:
        return 0
    return max(0, (length + 1 - window) // block_size)


def layer_blocks(n: int, extra_tokens: int, block_size: int, window: int = 0) -> int:
    """The most blocks one layer of ``n`` cached entries holds while ``extra_tokens`` are appended to it: a
    sliding layer (``window`` > 0) drops its ``dead_blocks`` after every step, so it holds at most
    ``ring_blocks`` (or the blocks of its first step, for a cache that arrives longer than its window)."""
    blocks = ceil_div(n + extra_tokens, block_size)
    if window <= 0 or extra_tokens <= 0:
        return blocks
    return min(blocks, max(ceil_div(n + 1, block_size), ring_blocks(window, block_size)))


def blocks_needed(
    layer_lengths: list[int], extra_tokens: int, block_size: int, windows: Sequence[int] = ()
) -> int:
    """Blocks that hold ``layer_lengths[l] + extra_tokens`` tokens in every layer l (one table per layer),
    a sliding layer's capped by its ring (``windows[l]`` > 0; ``()``: no layer slides)."""
    if not windows:
        return sum(ceil_div(n + extra_tokens, block_size) for n in layer_lengths)
    if len(windows) != len(layer_lengths):
        raise ValueError(f"{len(windows)} sliding windows for {len(layer_lengths)} layers")
    return sum(
        layer_blocks(n, extra_tokens, block_size, w) for n, w in zip(layer_lengths, windows, strict=True)
    )
