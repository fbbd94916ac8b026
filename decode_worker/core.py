from __future__ import annotations

import logging
from dataclasses import dataclass, field

import grpc
import torch
from vlkv.common.compression.windows import binding_windows
from vlkv.common.config import DEFAULT_PROMPT_WEIGHT, PoolConfig
from vlkv.common.errors import ResourceExhausted, VlkvError
from vlkv.common.handoff.compact_kv import CompactKV
from vlkv.common.model.forced import append_tokens
from vlkv.common.sampling import make_generator, sample_token, sample_tokens
from vlkv.decode_worker.block_manager import AdmissionPolicy, BlockManager, recompress_target
from vlkv.decode_worker.kv_cache import KVCache
from vlkv.decode_worker.model_runner import ModelRunner, StepInput
from vlkv.decode_worker.retention import RetainedCaches
from vlkv.decode_worker.scheduler import SchedulePlan, Scheduler
from vlkv.decode_worker.sequence import FinishReason, Sequence, SequenceStatus

log = logging.getLogger(__name__)
OUT_OF_MEMORY = "the decode worker ran out of KV memory and swap space; retry"


@dataclass
class Delta:
    """What one sequence produced in one step: its new token ids (none for an EOS) and text."""

    seq: Sequence
    token_ids: list[int]
    text: str = ""


@dataclass
class StepResult:
    deltas: list[Delta] = field(default_factory=list)  # one per sequence that got a token
    finished: list[Sequence] = field(default_factory=list)  # ended this step (blocks freed), with status


