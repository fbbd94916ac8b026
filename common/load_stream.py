"""A worker's pushed load (``WatchLoad``): a report at once, then one whenever the load changes and at least
every ``REPORT_EVERY_S``, to each gateway that watches.

The worker compares a fresh snapshot with the last report it sent every ``CHECK_EVERY_S`` (a snapshot is a
few counters, so this costs the worker almost nothing and needs no hook in the code that changes them), so
a change reaches the gateways within that period; a gateway's own reservations cover the time between.
``LoadStream.close`` ends every stream (a stopping server would otherwise wait its grace period on them).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from vlkv.v1 import worker_pb2

REPORT_EVERY_S = 1.0  # a report at least this often, changed or not: the gateway's sign of life
CHECK_EVERY_S = 0.02  # how often the load is compared with the last report sent


class LoadStream:
    def __init__(self, check_s: float = CHECK_EVERY_S, every_s: float = REPORT_EVERY_S) -> None:
        self.check_s = check_s
        self.every_s = every_s
        self.closed = False
        self.watchers = 0  # streams open now

    def close(self) -> None:
        self.closed = True

    async def watch(
        self,
        snapshot: Callable[[], worker_pb2.WorkerLoad],
        changes: Callable[[worker_pb2.WorkerLoad], bool] | None = None,
    ) -> AsyncIterator[worker_pb2.WorkerLoad]:
        """Reports of ``snapshot()``; ``changes(report)``, when given, adds to the report what changed since
        this stream's previous report and returns True if anything did (then the report is sent)."""
        loop = asyncio.get_running_loop()
        last, sent_at = None, -self.every_s
        self.watchers += 1
        try:
            while not self.closed:
                load = snapshot()
                now = loop.time()
                due = load != last or now - sent_at >= self.every_s
                report = load
                if changes is not None:
                    report = worker_pb2.WorkerLoad()
                    report.CopyFrom(load)
                    due = changes(report) or due
                if due:
                    yield report
                    last, sent_at = load, now
                await asyncio.sleep(self.check_s)
        finally:
            self.watchers -= 1
