"""The router's parts alone, without servers or an event loop of workers: the load board (reports,
staleness, reservations), the image index, the strategies (pure picks) and the admission queue."""

from __future__ import annotations

import asyncio
import random

import pytest
from vlkv.common.errors import ResourceExhausted
from vlkv.services.admission_queue import AdmissionQueue
from vlkv.services.image_index import ImageIndex
from vlkv.services.load_board import DROP_S, STALE_S, LoadBoard, Worker
from vlkv.services.strategies import (
    BUSY_MARGIN,
    STRATEGIES,
    Need,
    most_free,
    most_room_that_fits,
    pick_prefill,
)
from vlkv.v1 import worker_pb2
from vlkv_lab.sim import vclock


def _load(
    admit: int, free: int | None = None, total: int = 1000, reserves: bool = True
) -> worker_pb2.WorkerLoad:
    free = admit if free is None else free
    return worker_pb2.WorkerLoad(
        total_blocks=total, free_blocks=free, admit_blocks=admit, block_size=16, reserves_new_tokens=reserves
    )


def _board(*admits: int) -> LoadBoard:
    board = LoadBoard()
    for i, admit in enumerate(admits):
        w = Worker(f"w{i}")
        board.join(w)
        board.report(w, _load(admit), now=0.0)
    return board


# -- load board ------------------------------------------------------------------------------------------
def test_a_reservation_holds_until_the_report_after_it_settles():
    board = _board(100)
    w = board["w0"]
    r = board.reserve(w, 30)
    assert w.room == 70 and w.free == 70
    board.report(w, _load(100), now=1.0)  # a report sent before the cache arrived: the promise stays
    assert w.room == 70
    r.settle()
    r.settle()  # idempotent
    assert w.room == 70  # settled, but the worker has not reported the cache yet
    board.report(w, _load(70), now=2.0)  # this report counts the cache itself
    assert w.room == 70 and w.promised == 0 and w.settling == 0
    board.report(w, _load(70), now=3.0)
    assert w.room == 70


def test_reservations_of_several_requests_settle_independently():
    board = _board(100)
    w = board["w0"]
    a, b = board.reserve(w, 10), board.reserve(w, 20)
    a.settle()
    board.report(w, _load(90), now=1.0)  # counts a's cache; b's is still on its way
    assert w.promised == 20 and w.room == 70
    b.settle()
    board.report(w, _load(70), now=2.0)
    assert w.promised == 0 and w.room == 70


def test_staleness_and_drop():
    board = _board(10, 10)
    w0, w1 = board["w0"], board["w1"]
    assert board.fresh(w0, STALE_S) and not board.fresh(w0, STALE_S + 0.1)
    assert w0.index >= 0  # stale is skipped, not dropped
    assert not board.fresh(w0, DROP_S + 0.1) and w0.index < 0 and not w0.reachable
    assert board.live == [w1]
    board.report(w0, _load(10), now=DROP_S + 1)  # back once it reports again
    assert set(board.live) == {w0, w1} and w0.reachable
    board.lost(w1)
    assert board.live == [w0] and w1.failed
    board.leave("w0")
    assert board.live == [] and "w0" not in board
    w1.draining = True
    assert not board.usable(w1, DROP_S + 1)


def test_draws_are_bounded_and_round_robin_cycles():
    board = _board(*[10] * 9)
    rng = random.Random(0)
    assert len(board.draw(rng, 4)) == 4 and len(set(board.draw(rng, 4))) == 4
    assert len(board.draw(rng, 20)) == 9
    assert len({board.draw_next()[0].address for _ in range(9)}) == 9


def test_the_idle_set_follows_requests_in_flight():
    board = LoadBoard(idle=True)
    w = Worker("p0")
    board.join(w)
    assert board.idle == {w}
    w.in_flight += 1
    assert board.idle == set()
    w.in_flight -= 1
    assert board.idle == {w}
    board.leave("p0")
    assert board.idle == set()
    w.in_flight = 0  # left the board: no longer tracked
    assert board.idle == set()


def test_the_largest_pool_is_remembered():
    board = LoadBoard()
    for i, total in enumerate((500, 2000, 1000)):
        w = Worker(f"w{i}")
        board.join(w)
        board.report(w, _load(10, total=total), now=0.0)
    assert board.largest.total_blocks == 2000


# -- strategies ------------------------------------------------------------------------------------------
def test_need_counts_blocks_per_layer():
    need = Need([32, 17], 16)
    assert need.blocks(_load(0)) == 3 + 3  # ceil((32 + 16) / 16) + ceil((17 + 16) / 16)
    assert need.blocks(_load(0, reserves=False)) == 2 + 2
    assert need.blocks(_load(0, reserves=False), whole=True) == 6


def test_kv_pick_takes_the_most_room_that_fits_and_skips_refusers():
    board = _board(5, 40, 30)
    need = Need([32] * 4, 16)  # 12 blocks
    cands = list(board.values())
    assert most_room_that_fits(cands, need).address == "w1"
    board["w1"].refused = True
    assert most_room_that_fits(cands, need).address == "w2"
    board.reserve(board["w2"], 25)
    assert most_room_that_fits(cands, need) is None  # w0 and w2 lack room, w1 refused
    assert most_room_that_fits([], need) is None


