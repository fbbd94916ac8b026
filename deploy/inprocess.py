"""The whole request path in one process: ``generate(images, prompt)`` with no gRPC, no Ray, no asyncio.

The same pipeline as the servers, driven synchronously: ``prepare_request`` (the gateway's prompt
rendering, image decoding, processor run and validation), ``PrefillEngine.run`` (forward with statistics,
first token, compression into a ``CompactKV``), the decode worker's own ``Admission`` (the header checks,
the blocks, the sequence: admit -> write -> arrive, as its ``TransferKV`` does, over this process's pool),
then ``DecodeCore`` steps until every sequence ends on EOS, ``max_new_tokens`` or a stop string (the
core's stop rules, the decode server's detokenizer), and its blocks are freed.
The evaluation, the benchmarks and the equality tests use it instead of copies of the pipeline.

Lifecycle: build one ``InProcessEngine`` per model (the pool is allocated once); call ``generate``,
``generate_batch`` or ``decode_caches`` as often as needed; every call returns the blocks it took.
"""

from __future__ import annotations

import dataclasses
import io
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import grpc
import torch
from PIL import Image
from vlkv.common.compression.profile import CompressionProfile
from vlkv.common.compression.registry import CompressionSettings
from vlkv.common.compression.verify import VerifyConfig
from vlkv.common.config import Limits, PoolConfig
from vlkv.common.errors import ResourceExhausted, VlkvError
from vlkv.common.handoff.compact_kv import CompactKV
from vlkv.common.handoff.quantize import quantize_compact
from vlkv.common.handoff.wire import KVWireError, compact_header
from vlkv.common.model.spec import ModelSpec
from vlkv.common.request import (
    PreparedRequest,
    compression_to_proto,
    prepare_request,
    sampling_to_proto,
)
from vlkv.common.sampling import SamplingConfig
from vlkv.decode_worker.admission import Admission, LocalArrivals
from vlkv.decode_worker.core import DecodeCore, Delta
from vlkv.decode_worker.sequence import Sequence
from vlkv.prefill_worker.engine import PrefillEngine
from vlkv.v1 import generate_pb2, worker_pb2


