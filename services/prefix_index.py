"""Which prefill worker was last sent each prompt block, as far as this gateway knows: its own record of the
prefills it routed (as SGLang's cache-aware router keeps a tree of the prompts it sent), so a conversation's
follow-up goes to the worker that holds its prefix in its prefix cache. Keys are ``common/prefix_key.py``'s
block chains at ``ROUTE_BLOCK`` tokens, seeded with the tenant: one tenant's prompts never route by
another's. A hint only: the worker checks its own keys, and a miss there prefills in full. Bounded: the least
recently noted blocks are forgotten first."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from vlkv.common.prefix_key import block_keys, image_starts, prefix_seed
from vlkv.common.reuse import ANONYMOUS

ROUTE_BLOCK = 16  # tokens per routed block (the index's own granularity, not the workers')
MAX_PREFIX_BLOCKS = 1 << 17  # block -> worker entries a gateway remembers


def route_keys(
    ids: Sequence[int], image_digests: Sequence[str], image_token_id: int, tenant: str
) -> list[str]:
    """The block chain the gateway routes a prompt by (its ids and its images' digests)."""
    starts = image_starts(ids, image_token_id, [], len(image_digests))
    seed = prefix_seed("", tenant or ANONYMOUS, ROUTE_BLOCK)
    return block_keys(ids, image_digests, starts, seed, ROUTE_BLOCK)


class PrefixIndex:
    def __init__(self, capacity: int = MAX_PREFIX_BLOCKS) -> None:
        self.capacity = capacity
        self._where: OrderedDict[str, str] = OrderedDict()  # least recently noted first

    def __len__(self) -> int:
        return len(self._where)

    def note(self, address: str, keys: Sequence[str]) -> None:
        """``address`` prefilled a prompt of these blocks (its prefix cache holds them now)."""
        for key in reversed(keys):  # deepest first: the root ends most recent
            self._where[key] = address
            self._where.move_to_end(key)
        while len(self._where) > self.capacity:
            self._where.popitem(last=False)

    def longest(self, keys: Sequence[str]) -> tuple[str, int]:
        """The worker noted for the deepest of ``keys`` it knows, and how many blocks that is ("", 0: none)."""
        for i in range(len(keys) - 1, -1, -1):
            address = self._where.get(keys[i])
            if address is not None:
                return address, i + 1
        return "", 0

    def forget(self, address: str) -> None:
        """The worker left: none of its blocks count."""
        for key in [k for k, a in self._where.items() if a == address]:
            del self._where[key]