def test_kv_pick_breaks_ties_on_fewer_requests_in_flight():
    board = _board(40, 40)
    board["w0"].in_flight = 3
    assert most_room_that_fits(list(board.values()), Need([16], 0)).address == "w1"


def test_unchecked_strategies_pick_whether_or_not_it_fits():
    board = _board(5, 3)
    need = Need([1000], 0)
    assert most_free(list(board.values()), need).address == "w0"
    assert STRATEGIES["random"].pick([board["w1"]], need).address == "w1"
    assert STRATEGIES["round_robin"].pick([], need) is None


def test_every_strategy_is_a_pure_pick():
    board = _board(50, 20)
    before = [(w.promised, w.in_flight, w.refused, w.load.SerializeToString()) for w in board.values()]
    for strategy in STRATEGIES.values():
        strategy.pick(list(board.values()), Need([32] * 2, 8))
    assert before == [
        (w.promised, w.in_flight, w.refused, w.load.SerializeToString()) for w in board.values()
    ]


def test_prefill_pick_prefers_the_holder_unless_much_busier():
    board = _board(0, 0, 0)
    w0, _, w2 = board.values()
    assert pick_prefill(list(board.values()), {}) is w0
    w2.in_flight = BUSY_MARGIN
    assert pick_prefill(list(board.values()), {w2: 1}) is w2
    w2.in_flight = BUSY_MARGIN + 1
    assert pick_prefill(list(board.values()), {w2: 1}) is w0
    w0.reachable = False
    assert pick_prefill(list(board.values()), {}).address == "w1"  # reachable first
    assert pick_prefill([], {}) is None


# -- image index -----------------------------------------------------------------------------------------
def _digests(*hashes: str, tenant: str = "t") -> list[worker_pb2.ImageDigest]:
    return [worker_pb2.ImageDigest(image_hash=h, tenant=tenant) for h in hashes]


def test_image_index_learns_from_prefills_and_reports():
    index = ImageIndex()
    index.note("p0", ("a", "b"), "t")
    assert index.held(("a", "b", "c"), "t") == {"p0": 2}
    assert index.held(("a",), "other") == {}  # another tenant's image
    index.report("p1", worker_pb2.WorkerLoad(images_added=_digests("a", "c")))
    assert index.held(("a", "b", "c"), "t") == {"p0": 1, "p1": 2}
    index.report("p0", worker_pb2.WorkerLoad(images_evicted=_digests("a")))  # p1 holds a now: no change
    index.report("p0", worker_pb2.WorkerLoad(images_evicted=_digests("b")))
    assert index.held(("a", "b"), "t") == {"p1": 1}
    index.report("p1", worker_pb2.WorkerLoad(images_full=True, images_added=_digests("z")))
    assert index.held(("a", "c", "z"), "t") == {"p1": 1}
    index.forget("p1")
    assert len(index) == 0


def test_image_index_forgets_the_least_recently_noted_first():
    index = ImageIndex(capacity=3)
    for h in "abc":
        index.note("p0", (h,))
    index.note("p1", ("a",))  # a noted again: b is now the oldest
    index.note("p1", ("d",))
    assert index.held(tuple("abcd")) == {"p1": 2, "p0": 1} and len(index) == 3
    assert index.held(("b",)) == {}


# -- admission queue -------------------------------------------------------------------------------------
def test_admission_queue_is_first_come_first_served_and_bounded():
    async def main():
        queue, room, order = AdmissionQueue(poll_s=0.05), [0], []

        def attempt_for(name: str):
            async def attempt():
                if room[0] > 0:
                    room[0] -= 1
                    order.append(name)
                    return name
                return None

            return attempt

        waiting = [asyncio.ensure_future(queue.admit(attempt_for(n), 5.0, 2)) for n in ("first", "second")]
        await asyncio.sleep(0.01)
        assert len(queue) == 2
        with pytest.raises(ResourceExhausted, match="2 requests waiting"):
            await queue.admit(attempt_for("third"), 5.0, 2)  # full
        room[0] = 1
        await asyncio.sleep(0.2)
        assert order == ["first"] and len(queue) == 1  # the second waits its turn at the head
        room[0] = 1
        assert await waiting[1] == "second" and len(queue) == 0
        with pytest.raises(ResourceExhausted, match="within 0.5 s"):
            await queue.admit(attempt_for("late"), 0.5, 2)
        assert len(queue) == 0
        with pytest.raises(ResourceExhausted):
            await queue.admit(attempt_for("no wait"), 0.0, 2)

    vclock.run(main())


def test_a_decode_pick_counts_a_sliding_layers_ring_not_its_whole_generation():
    """The router's estimate matches the decode pool's: a binding window caps a layer's growth at its ring."""
    from vlkv.common.block_math import blocks_needed
    from vlkv.services.strategies import Need
    from vlkv.v1 import worker_pb2

    load = worker_pb2.WorkerLoad(block_size=4, reserves_new_tokens=True)
    plain, ring = Need([7, 7, 27], 100), Need([7, 7, 27], 100, (8, 8, 0))
    assert plain.blocks(load) == blocks_needed([7, 7, 27], 100, 4) == 86
    assert ring.blocks(load) == blocks_needed([7, 7, 27], 100, 4, (8, 8, 0)) < plain.blocks(load)
    assert ring.blocks(load) == 2 * 3 + 32  # two rings of 3 blocks, the full layer's 127 tokens in 32
