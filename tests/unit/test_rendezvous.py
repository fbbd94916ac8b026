"""``Rendezvous``: a cache and its Decode call meet in either order; nothing is held for nobody."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import grpc
import pytest
from vlkv.common.errors import VlkvError
from vlkv.decode_worker.rendezvous import Rendezvous


@dataclass(eq=False)
class Seq:
    request_id: str


class Transfer:
    abandoned = False

    def abandon(self) -> None:
        self.abandoned = True


def make(freed: list, **kw) -> Rendezvous:
    args = dict(claim_wait_s=1.0, unclaimed_lease_s=0.05, max_unclaimed_per_sender=2) | kw
    return Rendezvous(freed.append, **args)


def test_either_order_and_unclaimed_lease():
    async def go():
        freed: list = []
        r = make(freed)
        a = Seq("a")
        assert r.deliver(a, "s")  # cache first
        assert await r.claim("a") is a
        claim = asyncio.ensure_future(r.claim("b"))  # call first
        await asyncio.sleep(0)
        b = Seq("b")
        assert r.deliver(b, "s") and await claim is b
        c = Seq("c")
        r.deliver(c, "s")
        await asyncio.sleep(0.1)
        assert freed == [c] and r.num_unclaimed == 0

    asyncio.run(go())


def test_abandoned_request_is_freed_at_once_whichever_comes_first():
    async def go():
        freed: list = []
        r = make(freed)
        t = Transfer()
        r.begin_transfer("x", t)
        r.abandon("x")  # the call went while the cache was on the wire
        assert t.abandoned
        x = Seq("x")
        assert not r.deliver(x, "s") and freed == [x]
        with pytest.raises(VlkvError) as err:
            r.check_new("x")  # a later transfer of it is refused before taking blocks
        assert err.value.code == grpc.StatusCode.CANCELLED
        with pytest.raises(VlkvError):
            await r.claim("y", 0.01)  # timed out: the caller abandons it
        r.abandon("y")
        assert not r.deliver(Seq("y"), "s") and len(freed) == 2

    asyncio.run(go())


def test_per_sender_limit_and_supersede():
    async def go():
        freed: list = []
        r = make(freed, unclaimed_lease_s=30)
        r.deliver(Seq("p1"), "host-a")
        r.deliver(Seq("p2"), "host-a")
        assert not r.may_park("p3", "host-a") and r.may_park("p3", "host-b")
        asyncio.ensure_future(r.claim("p3"))
        await asyncio.sleep(0)
        assert r.may_park("p3", "host-a")  # its caller waits: always welcome
        first, second = Transfer(), Transfer()
        r.begin_transfer("q", first)
        r.begin_transfer("q", second)
        assert r.superseded(first) and not r.superseded(second)
        r.end_transfer("q", first)
        r.end_transfer("q", second)
        assert r.num_transfers == 0
        r.expire_all()
        r.fail_waiters(VlkvError("bye"))
        assert len(freed) == 2

    asyncio.run(go())
