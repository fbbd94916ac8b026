"""The gateway's admission queue: requests waiting for a decode worker with room, first come first
served. Only the head looks for room (every ``ADMIT_POLL_S``), so a large request is not overtaken for
ever by small ones; the queue is bounded (``max_waiting``) and each wait by ``wait_s``."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TypeVar

from vlkv.common.errors import ResourceExhausted

ADMIT_POLL_S = 0.02  # how often the head of the queue looks for a decode worker with room again

T = TypeVar("T")


class AdmissionQueue:
    def __init__(self, poll_s: float = ADMIT_POLL_S) -> None:
        self.poll_s = poll_s
        self._tickets: deque[object] = deque()

    def __len__(self) -> int:
        return len(self._tickets)

    async def admit(self, attempt: Callable[[], Awaitable[T | None]], wait_s: float, max_waiting: int) -> T:
        """``attempt()``'s first result that is not None: at once if nobody waits, else once this request is
        at the head of the queue. RESOURCE_EXHAUSTED when the queue is full or ``wait_s`` runs out."""
        if not self._tickets:
            got = await attempt()
            if got is not None:
                return got
        if len(self._tickets) >= max_waiting or wait_s <= 0:
            raise ResourceExhausted(
                f"no decode worker has room for this request ({len(self._tickets)} requests waiting)"
            )
        ticket = object()
        self._tickets.append(ticket)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        try:
            while True:
                if self._tickets[0] is ticket:
                    got = await attempt()
                    if got is not None:
                        return got
                if loop.time() >= deadline:
                    raise ResourceExhausted(f"no decode worker had room for this request within {wait_s:g} s")
                await asyncio.sleep(self.poll_s)
        finally:
            self._tickets.remove(ticket)
