"""Block arithmetic shared by the decode pool (``decode_worker``), the gateway's router and the NIXL block
layout: a layer of a cache of n tokens takes ``ceil(n / block_size)`` blocks, each layer its own table.

No torch here: the router sizes requests with it (``pyproject.toml``'s torch-free contract)."""


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` for integers, exact (no float)."""
    return -(-a // b)


def blocks_needed(layer_lengths: list[int], extra_tokens: int, block_size: int) -> int:
    """Blocks that hold ``layer_lengths[l] + extra_tokens`` tokens in every layer l (one table per layer)."""
    return sum(ceil_div(n + extra_tokens, block_size) for n in layer_lengths)
