"""The synchronous decode core: schedule -> model step -> sample, with no asyncio and no gRPC.

``DecodeEngine`` (``engine.py``) wraps it in the worker's event loop; an in-process engine can drive it
directly::

    blocks = BlockManager(cache.num_blocks, cache.block_size)
    core = DecodeCore(ModelRunner(model, cache), blocks, cache, max_batch=64, swap_bytes=1 << 30)
    for ckv in caches:                                   # CompactKV: keys[l], values[l] [H_kv, k_l, D]
        seq_blocks = blocks.allocate(ckv.layer_lengths, 0)
        for layer, table in enumerate(seq_blocks.tables):
            cache.write(table, ckv.keys[layer], ckv.values[layer])
        core.add(DecodeSequence(rid, seq_blocks, list(ckv.layer_lengths), ckv.prompt_length,
                                ckv.first_token, SamplingConfig(max_new_tokens=...)))
    while core.has_work:
        out = core.step()                                # StepResult
        for seq, token in out.tokens:                    # token already appended to seq.generated
            if token in eos or len(seq.generated) >= seq.sampling.max_new_tokens:
                core.release(seq)                        # leaves the batch, frees its blocks
        # out.failed: preempted with no swap space left; out.errors: (sequence, VlkvError) whose token
        # could not be sampled (non-finite logits); both have left the core already

A sequence's ``generated`` starts as ``[first_token]`` (the prefill's token); each step feeds
``generated[-1]`` at position ``prompt_length + len(generated) - 1`` and appends the sampled token. The
core never decides that a sequence is finished: its caller does (EOS, length, stop strings) and calls
``release``. The core executes the scheduler's plan: preempted sequences' K/V go to ``swap_device``
(``host_kv``) and come back into their new blocks on resume, bit for bit.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import grpc
import torch
from vlkv.common.errors import VlkvError
from vlkv.common.sampling import SamplingConfig, make_generator, sample_token
from vlkv.decode_worker.block_manager import BlockManager, SequenceBlocks
from vlkv.decode_worker.kv_cache import KVCache
from vlkv.decode_worker.model_runner import ModelRunner, StepInput
from vlkv.decode_worker.scheduler import SchedulePlan, Scheduler

log = logging.getLogger(__name__)


@dataclass(eq=False)
class DecodeSequence:
    """One sequence in the core: its blocks, per layer cached lengths and the tokens so far."""

    request_id: str
    blocks: SequenceBlocks
    lengths: list[int]  # per layer cached tokens
    prompt_length: int  # m: the first decode position
    first_token: int
    sampling: SamplingConfig
    generated: list[int] = field(init=False)  # [first_token, sampled tokens...]
    cancelled: bool = field(default=False, init=False)
    arrival: int = field(default=0, init=False)  # set by the scheduler
    host_kv: list[tuple[torch.Tensor, torch.Tensor]] | None = field(default=None, init=False)  # swapped out

    def __post_init__(self) -> None:
        self.generated = [self.first_token]
        self.generator = None if self.sampling.greedy else make_generator(self.sampling.seed + 1)


@dataclass
class StepResult:
    tokens: list[tuple[DecodeSequence, int]] = field(default_factory=list)  # one per stepped sequence
    failed: list[DecodeSequence] = field(default_factory=list)  # preempted, no swap space: gone
    # sequences whose token could not be sampled (non-finite logits, a sampling error): gone, with why
    errors: list[tuple[DecodeSequence, VlkvError]] = field(default_factory=list)


class DecodeCore:
    """``add`` sequences, ``step()`` until ``has_work`` is False, ``release`` the finished ones.

    The asyncio engine calls the three parts of ``step`` itself: ``schedule`` and ``postprocess`` on its
    loop, ``forward`` (the model) in a worker thread.
    """

    def __init__(
        self,
        runner: ModelRunner | None,
        blocks: BlockManager,
        cache: KVCache,
        max_batch: int,
        swap_bytes: int = 0,
        swap_device: str | torch.device = "cpu",
    ) -> None:
        self.runner = runner
        self.blocks = blocks
        self.cache = cache
        self.swap_device = swap_device
        self.scheduler: Scheduler[DecodeSequence] = Scheduler(
            blocks, max_batch, swap_bytes, cache.token_bytes
        )

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def add(self, seq: DecodeSequence) -> None:
        """Queue a sequence whose cache is written into its blocks."""
        self.scheduler.add(seq)

    def release(self, seq: DecodeSequence) -> None:
        """Take a sequence out (finished, cancelled, failed) and free its blocks and host copy."""
        self.scheduler.finish(seq)
        seq.host_kv = None

    def schedule(self) -> SchedulePlan[DecodeSequence]:
        """Plan the next step and move the K/V it names: resumed into the pool, preempted out of it."""
        plan = self.scheduler.schedule()
        for seq, tables in plan.swapped_in:
            for table, (k, v) in zip(tables, seq.host_kv, strict=True):
                self.cache.write(table, k.to(self.cache.device), v.to(self.cache.device))
            seq.host_kv = None
        for seq, tables in plan.swapped_out:
            log.info("request %s: preempted (%d blocks swapped out)", seq.request_id, sum(map(len, tables)))
            kv = [self.cache.read(t, n) for t, n in zip(tables, seq.lengths, strict=True)]
            seq.host_kv = [
                (k.to(self.swap_device, copy=True), v.to(self.swap_device, copy=True)) for k, v in kv
            ]
        for seq in plan.failed:
            log.warning("request %s: preempted with no swap space left; failing it", seq.request_id)
            seq.host_kv = None
        return plan

    def forward(self, batch: list[DecodeSequence]) -> torch.Tensor:
        """One model step: next-token logits ``[len(batch), vocab]`` fp32 (thread-safe w.r.t. the loop)."""
        inputs = [
            StepInput(s.generated[-1], s.prompt_length + len(s.generated) - 1, s.blocks.tables, s.lengths)
            for s in batch
        ]
        return self.runner.step(inputs)

    def postprocess(self, batch: list[DecodeSequence], logits: torch.Tensor) -> StepResult:
        """Grow every stepped sequence by its token; sample for all but the cancelled, which leave now.

        A sequence whose token cannot be sampled (its logits are NaN or inf, or sampling raised) leaves
        too, in ``errors`` with the reason; the rest of the batch goes on."""
        out = StepResult()
        for i, s in enumerate(batch):
            s.lengths = [n + 1 for n in s.lengths]
            if s.cancelled:
                self.release(s)
                continue
            try:
                token = sample_token(logits[i], s.sampling, s.generator)
            except Exception as exc:  # noqa: BLE001 - one sequence's fault fails that sequence alone
                out.errors.append((s, _sampling_error(s, exc)))
                self.release(s)
                continue
            s.generated.append(token)
            out.tokens.append((s, token))
        return out

    def step(self) -> StepResult:
        """schedule -> forward -> postprocess. Empty while ``has_work`` only when a preempted sequence waits
        for blocks held outside the core (caches allocated but not yet added)."""
        plan = self.schedule()
        result = StepResult(failed=plan.failed)
        if plan.running:
            result = self.postprocess(plan.running, self.forward(plan.running))
            result.failed = plan.failed
        return result


def _sampling_error(seq: DecodeSequence, exc: Exception) -> VlkvError:
    """Why ``seq`` got no token, as the status its request ends with (INTERNAL unless the error says)."""
    step = len(seq.generated)
    if isinstance(exc, VlkvError):
        log.warning("request %s: no token at step %d: %s", seq.request_id, step, exc)
        return VlkvError(f"decoding failed at token {step}: {exc.message}", exc.code)
    log.exception("request %s: sampling failed at step %d", seq.request_id, step, exc_info=exc)
    return VlkvError(f"decoding failed at token {step}: sampling raised {exc!r}", grpc.StatusCode.INTERNAL)
