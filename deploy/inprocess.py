"""The whole request path in one process: ``generate(images, prompt)`` with no gRPC, no Ray, no asyncio.

The same pipeline as the servers, driven synchronously: ``prepare_request`` (the gateway's prompt
rendering, image decoding, processor run and validation), ``PrefillEngine.run`` (forward with statistics,
first token, compression into a ``CompactKV``), admission into a paged pool and ``KVCache.write`` (what
the decode worker's ``TransferKV`` does), then ``DecodeCore`` steps until every sequence ends on EOS,
``max_new_tokens`` or a stop string (the decode server's rules, its detokenizer), and its blocks are freed.
The evaluation, the benchmarks and the equality tests use it instead of copies of the pipeline.

Lifecycle: build one ``InProcessEngine`` per model (the pool is allocated once); call ``generate``,
``generate_batch`` or ``decode_caches`` as often as needed; every call returns the blocks it took.
"""

from __future__ import annotations

import io
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from PIL import Image
from vlkv.common.compression.registry import CompressionSettings
from vlkv.common.config import DEFAULT_PROMPT_WEIGHT, Limits
from vlkv.common.errors import ResourceExhausted
from vlkv.common.handoff.compact_kv import CompactKV
from vlkv.common.handoff.quantize import quantize_compact
from vlkv.common.handoff.wire import compact_layers
from vlkv.common.model.spec import ModelSpec
from vlkv.common.request import (
    PreparedRequest,
    compression_to_proto,
    prepare_request,
    sampling_to_proto,
)
from vlkv.common.sampling import SamplingConfig
from vlkv.decode_worker.block_manager import AdmissionPolicy, AdmissionRefusal, BlockManager, RefusalKind
from vlkv.decode_worker.core import DecodeCore, DecodeSequence
from vlkv.decode_worker.detokenizer import IncrementalText, text_decoder
from vlkv.decode_worker.kv_cache import KVCache
from vlkv.decode_worker.model_runner import ModelRunner
from vlkv.prefill_worker.engine import PrefillEngine
from vlkv.v1 import generate_pb2


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
    detok: IncrementalText | None
    seq: DecodeSequence | None = None
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    reason: str = ""

    def emit(self, token: int) -> bool:
        """The decode server's rules for ``token`` (already the last of ``seq.generated``); True: done."""
        if token in self.eos:
            self.reason = "eos"
        else:
            self.token_ids.append(token)
            if self.detok is not None:
                self.text += self.detok.add(token)
            if self.detok is not None and self.detok.stopped:
                self.reason = "stop"
            elif len(self.seq.generated) >= self.sampling.max_new_tokens:
                self.reason = "length"
        if self.reason and self.detok is not None:
            self.text += self.detok.flush()
        return bool(self.reason)


