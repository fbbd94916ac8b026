"""Continuous-batching decode loop: the ``DecodeCore`` (``core.py``) in the worker's asyncio event loop.

``schedule -> forward -> postprocess``: before each step the scheduler (``scheduler.py``) lets preempted
and waiting sequences join the running batch and gives each room for its token, preempting the newest
to host memory when the pool is short; the model step runs in a worker thread so the event loop keeps
serving gRPC while it computes; after it every sequence's token is streamed as an event (text through
the incremental detokenizer), and finished (EOS, stop string, length), cancelled or failed sequences
leave and free their blocks at once.

Lifecycle: ``start()`` on the server's loop; ``submit(seq)`` once a sequence's cache is in the pool and a
``Decode`` call claims it (its prefill token is streamed at once); ``cancel(seq)`` when the client goes;
``notify()`` when blocks were freed outside the loop; ``stop()`` ends every sequence and the loop.

Faults: a failed model step fails its batch; a sequence whose token cannot be sampled (non-finite logits)
or streamed fails alone. Should the loop itself ever die, every sequence ends with UNAVAILABLE and
``on_death`` is called (the worker turns NOT_SERVING and exits: a dead loop must not look like a worker).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
from vlkv.common.errors import VlkvError
from vlkv.decode_worker.block_manager import BlockManager
from vlkv.decode_worker.core import DecodeCore, DecodeSequence
from vlkv.decode_worker.detokenizer import IncrementalText
from vlkv.decode_worker.scheduler import Scheduler
from vlkv.v1 import generate_pb2

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Sequence(DecodeSequence):
    """One request on the decode worker, from cache arrival to its last token.

    ``events`` carries ``("token", ids, text)``, then ``("finished", reason)`` or ``("error", VlkvError)``.
    """

    eos_token_ids: set[int]
    usage: generate_pb2.Usage
    detok: IncrementalText
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    done: bool = False


class DecodeEngine:
    def __init__(self, core: DecodeCore, on_death: Callable[[BaseException], None] | None = None) -> None:
        """``core``: the synchronous scheduler + model step this loop drives (``DecodeCore``);
        ``on_death(exc)``: called on the loop if the loop task ever ends with an exception."""
        self.core = core
        self.on_death = on_death
        self.dead: BaseException | None = None  # why the loop died, once it has
        self._wake = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vlkv-decode")
        self._task: asyncio.Task | None = None
        self._stepping: set[Sequence] = set()

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
        s = self.scheduler
        for seq in list(s.running) + list(s.waiting) + list(s.swapped):
            self._finish(seq, error=VlkvError("decode worker shutting down"))
        self._executor.shutdown(wait=True)

    @property
    def blocks(self) -> BlockManager:
        return self.core.blocks

    @property
    def scheduler(self) -> Scheduler[DecodeSequence]:
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

    def submit(self, seq: Sequence) -> None:
        """Start a sequence whose cache is in the pool: stream the prefill's token, then queue it."""
        if self.dead is not None:
            self._finish(seq, error=self.dead_error())
            self.core.release(seq)
            return
        self._emit_token(seq, seq.first_token)
        if seq.done:
            self.core.release(seq)
        else:
            self.core.add(seq)
            self._wake.set()

    def notify(self) -> None:
        """Blocks were freed outside the loop: let preempted sequences try to resume."""
        self._wake.set()

    def cancel(self, seq: Sequence) -> None:
        """Drop a sequence (client gone); its blocks are freed now or right after the step using them."""
        seq.cancelled = True
        if seq in self._stepping:
            return  # the loop frees it when the step returns
        self.core.release(seq)

    def _finish(self, seq: Sequence, reason: int = 0, error: VlkvError | None = None) -> None:
        if seq.done:
            return
        seq.done = True
        if error is not None:
            seq.events.put_nowait(("error", error))
        else:
            tail = seq.detok.flush()
            if tail:
                seq.events.put_nowait(("token", [], tail))
            seq.usage.generated_tokens = len(seq.generated)
            seq.events.put_nowait(("finished", reason))

    def _emit_token(self, seq: Sequence, token: int) -> None:
        """Stream ``token`` (already the last of ``seq.generated``) and finish the sequence if it ends it."""
        if token in seq.eos_token_ids:
            self._finish(seq, generate_pb2.FINISH_REASON_EOS)
            return
        text = seq.detok.add(token)
        seq.events.put_nowait(("token", [token], text))
        if seq.detok.stopped:
            self._finish(seq, generate_pb2.FINISH_REASON_STOP_STRING)
        elif len(seq.generated) >= seq.sampling.max_new_tokens:
            self._finish(seq, generate_pb2.FINISH_REASON_LENGTH)

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            plan = self.core.schedule()
            for seq in plan.failed:
                self._finish(
                    seq,
                    error=VlkvError(
                        "the decode worker ran out of KV memory and swap space; retry",
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                    ),
                )
            if not plan.running:
                self._wake.clear()
                try:  # preempted sequences wait for blocks freed outside the loop (a lease, a refusal)
                    await asyncio.wait_for(self._wake.wait(), 0.05 if self.num_swapped else None)
                except asyncio.TimeoutError:
                    pass
                continue
            batch = plan.running
            self._stepping = set(batch)
            try:
                logits = await loop.run_in_executor(self._executor, self.core.forward, batch)
            except Exception as exc:  # a failed step fails its batch, not the worker
                log.exception("decode step failed")
                for s in batch:
                    self._finish(s, error=VlkvError(f"decode step failed: {exc}"))
                    self.core.release(s)
                continue
            finally:
                self._stepping = set()
            result = self.core.postprocess(batch, logits)
            for seq, error in result.errors:  # one sequence's fault: it alone ends (already released)
                self._finish(seq, error=error)
            for seq, token in result.tokens:
                try:
                    self._emit_token(seq, token)
                except Exception as exc:  # noqa: BLE001 - e.g. the detokenizer: this sequence alone fails
                    log.exception("request %s: streaming token %d failed", seq.request_id, token)
                    self._finish(seq, error=VlkvError(f"decoding failed: {exc!r}", grpc.StatusCode.INTERNAL))
                if seq.done:
                    self.core.release(seq)
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
        s = self.scheduler
        for seq in list(s.running) + list(s.waiting) + list(s.swapped):
            self._finish(seq, error=self.dead_error())
            try:
                self.core.release(seq)
            except Exception:  # noqa: BLE001 - the pool may be what broke; the process exits anyway
                log.exception("request %s: releasing after the engine died failed", seq.request_id)
        if self.on_death is not None:
            self.on_death(exc)

    def dead_error(self) -> VlkvError:
        return VlkvError(
            f"the decode engine stopped ({self.dead!r}); this worker is shutting down, retry",
            grpc.StatusCode.UNAVAILABLE,
        )
