"""The simulated machine's CPU when every worker shares it (a one-box deployment, ``Profile.shared_cores``).

Processor sharing as the kernel does it with autogroups (``box_load.py``): each core's run queue is shared
between the sessions with work on it, so beside ``background`` busy sessions spread over the cores our
session gets ``cores / (cores + background)`` of each core it runs on, and its ``n`` concurrent pieces of
work (a prefill, a decode step, a hand-off, the gateway's validation, a request's other CPU) spread over
``min(n, cores)`` cores. Each piece is its duration as ``vlkv profile`` measured it alone, so it advances
at ``min(1, cores / n)`` of that speed (times the ratio of our share now to our share when profiled):
work alone takes its profiled time, and concurrent prefill, decode and validation slow each other as they
do on the real box. The box's other load may
change while the simulation runs (``set_background``: a validation replays the load recorded beside the
real run, ``box_load.py``); the profiled times stay those measured under the profile's background.
Without a shared CPU (a worker per device) work simply takes its time (``Dedicated``).
"""

from __future__ import annotations

import asyncio


class Dedicated:
    """Each worker on its own device: work takes its profiled time, whatever else runs."""

    async def run(self, work_s: float) -> None:
        if work_s > 0:
            await asyncio.sleep(work_s)


class SharedCPU:
    def __init__(self, cores: float, background: float = 0.0) -> None:
        if cores <= 0:
            raise ValueError("a shared CPU needs cores > 0")
        self.cores, self.background = cores, max(background, 0.0)
        self._alone = self._share(self.background)  # a job alone, as profiled
        self._jobs: dict[asyncio.Future, float] = {}  # job -> work left (seconds at its speed alone)
        self._last = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self.busy_s = 0.0  # time with work running, for reports

    def set_background(self, background: float) -> None:
        """Other work on the box changed (from now on)."""
        loop = asyncio.get_running_loop()
        self._advance(loop.time())
        self.background = max(background, 0.0)
        self._schedule(loop)

    def speed(self, n: int) -> float:
        """Progress per second of each of ``n`` concurrent jobs, in seconds of work measured alone."""
        return min(1.0, self.cores / n) * self._share(self.background) / self._alone if n else 1.0

    def _share(self, background: float) -> float:
        """Of a core, what our session gets where it runs beside ``background`` busy sessions spread over
        the cores (the kernel shares each core's run queue between the sessions on it)."""
        return self.cores / (self.cores + background) if self.cores >= 1 else self.cores

    async def run(self, work_s: float) -> None:
        if work_s <= 0:
            return
        loop = asyncio.get_running_loop()
        self._advance(loop.time())
        job = loop.create_future()
        self._jobs[job] = work_s
        self._schedule(loop)
        try:
            await job
        finally:
            if self._jobs.pop(job, None) is not None:  # cancelled: the others speed up
                self._advance(loop.time())
                self._schedule(loop)

    def _advance(self, now: float) -> None:
        elapsed, self._last = now - self._last, now
        if self._jobs and elapsed > 0:
            self.busy_s += elapsed
            done = elapsed * self.speed(len(self._jobs))
            for job in self._jobs:
                self._jobs[job] -= done

    def _schedule(self, loop) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._jobs:
            left = min(self._jobs.values())
            self._timer = loop.call_later(max(left, 0.0) / self.speed(len(self._jobs)), self._tick, loop)

    def _tick(self, loop) -> None:
        self._timer = None
        self._advance(loop.time())
        for job, left in list(self._jobs.items()):
            if left <= 1e-9:
                del self._jobs[job]
                if not job.done():
                    job.set_result(None)
        self._schedule(loop)


def machine_cpu(shared_cores: float, background: float) -> Dedicated | SharedCPU:
    return SharedCPU(shared_cores, background) if shared_cores > 0 else Dedicated()