class InProcessEngine:
    """A prefill engine and a decode core sharing one model; ``processor`` is needed by ``generate`` only.

    pool_bytes, block_size, max_batch, admission ("grow" | "reserve"), watermark and swap_bytes (0: as
    much as ``pool_bytes``), decode_budget, decode_window and prompt_weight mean what they mean in
    ``PoolConfig``;
    kv_dtype ("fp16" | "int8" | "fp8") what it means in ``TransferConfig`` (caches are quantized where the prefill
    worker would, before admission); device: of the pool (the model's).
    """

    def __init__(
        self,
        model,
        processor=None,
        *,
        pool_bytes: int = 256 << 20,
        block_size: int = 16,
        max_batch: int = 64,
        admission: str = "grow",
        watermark: float = 0.01,
        swap_bytes: int = 0,
        device: str | torch.device | None = None,
        limits: Limits | None = None,
        kv_dtype: str = "fp16",
        decode_budget: float = 0.0,
        decode_window: int = 32,
        prompt_weight: float = DEFAULT_PROMPT_WEIGHT,
    ) -> None:
        self.model = model
        self.processor = processor
        self.tokenizer = getattr(processor, "tokenizer", None)
        self.limits = limits or Limits()
        self.spec = ModelSpec.from_model(model, self.tokenizer)
        self.prefill = PrefillEngine(model, self.spec)
        device = device if device is not None else next(model.parameters()).device
        self.kv_dtype = kv_dtype
        self.cache = KVCache.from_bytes(
            pool_bytes,
            block_size,
            self.spec.num_kv_heads,
            self.spec.head_dim,
            self.spec.dtype,
            device,
            kv_dtype,
        )
        n = self.cache.num_blocks
        self.blocks = BlockManager(n, block_size, AdmissionPolicy.from_config(admission, watermark, n))
        runner = ModelRunner(model, self.cache)
        self.core = DecodeCore(
            runner, self.blocks, self.cache, max_batch, swap_bytes or pool_bytes,
            decode_budget=decode_budget, decode_window=decode_window, prompt_weight=prompt_weight,
        )  # fmt: skip
        self._decode_text = text_decoder(self.tokenizer) if self.tokenizer is not None else None

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
        tok, dec = self.tokenizer, self._decode_text
        eos = frozenset(self.spec.eos_token_ids)
        runs = [
            _Run(req.request_id, res.cache, req.sampling, eos, IncrementalText(tok, req.sampling.stop, dec))
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
        self, caches: list[CompactKV], sampling: SamplingConfig, eos_ids: Iterable[int]
    ) -> list[list[int]]:
        """Decode already compressed caches together (no stop strings); per cache its ``generated``: the
        prefill's token, then one per step, ending with an EOS or at ``sampling.max_new_tokens``."""
        eos = frozenset(int(i) for i in eos_ids)
        runs = [_Run(f"cache-{i}", c, sampling, eos, None) for i, c in enumerate(caches)]
        self._decode(runs)
        return [list(run.seq.generated) for run in runs]

    # -- decode --------------------------------------------------------------------------------------
    def _admit(self, run: _Run) -> bool:
        """Blocks for ``run``'s cache, written as ``TransferKV`` writes them; False: no room yet."""
        lengths = run.cache.layer_lengths
        swapped = len(self.core.scheduler.swapped)
        got = self.blocks.admit(lengths, max(1, run.sampling.max_new_tokens), swapped)
        if isinstance(got, AdmissionRefusal):
            if got.kind is RefusalKind.NEVER_FITS or not self.core.has_work:
                raise ResourceExhausted(got.message)
            return False
        run.cache = quantize_compact(run.cache, self.kv_dtype)  # the prefill worker's step (--kv-dtype)
        for table, tensors in zip(got.tables, compact_layers(run.cache), strict=True):
            self.cache.write(table, *tensors)
        c = run.cache
        run.seq = DecodeSequence(
            run.request_id, got, list(lengths), c.prompt_length, c.first_token, run.sampling
        )
        self.core.seed(run.seq, c.prompt_scores)
        if run.emit(c.first_token):  # the prefill's token ended it: never decoded
            self.blocks.free(got)
        else:
            self.core.add(run.seq)
        return True

    def _decode(self, runs: list[_Run]) -> None:
        pending = deque(runs)
        by_seq: dict[int, _Run] = {}
        try:
            while pending or self.core.has_work:
                while pending and self._admit(pending[0]):
                    run = pending.popleft()
                    by_seq[id(run.seq)] = run
                out = self.core.step()
                if out.failed:
                    raise ResourceExhausted("the in-process pool ran out of KV memory and swap space")
                if out.errors:  # a sequence whose token could not be sampled has left the core
                    raise out.errors[0][1]
                for seq, token in out.tokens:
                    if by_seq[id(seq)].emit(token):
                        self.core.release(seq)
        except BaseException:
            s = self.core.scheduler
            for seq in [*s.running, *s.waiting, *s.swapped]:
                self.core.release(seq)
            raise


def _png(image: Image.Image) -> bytes:
    """PNG bytes of ``image`` (lossless), so PIL images enter through the gateway's own decoding."""
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()