@dataclass
class Generation:
    """One request's result, as a client of the servers would see it (``token_ids`` hold no EOS)."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str  # "eos", "length" or "stop"
    generated_tokens: int  # Usage.generated_tokens: the prefill's token and the decoded ones, EOS included
    prompt_tokens: int = 0
    vision_tokens: int = 0
    kv_bytes_kept: int = 0
    kv_bytes_full: int = 0
    layer_budgets: list[int] = field(default_factory=list)
    policy: str = ""
    prefill_ms: float = 0.0


@dataclass(eq=False)
class _Run:
    """One sequence in a decode call and what the decode server would have streamed of it."""

    request_id: str
    cache: CompactKV
    sampling: SamplingConfig
    eos: frozenset[int]
    header: dict = field(default_factory=dict)  # more KVHeader fields (prompt_tokens, policy)
    seq: Sequence | None = None
    token_ids: list[int] = field(default_factory=list)
    text: str = ""

    def take(self, delta: Delta) -> None:
        self.token_ids += delta.token_ids
        self.text += delta.text

    @property
    def reason(self) -> str:
        return self.seq.finish_reason.value if self.seq is not None and self.seq.finished else ""


class InProcessEngine:
    """A prefill engine and a decode core sharing one model; ``processor`` is needed by ``generate`` only.

    ``pool``: the decode worker's ``PoolConfig`` (its fields may also be given as keywords, which replace
    the given or default config's); kv_dtype ("fp16" | "int8" | "fp8") what it means in ``TransferConfig``
    (caches are quantized where the prefill worker would, before admission); device: of the pool (the
    model's); profile: the compression profile the prefill serves (``vlkv serve --compression-profile``),
    checked against the model here; verify: verified compression's defaults (``vlkv serve --verify``; None,
    the default here: requests are compressed by their policy, unverified).
    """

    def __init__(
        self,
        model,
        processor=None,
        pool: PoolConfig | None = None,
        *,
        device: str | torch.device | None = None,
        limits: Limits | None = None,
        kv_dtype: str = "fp16",
        profile: CompressionProfile | None = None,
        verify: VerifyConfig | None = None,
        **pool_fields,
    ) -> None:
        self.model = model
        self.processor = processor
        self.tokenizer = getattr(processor, "tokenizer", None)
        self.limits = limits or Limits()
        self.spec = ModelSpec.from_model(model, self.tokenizer)
        if profile is not None:
            profile.check_model(self.spec.fingerprint)
        self.prefill = PrefillEngine(model, self.spec, profile=profile, verify_config=verify)
        device = device if device is not None else next(model.parameters()).device
        self.kv_dtype = kv_dtype
        self.pool = dataclasses.replace(pool or PoolConfig(), **pool_fields)
        self.core = DecodeCore.from_config(model, self.spec, self.pool, kv_dtype, device)
        self.cache, self.blocks = self.core.cache, self.core.blocks
        self.arrivals = LocalArrivals()
        self.admission = Admission(
            self.core, self.spec, self.arrivals, limits=self.limits, tokenizer=self.tokenizer
        )

    # -- the request path ----------------------------------------------------------------------------
    def prepare(
        self,
        images: list[bytes] | list[Image.Image],
        prompt: str | None = None,
        *,
        question: str | None = None,
        sampling: SamplingConfig | None = None,
        compression: CompressionSettings | None = None,
        request_id: str = "",
    ) -> PreparedRequest:
        """The gateway's step: a plain ``prompt`` (with image placeholders) or a one-turn chat ``question``
        after the images; sampling defaults to ``Limits``' (greedy, seed 0 where the gateway draws one),
        compression to the server's default."""
        if self.processor is None:
            raise ValueError("prepare needs the engine's processor")
        if (prompt is None) == (question is None):
            raise ValueError("give exactly one of prompt and question")
        blobs = [_png(i) if isinstance(i, Image.Image) else bytes(i) for i in images]
        pb = generate_pb2.GenerateRequest(request_id=request_id or "inprocess", images=blobs)
        if sampling is not None:
            pb.sampling.CopyFrom(sampling_to_proto(sampling))
        if compression is not None:
            pb.compression.CopyFrom(compression_to_proto(compression))
        if question is not None:
            parts = [generate_pb2.ContentPart(image=generate_pb2.ImagePlaceholder()) for _ in blobs]
            parts.append(generate_pb2.ContentPart(text=question))
            pb.chat.messages.append(generate_pb2.ChatMessage(role="user", content=parts))
        else:
            pb.text = prompt
        return prepare_request(pb, self.processor, self.spec, self.limits, default_seed=0)

    def generate(
        self,
        images: list[bytes] | list[Image.Image],
        prompt: str | None = None,
        *,
        question: str | None = None,
        sampling: SamplingConfig | None = None,
        compression: CompressionSettings | None = None,
        request_id: str = "",
    ) -> Generation:
        """One request through the whole pipeline; the arguments are ``prepare``'s."""
        kw = dict(question=question, sampling=sampling, compression=compression, request_id=request_id)
        return self.generate_batch([self.prepare(images, prompt, **kw)])[0]

    def generate_batch(self, requests: list[PreparedRequest]) -> list[Generation]:
        """Every prefill, then one continuous-batching decode of all the sequences."""
        if self.tokenizer is None:
            raise ValueError("generate needs the engine's processor (its tokenizer detokenizes)")
        results = [self.prefill.run(req) for req in requests]
        eos = frozenset(self.spec.eos_token_ids)
        runs = [
            _Run(
                req.request_id,
                res.cache,
                req.sampling,
                eos,
                dict(
                    prompt_tokens=res.modality.m,
                    vision_tokens=res.modality.num_vision_tokens,
                    policy=res.policy,
                ),
            )
            for req, res in zip(requests, results, strict=True)
        ]
        self._decode(runs)
        return [
            Generation(
                request_id=run.request_id,
                token_ids=run.token_ids,
                text=run.text,
                finish_reason=run.reason,
                generated_tokens=len(run.seq.generated),
                prompt_tokens=res.modality.m,
                vision_tokens=res.modality.num_vision_tokens,
                kv_bytes_kept=run.cache.nbytes,  # as stored (--kv-dtype)
                kv_bytes_full=run.cache.full_nbytes,
                layer_budgets=res.cache.layer_lengths,
                policy=res.policy,
                prefill_ms=res.prefill_ms,
            )
            for run, res in zip(runs, results, strict=True)
        ]

    def decode_caches(
        self,
        caches: list[CompactKV],
        sampling: SamplingConfig | list[SamplingConfig],
        eos_ids: Iterable[int],
    ) -> list[list[int]]:
        """Decode already compressed caches together (no stop strings); per cache its ``generated``: the
        prefill's token, then one per step, ending with an EOS or at ``sampling.max_new_tokens``
        (``sampling``: one for every cache, or one per cache)."""
        eos = frozenset(int(i) for i in eos_ids)
        per_cache = sampling if isinstance(sampling, list) else [sampling] * len(caches)
        if len(per_cache) != len(caches):
            raise ValueError(f"{len(per_cache)} sampling configs for {len(caches)} caches")
        runs = [_Run(f"cache-{i}", c, s, eos) for i, (c, s) in enumerate(zip(caches, per_cache, strict=True))]
        self._decode(runs)
        return [list(run.seq.generated) for run in runs]

    def teacher_force(
        self,
        caches: list[CompactKV],
        steps: int,
        tokens: list[list[int]] | None = None,
        observe: Callable[[list[int], torch.Tensor], None] | None = None,
    ) -> list[list[int]]:
        """Decode ``caches`` together through the decode core, each for at most ``steps`` tokens (the
        prefill's included), every next token forced to ``tokens[i][g]`` (``g``: tokens generated so far;
        None: the sequence's own greedy choice) and every step's next-token logits handed to
        ``observe(rows, logits)`` first (``logits[r]``: fp32 ``[vocab]`` of cache ``rows[r]``, predicting
        its token ``len(generated)``). A forced EOS ends a sequence. Returns each cache's tokens.
        The core samples from logits that put all mass on the forced token, so its own stop rules,
        lengths and blocks move exactly as in a decode."""
        eos = frozenset(self.spec.eos_token_ids)
        runs = [
            _Run(f"force-{i}", c, SamplingConfig(max_new_tokens=len(tokens[i]) if tokens else steps), eos)
            for i, c in enumerate(caches)
        ]
        pending, index = deque(runs), {}
        try:
            while pending or self.core.has_work:
                while pending and self._admit(pending[0]):
                    run = pending.popleft()
                    index[run.seq] = runs.index(run)
                plan = self.core.schedule()
                if not plan.running:
                    raise ResourceExhausted("teacher_force: the pool cannot hold the sequences it admitted")
                logits = self.core.forward(plan.running)
                rows = [index[s] for s in plan.running]
                if observe is not None:
                    observe(rows, logits)
                forced = torch.zeros_like(logits)
                for r, (i, seq) in enumerate(zip(rows, plan.running, strict=True)):
                    forced[r, tokens[i][len(seq.generated)] if tokens else int(logits[r].argmax())] = 1.0
                out = self.core.postprocess(plan.running, forced)
                for seq in out.finished:
                    if seq.error is not None:
                        raise seq.error
        except BaseException:
            self.core.abort_all(VlkvError("the in-process decode was interrupted"))
            raise
        return [list(run.seq.generated) for run in runs]

    # -- decode --------------------------------------------------------------------------------------
    def _admit(self, run: _Run) -> bool:
        """``run``'s cache through the decode worker's admission (admit -> write -> arrive) and into the
        core; False: no room yet (sequences in the core will free some)."""
        run.cache = quantize_compact(run.cache, self.kv_dtype)  # the prefill worker's step (--kv-dtype)
        header = compact_header(
            run.cache,
            request_id=run.request_id,
            fingerprint=self.spec.fingerprint,
            sampling=sampling_to_proto(run.sampling),
            eos_token_ids=run.eos,
            **run.header,
        ).header
        try:
            seq = self.admission.admit(header)
        except KVWireError as exc:
            if exc.reason == worker_pb2.REFUSAL_POOL_FULL and self.core.has_work:
                return False
            if exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise ResourceExhausted(exc.message) from None
            raise VlkvError(exc.message, exc.code) from None
        self.admission.write_cache(seq, run.cache)
        self.admission.arrive(seq, "local")
        run.seq = self.arrivals.arrived.popleft()
        run.take(self.core.add(run.seq))
        return True

    def _decode(self, runs: list[_Run]) -> None:
        pending = deque(runs)
        by_seq: dict[Sequence, _Run] = {}
        try:
            while pending or self.core.has_work:
                while pending and self._admit(pending[0]):
                    run = pending.popleft()
                    by_seq[run.seq] = run
                out = self.core.step()
                for delta in out.deltas:
                    by_seq[delta.seq].take(delta)
                for seq in out.finished:
                    if seq.error is not None:  # out of KV memory and swap, or a token not sampled
                        raise seq.error
        except BaseException:
            self.core.abort_all(VlkvError("the in-process decode was interrupted"))
            raise


def _png(image: Image.Image) -> bytes:
    """PNG bytes of ``image`` (lossless), so PIL images enter through the gateway's own decoding."""
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()
