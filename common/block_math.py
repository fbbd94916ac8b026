"""Block arithmetic shared by the decode pool (``decode_worker``), the router and the NIXL block layout.

No torch here: the router's block manager imports it (``pyproject.toml``'s torch-free contract)."""


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` for integers, exact (no float)."""
    return -(-a // b)
