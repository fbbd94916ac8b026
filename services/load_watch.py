"""Keeps every worker's last load report current on its board (the publisher side of the router).

Each worker pushes its load (``WatchLoad``: a report at once, on change and at least every second); its
stream is opened again after a break (``RETRY_S``, doubling up to ``RETRY_MAX_S``). A worker that answers
but streams no load (an older build) is polled every ``POLL_S`` instead, and also when drawn for a pick.
Workers added before an event loop runs are watched from the first pick (``start_pending``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc
from vlkv.services.load_board import LoadBoard, Worker
from vlkv.v1 import worker_pb2

log = logging.getLogger(__name__)
LOAD_TIMEOUT_S = 2.0
POLL_S = 0.25  # a worker without WatchLoad is polled this often
RETRY_S = 0.5  # a broken load stream is opened again after this (doubling up to RETRY_MAX_S)
RETRY_MAX_S = 5.0

OnReport = Callable[[LoadBoard, Worker, worker_pb2.WorkerLoad], None]


class LoadWatch:
    def __init__(self, on_report: OnReport) -> None:
        """``on_report(board, worker, load)`` takes each report in."""
        self.on_report = on_report
        self._pending: list[tuple[Worker, LoadBoard]] = []

    def start(self, w: Worker, board: LoadBoard) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._pending.append((w, board))
            return
        w.watcher = loop.create_task(self._watch(w, board))

    def start_pending(self) -> None:
        while self._pending:
            w, board = self._pending.pop()
            if board.holds(w):
                self.start(w, board)

    async def poll(self, w: Worker, board: LoadBoard) -> worker_pb2.WorkerLoad | None:
        """Ask ``w`` its load now (``GetLoad``); None if it does not answer (then it is lost)."""
        try:
            load = await w.stub.GetLoad(worker_pb2.LoadRequest(), timeout=LOAD_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            log.warning("worker %s did not answer GetLoad: %s", w.address, exc.code().name)
            board.lost(w)
            return None
        self.on_report(board, w, load)
        return load

    async def poll_all(self, workers: list[tuple[Worker, LoadBoard]]) -> list[worker_pb2.WorkerLoad | None]:
        return await asyncio.gather(*(self.poll(w, board) for w, board in workers))

    async def _watch(self, w: Worker, board: LoadBoard) -> None:
        delay = RETRY_S
        while board.holds(w):
            reports = 0
            try:
                async for load in w.stub.WatchLoad(worker_pb2.LoadRequest()):
                    self.on_report(board, w, load)
                    reports += 1
                    delay = RETRY_S
            except grpc.aio.AioRpcError as exc:
                log.debug("load stream of %s broke: %s", w.address, exc.code().name)
                if not reports and await self.poll(w, board) is not None:  # it answers, but streams no load
                    w.polled = True
                    await self._poll_forever(w, board)
                    return
            board.lost(w)
            await asyncio.sleep(delay)
            delay = min(delay * 2, RETRY_MAX_S)

    async def _poll_forever(self, w: Worker, board: LoadBoard) -> None:
        while board.holds(w):
            await self.poll(w, board)
            await asyncio.sleep(POLL_S)
