"""The router on pushed load (``WatchLoad``), in virtual time: best-of-k picks over fresh reports only, a
silent worker is skipped then dropped, image-cache reports steer prefill picks, and a pick looks at a
bounded number of workers however many there are."""

from __future__ import annotations

import asyncio

import pytest
from vlkv.common.errors import ResourceExhausted
from vlkv.prefill_worker.image_cache import ImageCache
from vlkv.services import router as router_module
from vlkv.services.router import Router
from vlkv.v1 import worker_pb2
from vlkv_lab.sim import vclock


class _Pushing:
    """A worker stub whose WatchLoad yields what the test puts in its queue."""

    def __init__(self) -> None:
        self.reports: asyncio.Queue = asyncio.Queue()

    async def WatchLoad(self, request):
        while True:
            yield await self.reports.get()


def _router(n: int, **kwargs) -> tuple[Router, dict[str, _Pushing]]:
    stubs: dict[str, _Pushing] = {}

    def connect(router, address, kind):
        stubs[address] = _Pushing()
        return None, stubs[address]

    return Router(connect=connect, seed=1, **kwargs), stubs


def _decode_load(admit: int) -> worker_pb2.WorkerLoad:
    return worker_pb2.WorkerLoad(
        total_blocks=1000, free_blocks=admit, admit_blocks=admit, block_size=16, reserves_new_tokens=True
    )


def test_picks_only_fresh_workers_with_room_and_drops_silent_ones():
    async def main():
        router, stubs = _router(3)
        for a in ("a", "b", "c"):
            router.add_decode(a)
        stubs["a"].reports.put_nowait(_decode_load(900))
        stubs["b"].reports.put_nowait(_decode_load(2))  # too little room for the request below
        await asyncio.sleep(0.01)
        slot = await router.pick_decode([32] * 4, 16)
        assert slot.worker.address == "a" and slot.blocks == 4 * 3  # (32 + 16) / 16 blocks per layer
        slot.settle()
        # a goes silent: skipped once stale, dropped from the sampling set after DROP_S
        await asyncio.sleep(router_module.STALE_S + 0.1)
        stubs["c"].reports.put_nowait(_decode_load(500))
        await asyncio.sleep(0.01)
        slot = await router.pick_decode([32] * 4, 16)
        assert slot.worker.address == "c"
        await asyncio.sleep(router_module.DROP_S)
        stubs["c"].reports.put_nowait(_decode_load(500))
        await asyncio.sleep(0.01)
        await router.pick_decode([32] * 4, 16)
        assert router.decode["a"].index < 0 and not router.decode["a"].reachable
        assert [w.address for w in router.decode.live] == ["c"]
        # reservations count until released: c's room runs out and the next request waits, then is refused
        for _ in range(500 // 12 - 2):  # 41 picks of 12 blocks in all, 8 blocks left
            await router.pick_decode([32] * 4, 16)
        with pytest.raises(ResourceExhausted):
            await router.pick_decode([32] * 4, 16, wait_s=0.1, max_waiting=4)
        await router.close()

    vclock.run(main())


def test_a_pick_draws_a_bounded_number_of_workers():
    async def main():
        router, stubs = _router(1000)
        for i in range(1000):
            router.add_decode(f"w{i}")
            stubs[f"w{i}"].reports.put_nowait(_decode_load(100))
        await asyncio.sleep(0.01)
        seen = []
        fresh = router.decode.fresh
        router.decode.fresh = lambda w, now: seen.append(w) or fresh(w, now)
        for _ in range(50):
            await router.pick_decode([16] * 4, 16)
        assert len(seen) <= 50 * router_module.SAMPLE_K
        await router.close()

    vclock.run(main())


def test_image_cache_reports_steer_prefill_picks():
    async def main():
        router, stubs = _router(8, sample_k=2)
        for i in range(8):
            router.add_prefill(f"p{i}")
            stubs[f"p{i}"].reports.put_nowait(worker_pb2.WorkerLoad())
        added = worker_pb2.WorkerLoad(images_added=[worker_pb2.ImageDigest(image_hash="img", tenant="t")])
        stubs["p5"].reports.put_nowait(added)
        await asyncio.sleep(0.01)
        assert all(router.pick_prefill(images=("img",), tenant="t").address == "p5" for _ in range(20))
        evicted = worker_pb2.WorkerLoad(images_evicted=[worker_pb2.ImageDigest(image_hash="img", tenant="t")])
        stubs["p5"].reports.put_nowait(evicted)
        await asyncio.sleep(0.01)
        assert {router.pick_prefill(images=("img",), tenant="t").address for _ in range(40)} != {"p5"}
        await router.close()

    vclock.run(main())


def test_image_cache_change_log():
    cache = ImageCache(1 << 20)
    full = cache.changes_since(-1)
    assert full.full and full.added == []
    v = full.version
    assert cache.changes_since(v).added == [] and not cache.changes_since(v).full
    cache._note(True, "k1")  # what put and _drop record
    cache._note(True, "k2")
    cache._note(False, "k1")
    delta = cache.changes_since(v)
    assert delta.added == ["k2"] and delta.dropped == ["k1"] and not delta.full


def test_a_worker_lost_under_a_request_is_not_drawn_again_until_it_reports():
    """The gateway's one retry after a decode worker failed before the first token: the failed worker's last
    report is still fresh, but it leaves the draw (``note_lost``) until it reports again."""

    async def main():
        router, stubs = _router(2)
        for a in ("a", "b"):
            router.add_decode(a)
        stubs["a"].reports.put_nowait(_decode_load(900))  # the most room: picked first
        stubs["b"].reports.put_nowait(_decode_load(100))
        await asyncio.sleep(0.01)
        slot = await router.pick_decode([32] * 4, 16)
        assert slot.worker.address == "a"
        slot.settle()
        router.note_lost(slot.worker)
        for _ in range(3):
            again = await router.pick_decode([32] * 4, 16)
            assert again.worker.address == "b"
            again.settle()
        stubs["a"].reports.put_nowait(_decode_load(900))  # alive after all: back at its next report
        await asyncio.sleep(0.01)
        assert (await router.pick_decode([32] * 4, 16)).worker.address == "a"
        await router.close()

    vclock.run(main())
