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

Decode-phase re-compression (``decode_budget`` > 0, ``--decode-budget``): each step also returns every
layer's attention mass per cached token, accumulated per sequence (``attn_mass``). When a layer has grown
a block past ``decode_budget`` x its prompt-time length + ``decode_window`` tokens
(``block_manager.recompress_target``), it keeps the ``decode_window`` most recent tokens and, of the older
ones (prompt tokens and early generated ones alike), those with the most accumulated mass. A prompt
token's mass starts at ``prompt_weight`` x its prompt-time score (``seed``: its attention per post-vision
row, sent by the prefill worker), so the tokens the question pointed at outlast decode-time attention
that looks elsewhere, while prompt tokens the question ignored compete with generated ones. They are
compacted to the front of its blocks (``KVCache.compact``) and the blocks past them go back to the pool
(``BlockManager.shrink``). Positions keep counting from the true length (RoPE position = prompt length +
tokens generated), never from the shortened cache.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import grpc
import torch
from vlkv.common.config import DEFAULT_PROMPT_WEIGHT
from vlkv.common.errors import VlkvError
from vlkv.common.sampling import SamplingConfig, make_generator, sample_token
from vlkv.decode_worker.block_manager import BlockManager, SequenceBlocks, recompress_target
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
    host_kv: list[tuple[torch.Tensor, ...]] | None = field(default=None, init=False)  # swapped out
    prompt_lengths: list[int] = field(init=False)  # per layer cached tokens on arrival (re-compression)
    attn_mass: torch.Tensor | None = field(default=None, init=False)  # [L, T] accumulated (re-compression)
    evicted: int = field(default=0, init=False)  # tokens dropped by re-compression, all layers

    def __post_init__(self) -> None:
        self.generated = [self.first_token]
        self.prompt_lengths = list(self.lengths)
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
        decode_budget: float = 0.0,
        decode_window: int = 32,
        prompt_weight: float = DEFAULT_PROMPT_WEIGHT,
    ) -> None:
        """``decode_budget`` > 0: re-compress while decoding (see the module docstring); ``prompt_weight``:
        what one unit of prompt-time score counts for in the accumulated mass (``seed``)."""
        self.runner = runner
        self.blocks = blocks
        self.cache = cache
        self.swap_device = swap_device
        self.decode_budget = decode_budget
        self.decode_window = decode_window
        self.prompt_weight = prompt_weight
        self.evicted_tokens = 0  # by re-compression, since start
        self._mass: torch.Tensor | None = None
        self.scheduler: Scheduler[DecodeSequence] = Scheduler(
            blocks, max_batch, swap_bytes, cache.token_bytes
        )

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def add(self, seq: DecodeSequence) -> None:
        """Queue a sequence whose cache is written into its blocks."""
        self.scheduler.add(seq)

    def seed(self, seq: DecodeSequence, prompt_scores: list[torch.Tensor] | None) -> None:
        """Start ``seq``'s accumulated attention mass from its cache's prompt-time scores (``[k_l]`` per
        layer, ``CompactKV.prompt_scores``) times ``prompt_weight``; nothing without re-compression or
        scores (the mass then starts at zero)."""
        if self.decode_budget <= 0 or not prompt_scores or self.prompt_weight <= 0:
            return
        if [s.numel() for s in prompt_scores] != seq.lengths:
            raise ValueError("prompt_scores must hold one score per cached token of each layer")
        mass = torch.zeros(len(seq.lengths), max(seq.lengths))
        for layer, scores in enumerate(prompt_scores):
            mass[layer, : scores.numel()] = scores.float() * self.prompt_weight
        seq.attn_mass = mass

    def release(self, seq: DecodeSequence) -> None:
        """Take a sequence out (finished, cancelled, failed) and free its blocks and host copy."""
        self.scheduler.finish(seq)
        seq.host_kv = None

    def schedule(self) -> SchedulePlan[DecodeSequence]:
        """Plan the next step and move the K/V it names: resumed into the pool, preempted out of it."""
        plan = self.scheduler.schedule()
        for seq, tables in plan.swapped_in:
            for table, kv in zip(tables, seq.host_kv, strict=True):
                self.cache.write(table, *(t.to(self.cache.device) for t in kv))
            seq.host_kv = None
        for seq, tables in plan.swapped_out:
            log.info("request %s: preempted (%d blocks swapped out)", seq.request_id, sum(map(len, tables)))
            kv = [self.cache.read(t, n) for t, n in zip(tables, seq.lengths, strict=True)]
            seq.host_kv = [tuple(t.to(self.swap_device, copy=True) for t in layer) for layer in kv]
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
        if self.decode_budget <= 0:
            return self.runner.step(inputs)
        logits = self.runner.step(inputs, mass=True)
        self._mass = self.runner.last_mass
        return logits

    def postprocess(self, batch: list[DecodeSequence], logits: torch.Tensor) -> StepResult:
        """Grow every stepped sequence by its token; sample for all but the cancelled, which leave now.

        A sequence whose token cannot be sampled (its logits are NaN or inf, or sampling raised) leaves
        too, in ``errors`` with the reason; the rest of the batch goes on."""
        out = StepResult()
        mass, self._mass = self._mass, None
        for i, s in enumerate(batch):
            s.lengths = [n + 1 for n in s.lengths]
            if mass is not None and not s.cancelled:
                self._recompress(s, mass[i])
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

    def _recompress(self, seq: DecodeSequence, step_mass: torch.Tensor) -> None:
        """Add this step's attention mass ``[L, T]`` to ``seq``'s, then cut back every layer past its budget."""
        width = step_mass.shape[1]
        if seq.attn_mass is None or seq.attn_mass.shape[1] < width:
            grown = torch.zeros(step_mass.shape[0], width)
            if seq.attn_mass is not None:
                grown[:, : seq.attn_mass.shape[1]] = seq.attn_mass
            seq.attn_mass = grown
        seq.attn_mass[:, :width] += step_mass
        window = self.decode_window
        for layer, n in enumerate(seq.lengths):
            target = recompress_target(
                seq.prompt_lengths[layer], n, self.decode_budget, window, self.blocks.block_size
            )
            if target >= n:
                continue
            old = seq.attn_mass[layer, : n - window]
            keep = torch.cat(
                [torch.topk(old, target - window).indices.sort().values, torch.arange(n - window, n)]
            )
            table = seq.blocks.tables[layer]
            self.cache.compact(table, keep.to(self.cache.device))
            row = torch.zeros_like(seq.attn_mass[layer])
            row[:target] = seq.attn_mass[layer, keep]
            seq.attn_mass[layer] = row
            seq.lengths[layer] = target
            self.blocks.shrink(seq.blocks, layer, target)
            seq.evicted += n - target
            self.evicted_tokens += n - target

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