class DecodeCore:
    """``add`` sequences, ``step()`` until ``has_work`` is False; finished sequences leave by themselves.

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
        """Parts given (tests pass a fake runner); servers build a core with ``from_config``.
        ``decode_budget`` > 0: re-compress while decoding (see the module docstring); ``prompt_weight``:
        what one unit of prompt-time score counts for in the accumulated mass (``seed``)."""
        self.runner = runner
        self.blocks = blocks
        self.cache = cache
        self.swap_device = swap_device
        self.decode_budget = decode_budget
        self.decode_window = decode_window
        self.prompt_weight = prompt_weight
        self.evicted_tokens = 0  # by re-compression, since start
        self.slid_tokens = 0  # dropped by sliding layers' rings (``BlockManager.slide``), since start
        self._mass: torch.Tensor | None = None
        self._stepping: set[Sequence] = set()  # between schedule and postprocess
        self.scheduler: Scheduler[Sequence] = Scheduler(blocks, max_batch, swap_bytes, cache.token_bytes)
        # finished sequences kept for a conversation's next turn (not with re-compression: it drops positions)
        self.retained = RetainedCaches(blocks, enabled=decode_budget <= 0)

    @classmethod
    def from_config(
        cls, model, spec, pool: PoolConfig, kv_dtype: str = "fp16", device: str | torch.device = "cpu"
    ) -> DecodeCore:
        """The one way a worker (or ``InProcessEngine``) builds its core: a ``KVCache`` of
        ``pool.pool_bytes`` in ``kv_dtype`` on ``device`` for ``spec``'s layout (a ``ModelSpec``), its
        block manager under ``pool.admission``, and ``model``'s runner over it."""
        _, kv_heads, head_dim, dtype = spec.kv_layout
        cache = KVCache.from_bytes(
            pool.pool_bytes, pool.block_size, kv_heads, head_dim, dtype, device, kv_dtype
        )
        n = cache.num_blocks
        blocks = BlockManager(
            n,
            pool.block_size,
            AdmissionPolicy.from_config(pool.admission, pool.watermark, n),
            windows=getattr(spec, "windows", ()),  # sliding layers are rings (``BlockManager.slide``)
        )
        runner = ModelRunner(model, cache, pool.batch_invariant) if model is not None else None
        if runner is not None and blocks.windows and tuple(runner.windows) != blocks.windows:
            raise ValueError(
                f"the model's sliding windows {runner.windows} are not the spec's {blocks.windows}"
            )
        return cls(
            runner,
            blocks,
            cache,
            pool.max_batch,
            pool.swap_bytes or pool.pool_bytes,
            decode_budget=pool.decode_budget,
            decode_window=pool.decode_window,
            prompt_weight=pool.prompt_weight,
        )

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    @property
    def num_swapped(self) -> int:
        return len(self.scheduler.swapped)

    def seed(self, seq: Sequence, prompt_scores: list[torch.Tensor] | None) -> None:
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

    def add(self, seq: Sequence) -> Delta:
        """Start a sequence whose cache is whole in its blocks: the prefill's token goes through the stop
        rules (it may end the sequence at once, blocks freed); otherwise it queues for the batch. A sequence
        that feeds prompt tokens first (``forced``: a turn on a kept cache) emits nothing yet."""
        delta = Delta(seq, []) if seq.forced else self._emit(seq, seq.first_token)
        if seq.finished:
            self._release(seq)
        else:
            seq.status = SequenceStatus.WAITING
            self.scheduler.add(seq)
        return delta

    def can_feed(self, seq: Sequence) -> bool:
        """Whether a continued turn's ``forced`` prompt tokens (``retention.py``) can run in one forward
        (``feed``), and room for their K/V taken in its blocks (idle ones given back if needed). On the
        event loop, where every block is accounted: ``feed`` itself, in the model thread, touches none of
        it. False (nothing taken: its steps feed the tokens one at a time) for a quantized pool, no room for
        the tokens now, or no model."""
        model = getattr(self.runner, "model", None)
        if model is None or self.cache.quantized or not seq.forced or self.decode_budget > 0:
            return False
        return self.blocks.grow(seq.blocks, seq.lengths, len(seq.forced))

    def feed(self, seq: Sequence) -> None:
        """Run ``seq``'s ``forced`` prompt tokens over its kept cache in one forward, write their K/V into
        the blocks ``can_feed`` took, and sample its first token: ``seq`` is then an ordinary sequence, as if
        a prefill had handed it off (its prompt the whole turn's). In the engine's model thread, before the
        sequence is added."""
        f = len(seq.forced)
        layers = [self.cache.read(t, n) for t, n in zip(seq.blocks.tables, seq.lengths, strict=True)]
        kept = CompactKV([k for k, _ in layers], [v for _, v in layers], prompt_length=seq.prompt_length)
        extended, logits = append_tokens(self.runner.model, kept, seq.forced)
        for table, k, v in zip(seq.blocks.tables, extended.keys, extended.values, strict=True):
            self.cache.write(table, k, v)
        seq.lengths = [k.shape[1] for k in extended.keys]
        seq.prompt_length += f
        generator = None if seq.sampling.greedy else make_generator(seq.sampling.seed)
        seq.first_token = sample_token(logits, seq.sampling, generator)
        seq.generated = [seq.first_token]
        seq.forced = []

    def end(self, seq: Sequence, reason: FinishReason, error: VlkvError | None = None) -> None:
        """End a sequence from outside (``CANCELLED``: its caller went away; ``ERROR``: it cannot be
        served); its blocks are freed now, or when the step using them returns."""
        seq.finish(reason, error)
        if seq not in self._stepping:
            self._release(seq)

    def abort_all(self, error: VlkvError) -> list[Sequence]:
        """End every sequence in the core with ``error`` (shutdown, a dead loop); returns them."""
        s = self.scheduler
        seqs = [*s.running, *s.waiting, *s.swapped]
        for seq in seqs:
            seq.finish(FinishReason.ERROR, error)
            self._release(seq)
        return seqs

    def fail(self, batch: list[Sequence], error: VlkvError) -> None:
        """A step over ``batch`` failed (the model raised): every sequence of it ends with ``error``."""
        self._stepping = set()
        for seq in batch:
            seq.finish(FinishReason.ERROR, error)
            self._release(seq)

    def _release(self, seq: Sequence) -> None:
        """``seq`` leaves the core: its blocks go back to the pool, or are kept idle for its conversation's
        next turn when it asked (``retention.py``)."""
        keep = seq.finished and self.retained.keeps(seq)
        self.scheduler.finish(seq, free=not keep)
        if keep:
            self.retained.keep(seq)
        seq.host_kv = None

    def schedule(self) -> SchedulePlan[Sequence]:
        """Plan the next step and move the K/V it names: resumed into the pool, preempted out of it. The
        sequences the plan fails (no swap space) are finished here with RESOURCE_EXHAUSTED."""
        plan = self.scheduler.schedule()
        for seq, tables in plan.swapped_in:
            for table, kv in zip(tables, seq.host_kv, strict=True):
                self.cache.write(table, *(t.to(self.cache.device) for t in kv))
            seq.host_kv = None
        for seq, tables in plan.swapped_out:
            log.info("request %s: preempted (%d blocks swapped out)", seq.request_id, sum(map(len, tables)))
            kv = [self.cache.read(t, n) for t, n in zip(tables, seq.lengths, strict=True)]
            seq.host_kv = [tuple(t.to(self.swap_device, copy=True) for t in layer) for layer in kv]
            seq.status = SequenceStatus.SWAPPED
        for seq in plan.failed:
            log.warning("request %s: preempted with no swap space left; failing it", seq.request_id)
            seq.host_kv = None
            seq.finish(FinishReason.ERROR, ResourceExhausted(OUT_OF_MEMORY))
        for seq in plan.running:
            seq.status = SequenceStatus.RUNNING
        self._stepping = set(plan.running)
        return plan

    def forward(self, batch: list[Sequence]) -> torch.Tensor:
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

    def postprocess(self, batch: list[Sequence], logits: torch.Tensor) -> StepResult:
        """Grow every stepped sequence by its token: one sampling call for the batch, then the stop rules.
        A sequence cancelled during the step leaves now; one whose token cannot be sampled (its logits are
        NaN or inf) ends with the reason, the rest of the batch goes on."""
        out = StepResult()
        mass, self._mass = self._mass, None
        self._stepping = set()
        live = []
        for i, s in enumerate(batch):
            s.lengths = [n + 1 for n in s.lengths]
            if s.finished:  # cancelled while its step ran
                self._release(s)
            else:
                slid = self.blocks.slide(s.blocks, s.lengths)  # rings: blocks no later step reads
                s.slid += slid
                self.slid_tokens += slid
                if mass is not None:
                    self._recompress(s, mass[i])
                live.append(i)
        sampled = []
        for i in live:
            s = batch[i]
            if s.feeding:  # a prompt token goes in next: nothing sampled
                s.generated.append(s.forced[len(s.generated)])
            else:
                sampled.append(i)
        live = sampled
        if not live:
            return out
        seqs = [batch[i] for i in live]
        rows = logits if len(live) == len(batch) else logits[live]
        try:
            tokens = sample_tokens(rows, [s.sampling for s in seqs], [s.generator for s in seqs])
        except Exception as exc:  # noqa: BLE001 - the sampler itself broke: this batch fails, not the worker
            tokens = [exc] * len(seqs)
        for s, token in zip(seqs, tokens, strict=True):
            if isinstance(token, Exception):
                s.finish(FinishReason.ERROR, _sampling_error(s, token))
            else:
                s.generated.append(token)
                out.deltas.append(self._emit(s, token))
            if s.finished:
                self._release(s)
                out.finished.append(s)
        return out

    def _emit(self, seq: Sequence, token: int) -> Delta:
        """``token`` (already the last of ``seq.generated``) as ids and text, through the stop rules."""
        try:
            if token in seq.eos_token_ids:
                delta = Delta(seq, [])
            else:
                delta = Delta(seq, [token], seq.detok.add(token) if seq.detok is not None else "")
            reason = seq.stop_reason(token)
            if reason is not None:
                if seq.detok is not None:
                    delta.text += seq.detok.flush()
                seq.finish(reason)
            return delta
        except Exception as exc:  # noqa: BLE001 - e.g. the detokenizer: this sequence alone fails
            log.exception("request %s: streaming token %d failed", seq.request_id, token)
            seq.finish(FinishReason.ERROR, VlkvError(f"decoding failed: {exc!r}", grpc.StatusCode.INTERNAL))
            return Delta(seq, [])

    def _rings(self, seq: Sequence) -> tuple[int, ...]:
        """Per layer of ``seq`` its window where it binds (``windows.binding_windows``: the prefill kept that
        layer's last positions and ``BlockManager.slide`` keeps it a ring of its window), else 0. A window the
        request cannot outgrow binds nothing: that layer was compressed by score like a full-attention layer
        and is re-compressed like one (its cache never exceeds the window, so the attention never cuts it)."""
        windows = (self.runner.windows if self.runner is not None else ()) or self.blocks.windows
        rings = binding_windows(windows, seq.prompt_length, seq.sampling.max_new_tokens)
        return rings or (0,) * len(seq.lengths)

    def _recompress(self, seq: Sequence, step_mass: torch.Tensor) -> None:
        """Add this step's attention mass ``[L, T]`` to ``seq``'s, then cut back every layer past its budget;
        a sliding layer's ring (``_rings``) is neither cut nor checked against a trigger."""
        width = step_mass.shape[1]
        if seq.attn_mass is None or seq.attn_mass.shape[1] < width:
            grown = torch.zeros(step_mass.shape[0], width)
            if seq.attn_mass is not None:
                grown[:, : seq.attn_mass.shape[1]] = seq.attn_mass
            seq.attn_mass = grown
        seq.attn_mass[:, :width] += step_mass
        window = self.decode_window
        for layer, n in enumerate(seq.lengths):
            if self._rings(seq)[layer]:  # a ring: a run of its last positions, never re-compressed
                continue
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
        """schedule -> forward -> postprocess. Nothing to step while ``has_work`` only when a preempted
        sequence waits for blocks held outside the core (caches admitted but not yet added)."""
        plan = self.schedule()
        result = StepResult()
        if plan.running:
            result = self.postprocess(plan.running, self.forward(plan.running))
        result.finished[:0] = plan.failed
        return result


def _sampling_error(seq: Sequence, exc: Exception) -> VlkvError:
    """Why ``seq`` got no token, as the status its request ends with (INTERNAL unless the error says)."""
    step = len(seq.generated)
    if isinstance(exc, VlkvError):
        log.warning("request %s: no token at step %d: %s", seq.request_id, step, exc)
        return VlkvError(f"decoding failed at token {step}: {exc.message}", exc.code)
    log.exception("request %s: sampling failed at step %d", seq.request_id, step, exc_info=exc)
    return VlkvError(f"decoding failed at token {step}: sampling raised {exc!r}", grpc.StatusCode.INTERNAL)
