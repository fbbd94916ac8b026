"""An asyncio event loop on a virtual clock: ``loop.time()`` is simulated seconds, and when nothing is ready
to run the clock jumps to the next timer instead of waiting. Code that takes its time from the loop
(``asyncio.sleep``, ``wait_for``, ``loop.time()``: the router, the admission queue, the autoscaler) runs
unchanged, as fast as the CPU allows. No sockets or threads: nothing outside the loop can wake it.
"""

from __future__ import annotations

import asyncio
import selectors


class _JumpSelector(selectors.SelectSelector):
    """Never waits on the registered descriptors (the loop's self-pipe): a wait advances the clock."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0

    def select(self, timeout=None):
        if timeout is None:
            raise RuntimeError("the simulation has nothing left to run and nothing scheduled")
        self.now += max(timeout, 0.0)
        return []


class VirtualLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        self._jump = _JumpSelector()
        super().__init__(self._jump)
        self._clock_resolution = 1e-9

    def time(self) -> float:
        return self._jump.now


def run(coro):
    """Run ``coro`` to completion on a fresh virtual-time loop."""
    loop = VirtualLoop()
    try:
        return loop.run_until_complete(coro)
    finally:
        rest = asyncio.all_tasks(loop)
        for task in rest:
            task.cancel()
        if rest:
            loop.run_until_complete(asyncio.gather(*rest, return_exceptions=True))
        loop.close()
