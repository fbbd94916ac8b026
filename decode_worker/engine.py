"""Continuous-batching decode loop: the ``DecodeCore`` (``core.py``) in the worker's asyncio event loop.

``schedule -> forward -> postprocess``: the core plans each step (``scheduler.py``: preempted and waiting
sequences join the running batch, the newest preempted to host memory when the pool is short), the model
step runs in a worker thread so the event loop keeps serving gRPC while it computes, and the core samples
the batch, applies the stop rules and frees the blocks of every sequence that ended. This loop only
streams what the core produced: each sequence's ``Delta``s into its output queue, then ``None`` once it
finished (its ``status``, ``error`` and ``usage`` say how).

Lifecycle: ``start()`` on the server's loop; ``submit(seq)`` once a sequence's cache is in the pool and a
``Decode`` call claims it (its prefill token is streamed at once); ``cancel(seq)`` when the client goes;
``notify()`` when blocks were freed outside the loop; ``stop()`` ends every sequence and the loop.

Faults: a failed model step fails its batch; a sequence whose token cannot be sampled (non-finite logits)
or streamed fails alone (the core decides). Should the loop itself ever die, every sequence ends with
UNAVAILABLE and ``on_death`` is called (the worker turns NOT_SERVING and exits: a dead loop must not look
like a worker).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import grpc
from vlkv.common.errors import VlkvError
from vlkv.decode_worker.block_manager import BlockManager
from vlkv.decode_worker.core import DecodeCore, Delta
from vlkv.decode_worker.scheduler import Scheduler
from vlkv.decode_worker.sequence import FinishReason, Sequence

log = logging.getLogger(__name__)
Output = asyncio.Queue  # of Delta, then None once the sequence finished


class DecodeEngine:
    def __init__(self, core: DecodeCore, on_death: Callable[[BaseException], None] | None = None) -> None:
        """``core``: the synchronous scheduler + model step + stop rules this loop drives;
        ``on_death(exc)``: called on the loop if the loop task ever ends with an exception."""
        self.core = core
        self.on_death = on_death
        self.dead: BaseException | None = None  # why the loop died, once it has
        self._wake = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vlkv-decode")
        self._task: asyncio.Task | None = None
        self._outputs: dict[Sequence, Output] = {}

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())
        self._task.add_done_callback(self._loop_ended)

    async def stop(self) -> None:
        if self._task is not None and not self._task.done():  # a dead loop's exception was logged
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        self._close_all(self.core.abort_all(VlkvError("decode worker shutting down")))
        self._executor.shutdown(wait=True)

    @property
    def blocks(self) -> BlockManager:
        return self.core.blocks

    @property
    def scheduler(self) -> Scheduler[Sequence]:
        return self.core.scheduler

    @property
    def preemptions(self) -> int:
        return self.scheduler.preemptions

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_swapped(self) -> int:
        return len(self.scheduler.swapped)

    @property
    def swap_used(self) -> int:
        """Host bytes held by preempted sequences."""
        return self.scheduler.swap_used

    def submit(self, seq: Sequence) -> Output:
        """Start a sequence whose cache is in the pool; returns its output queue (the prefill's token
        first)."""
        out: Output = asyncio.Queue()
        self._outputs[seq] = out
        if self.dead is not None:
            self.core.end(seq, FinishReason.ERROR, self.dead_error())
        else:
            self._push(self.core.add(seq))
            self._wake.set()
        if seq.finished:
            self._close(seq)
        return out

    async def run_model(self, fn, *args):
        """``fn(*args)`` in the model's thread (between the loop's steps: one model call at a time)."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def notify(self) -> None:
        """Blocks were freed outside the loop: let preempted sequences try to resume."""
        self._wake.set()

    def cancel(self, seq: Sequence) -> None:
        """Drop a sequence (client gone); its blocks are freed now or right after the step using them."""
        self._outputs.pop(seq, None)
        self.core.end(seq, FinishReason.CANCELLED)

    def _push(self, delta: Delta) -> None:
        out = self._outputs.get(delta.seq)
        if out is not None and (delta.token_ids or delta.text):
            out.put_nowait(delta)

    def _close(self, seq: Sequence) -> None:
        out = self._outputs.pop(seq, None)
        if out is not None:
            out.put_nowait(None)

    def _close_all(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            self._close(seq)

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            plan = self.core.schedule()
            self._close_all(plan.failed)
            if not plan.running:
                self._wake.clear()
                try:  # preempted sequences wait for blocks freed outside the loop (a lease, a refusal)
                    await asyncio.wait_for(self._wake.wait(), 0.05 if self.num_swapped else None)
                except asyncio.TimeoutError:
                    pass
                continue
            batch = plan.running
            try:
                logits = await loop.run_in_executor(self._executor, self.core.forward, batch)
            except Exception as exc:  # a failed step fails its batch, not the worker
                log.exception("decode step failed")
                self.core.fail(batch, VlkvError(f"decode step failed: {exc}"))
                self._close_all(batch)
                continue
            result = self.core.postprocess(batch, logits)
            for delta in result.deltas:
                self._push(delta)
            self._close_all(result.finished)
            await asyncio.sleep(0)

    def _loop_ended(self, task: asyncio.Task) -> None:
        """The loop task's done callback: anything but a cancellation (``stop``) is the engine's death.

        Every sequence still here ends with UNAVAILABLE at once (clients do not wait for their deadline),
        later ``submit`` calls fail the same way, and ``on_death`` (the worker: NOT_SERVING, then exit so
        Ray and the autoscaler replace it) is told why."""
        if task.cancelled():
            return
        exc = task.exception() or RuntimeError("the decode loop returned")
        self.dead = exc
        log.critical("decode engine loop died: %r", exc, exc_info=exc)
        try:
            self.core.abort_all(self.dead_error())
        except Exception:  # noqa: BLE001 - the pool may be what broke; the process exits anyway
            log.exception("releasing the sequences after the engine died failed")
        for seq in list(self._outputs):
            seq.finish(FinishReason.ERROR, self.dead_error())
            self._close(seq)
        if self.on_death is not None:
            self.on_death(exc)

    def dead_error(self) -> VlkvError:
        return VlkvError(
            f"the decode engine stopped ({self.dead!r}); this worker is shutting down, retry",
            grpc.StatusCode.UNAVAILABLE,
        )
