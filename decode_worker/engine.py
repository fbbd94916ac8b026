"""Continuous-batching decode loop.

``schedule -> runner.step -> postprocess``: before each step, waiting sequences join the running batch
(first come, first served, up to ``max_batch``), so none starves; after it, every sequence samples its
token, streams it, and finished or cancelled sequences leave and free their blocks at once. The model step
runs in a worker thread so the event loop keeps serving gRPC while it computes.

Preemption (admission "grow", ``PoolConfig.admission``): a cache arrives with blocks for its tokens only,
and before each step every running sequence takes a block in each layer whose last block is full. When
the pool is short, the newest running sequence is preempted: its cached K/V is copied to host memory
(bounded by ``swap_bytes``) and its blocks freed. Preempted sequences resume, oldest first, before any
waiting sequence joins, and continue bit for bit where they stopped (the same K/V, the same positions). A
preempted sequence that does not fit in the swap space fails with RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import logging
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import torch
from vlkv.common.errors import VlkvError
from vlkv.common.sampling import SamplingConfig, make_generator, sample_token
from vlkv.decode_worker.detokenizer import IncrementalText
from vlkv.decode_worker.kv_pool import KVPool, SequenceBlocks
from vlkv.decode_worker.model_runner import ModelRunner, StepInput
from vlkv.v1 import generate_pb2

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Sequence:
    """One request on the decode worker, from cache arrival to its last token."""

    request_id: str
    blocks: SequenceBlocks
    lengths: list[int]  # per layer cached tokens
    prompt_length: int  # m: the first decode position
    first_token: int
    sampling: SamplingConfig
    eos_token_ids: set[int]
    usage: generate_pb2.Usage
    detok: IncrementalText
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    generated: list[int] = field(default_factory=list)
    done: bool = False
    cancelled: bool = False
    arrival: int = 0  # admission order: preemption takes the newest, resumption the oldest
    swapped: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # per layer K, V while preempted

    def __post_init__(self) -> None:
        self.generator = None if self.sampling.greedy else make_generator(self.sampling.seed + 1)

    @property
    def swapped_bytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.swapped or ())


class DecodeEngine:
    def __init__(
        self, runner: ModelRunner | None, pool: KVPool, max_batch: int, swap_bytes: int = 0, swap_device="cpu"
    ) -> None:
        self.runner = runner
        self.swap_device = swap_device
        self.pool = pool
        self.max_batch = max_batch
        self.swap_bytes = swap_bytes
        self.preemptions = 0
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []  # preempted, in arrival order
        self._arrivals = itertools.count()
        self._wake = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vlkv-decode")
        self._task: asyncio.Task | None = None
        self._stepping: set[Sequence] = set()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        for seq in list(self.running) + list(self.waiting) + list(self.swapped):
            self._finish(seq, error=VlkvError("decode worker shutting down"))
        self._executor.shutdown(wait=True)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_swapped(self) -> int:
        return len(self.swapped)

    @property
    def swap_used(self) -> int:
        """Host bytes held by preempted sequences."""
        return sum(s.swapped_bytes for s in self.swapped)

    def submit(self, seq: Sequence) -> None:
        """Start a sequence whose cache is in the pool: stream the prefill's token, then queue it."""
        seq.arrival = next(self._arrivals)
        self._emit_token(seq, seq.first_token)
        if seq.done:
            self._release(seq)
        else:
            self.waiting.append(seq)
            self._wake.set()

    def notify(self) -> None:
        """Blocks were freed outside the loop: let preempted sequences try to resume."""
        self._wake.set()

    def cancel(self, seq: Sequence) -> None:
        """Drop a sequence (client gone); its blocks are freed now or right after the step using them."""
        seq.cancelled = True
        if seq in self._stepping:
            return  # the loop frees it when the step returns
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.running:
            self.running.remove(seq)
        self._release(seq)

    def _release(self, seq: Sequence) -> None:
        if seq.blocks.num_blocks:
            self.pool.free(seq.blocks)
        if seq in self.swapped:
            self.swapped.remove(seq)
            seq.swapped = None

    # -- preemption --------------------------------------------------------------------------------
    def _preempt(self, seq: Sequence) -> None:
        """Take a running sequence off the pool: swap its K/V to host memory, or fail it if none is left."""
        self.running.remove(seq)
        self.preemptions += 1
        kv = [self.pool.read(t, n) for t, n in zip(seq.blocks.tables, seq.lengths, strict=True)]
        nbytes = sum(k.nbytes + v.nbytes for k, v in kv)
        if self.swap_used + nbytes > self.swap_bytes:
            log.warning("request %s: preempted with no swap space left; failing it", seq.request_id)
            self._finish(
                seq,
                error=VlkvError(
                    "the decode worker ran out of KV memory and swap space; retry",
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                ),
            )
            self._release(seq)
            return
        log.info("request %s: preempted (%d blocks swapped out)", seq.request_id, seq.blocks.num_blocks)
        self.pool.free(seq.blocks)
        seq.swapped = [(k.to(self.swap_device, copy=True), v.to(self.swap_device, copy=True)) for k, v in kv]
        bisect.insort(self.swapped, seq, key=lambda s: s.arrival)

    def _resume(self) -> None:
        """Bring preempted sequences back, oldest first, while they fit with room for their next token."""
        while self.swapped and len(self.running) < self.max_batch:
            seq = self.swapped[0]
            blocks = self.pool.allocate(seq.lengths, 1)
            if blocks is None:
                return
            for table, (k, v) in zip(blocks.tables, seq.swapped, strict=True):
                self.pool.write(table, k.to(self.pool.k.device), v.to(self.pool.v.device))
            self.swapped.pop(0)
            seq.swapped = None
            seq.blocks = blocks
            self.running.append(seq)

    def _make_room(self) -> None:
        """Give every running sequence room for this step's token, preempting the newest when short."""
        for seq in sorted(self.running, key=lambda s: s.arrival):
            while seq in self.running and not self.pool.append(seq.blocks, seq.lengths):
                self._preempt(max(self.running, key=lambda s: s.arrival))

    def schedule(self) -> None:
        self._resume()
        if not self.swapped or not self.running:  # preempted sequences go first; never stall on them
            while len(self.running) < self.max_batch and self.waiting:
                self.running.append(self.waiting.popleft())
        self._make_room()

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
        seq.generated.append(token)
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
            self.schedule()
            if not self.running:
                self._wake.clear()
                try:  # preempted sequences wait for blocks freed outside the loop (a lease, a refusal)
                    await asyncio.wait_for(self._wake.wait(), 0.05 if self.swapped else None)
                except asyncio.TimeoutError:
                    pass
                continue
            batch = list(self.running)
            inputs = [
                StepInput(s.generated[-1], s.prompt_length + len(s.generated) - 1, s.blocks.tables, s.lengths)
                for s in batch
            ]
            self._stepping = set(batch)
            try:
                logits = await loop.run_in_executor(self._executor, self.runner.step, inputs)
            except Exception as exc:  # a failed step fails its batch, not the worker
                log.exception("decode step failed")
                for s in batch:
                    self.running.remove(s)
                    self._finish(s, error=VlkvError(f"decode step failed: {exc}"))
                    self._release(s)
                continue
            finally:
                self._stepping = set()
            for i, s in enumerate(batch):
                s.lengths = [n + 1 for n in s.lengths]
                if not s.cancelled:
                    self._emit_token(s, sample_token(logits[i], s.sampling, s.generator))
                if s.done or s.cancelled:
                    self.running.remove(s)
                    self._release(s)
            await asyncio.sleep(0)
