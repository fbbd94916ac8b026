"""How a router picks among the workers it drew: pure functions ``pick(candidates, need) -> worker | None``
of the candidates (workers with a fresh report, taking requests; ``load_board.Worker``: last report,
``room``, ``free``, ``in_flight``, ``refused``) and the request's ``Need``. They read, never change, what
they are given; reserving the picked worker's blocks is the router's.

``STRATEGIES`` names each decode strategy with how its candidates are drawn and how often a pick may draw
again. ``kv`` is the default: best-of-k, KV-aware. The others are there to be compared (``vlkv simulate
--strategy``): ``poll`` (every worker asked its load per pick, the router before pushed loads), ``best2``
(two drawn, the more free blocks), ``random``, ``round_robin``; the last three have no fit check, so a
full worker refuses the cache (``REFUSAL_POOL_FULL``) and the gateway re-queues.

A new strategy is a function here and a row of ``STRATEGIES``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from vlkv.common.block_math import blocks_needed
from vlkv.v1 import worker_pb2

BUSY_MARGIN = 2  # a holder of the images is "much busier" with more than this many extra requests in flight


@dataclass(frozen=True, slots=True)
class Need:
    """A request as a decode pick sees it: the estimated cache's tokens per layer and its new tokens."""

    layer_tokens: Sequence[int]
    max_new_tokens: int
    windows: Sequence[int] = ()  # per layer its sliding window (0: none): a binding one's decode is a ring

    def blocks(self, load: worker_pb2.WorkerLoad, whole: bool = False) -> int:
        """Blocks the worker takes at admission (the cache, plus max_new_tokens if it reserves them), or
        with ``whole`` the most the sequence can ever hold."""
        extra = self.max_new_tokens if load.reserves_new_tokens or whole else 0
        return blocks_needed(list(self.layer_tokens), extra, max(load.block_size, 1), self.windows)


def most_room_that_fits(candidates, need: Need):
    """``kv``, ``poll``: of the workers whose room covers the request (and that did not refuse a cache
    since their last report), the one with the most room; fewer requests in flight breaks ties."""
    best, best_key = None, None
    for w in candidates:
        if w.refused:
            continue
        room = w.room
        if need.blocks(w.load) <= room and (best is None or (room, -w.in_flight) > best_key):
            best, best_key = w, (room, -w.in_flight)
    return best


def most_free(candidates, need: Need):
    """``best2``: the more free blocks of those drawn, fitting or not."""
    return max(candidates, key=lambda w: w.free, default=None)


def first(candidates, need: Need):
    """``random``, ``round_robin``: the one drawn."""
    return candidates[0] if candidates else None


@dataclass(frozen=True)
class Strategy:
    pick: Callable  # (candidates, need) -> worker | None
    draw: str  # "sample" (k at random), "two", "one", "next" (round robin), "poll" (every worker, asked)
    rounds: int  # draws per pick before it gives up (x k for draws of one or two)
    per_k: bool = False  # ``rounds`` is per worker drawn by ``sample``


STRATEGIES: dict[str, Strategy] = {
    "kv": Strategy(most_room_that_fits, "sample", 2),
    "poll": Strategy(most_room_that_fits, "poll", 1),
    "best2": Strategy(most_free, "two", 2, per_k=True),
    "random": Strategy(first, "one", 2, per_k=True),
    "round_robin": Strategy(first, "next", 2, per_k=True),
}


def pick_prefill(candidates, holders: dict, margin: int = BUSY_MARGIN):
    """The holder of most of the request's images (``holders``: worker -> images it holds, among those
    that may take it), unless it has more than ``margin`` requests in flight beyond the least-loaded
    candidate; else that least-loaded one (reachable first). None when there are no candidates."""
    least = min(candidates, key=lambda w: (not w.reachable, w.in_flight), default=None)
    if least is None:
        return None
    if holders:
        best = max(holders, key=lambda w: (holders[w], -w.in_flight))
        if best.in_flight - least.in_flight <= margin:
            return best
    return least
