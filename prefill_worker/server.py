"""The prefill worker's gRPC service: prefill, compress, hand the compact cache to a decode worker.

The request arrives as the gateway prepared it (input ids, pixel values, validated settings) and is parsed
and checked once here (``request.from_prefill_proto``, against the model's processor: ``ImageInputs``)
before any model code; the processor never runs on this worker, and nothing the request names is trusted:
the image cache is keyed on the digest of the pixel values run here, the tenant comes from the call's
authenticated metadata (``caller_tenant``). Prefills run one at a
time in a worker thread (the forward is compute-bound and uses all torch threads); queued requests wait on
the event loop, which keeps answering health checks and load queries. The cache goes to the decode worker
named in the request, if that worker is registered (``peers.DecodePeers``), through the sender the peer
gets (``transport.KVSender``: NIXL writes into its pool, or ``TransferKV`` messages); a refusal there (pool
full, fingerprint mismatch) comes back to the gateway with the decode worker's status and its ``Refusal``
reason; a decode worker that cannot be reached is ``REFUSAL_HAND_OFF_FAILED``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
from vlkv.common import logs
from vlkv.common.compression.profile import CompressionProfile
from vlkv.common.config import PrefillConfig
from vlkv.common.errors import InvalidInput, Refusal, VlkvError
from vlkv.common.grpc_server import abort_on_error
from vlkv.common.handoff.nixl_agent import NixlAgent
from vlkv.common.handoff.quantize import quantize_compact
from vlkv.common.handoff.wire import KVWireError, compact_header
from vlkv.common.load_stream import LoadStream
from vlkv.common.model.image_inputs import ImageInputs
from vlkv.common.model.spec import ModelSpec
from vlkv.common.request import MAX_REQUEST_ID, from_prefill_proto
from vlkv.common.reuse import ANONYMOUS, MAX_TENANT_CHARS, TENANT_KEY
from vlkv.prefill_worker.engine import PrefillEngine
from vlkv.prefill_worker.image_cache import ImageCache
from vlkv.prefill_worker.peers import DecodePeers
from vlkv.prefill_worker.prefix_cache import PrefixCache
from vlkv.prefill_worker.verifier import verdict_fields
from vlkv.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)


class PrefillServicer(worker_pb2_grpc.PrefillWorkerServicer):
    def __init__(
        self,
        model,
        spec: ModelSpec,
        cfg: PrefillConfig,
        nixl: NixlAgent | None = None,
        images: ImageInputs | None = None,
        profile: CompressionProfile | None = None,
        learned: CompressionProfile | None = None,
    ) -> None:
        """``images``: what the model's processor produces (every request's model inputs are checked
        against it); None: this worker takes text-only requests. ``profile``: the compression profile it
        serves, already checked against the model (``PrefillEngine``); ``learned``: the verifier's learned profile
        a restart starts from (``cfg.learned_profile``), checked alike."""
        self.cfg = cfg
        self.spec = spec
        self.images = images
        self.image_cache = ImageCache(cfg.image_cache_mb << 20)
        self.prefix_cache = PrefixCache(cfg.prefix_cache_mb << 20, cfg.prefix_block)
        self.engine = PrefillEngine(
            model,
            spec,
            self.image_cache,
            profile,
            cfg.verify,
            cfg.learned_profile,
            learned=learned,
            draft_batch=cfg.concurrency,
            prefix_cache=self.prefix_cache,
            share_prefixes=cfg.share_prefixes,
        )
        self.address = ""
        self.draining = False
        self.running = 0
        self.waiting = 0
        self.window_saved = 0  # bytes sliding windows kept out of this worker's caches since it started
        self._executor = ThreadPoolExecutor(max_workers=cfg.concurrency, thread_name_prefix="vlkv-prefill")
        self._count = threading.Lock()  # running / window_saved, updated from the executor's threads
        self.peers = DecodePeers(cfg, nixl)
        self.load_stream = LoadStream()

    async def stop(self) -> None:
        self.load_stream.close()
        await self.peers.close()
        self._executor.shutdown(wait=True)
        self.engine.close()

    def allow_decode(self, address: str) -> None:
        """Register a decode worker of the cluster: caches may be sent to it."""
        self.peers.allow(address)

    @abort_on_error
    async def Prefill(self, request, context):
        logs.request_id.set(request.request_id[:MAX_REQUEST_ID])
        self.peers.channel(request.decode_address)  # PERMISSION_DENIED before any work if not registered
        # This process's one parse and validation of it, before any model code.
        req = from_prefill_proto(request, self.spec, self.cfg.limits, self.images)
        req.tenant = caller_tenant(context)
        loop = asyncio.get_running_loop()
        self.waiting += 1
        try:
            result = await loop.run_in_executor(self._executor, self._run_counted, req)
        finally:
            self.waiting -= 1
        ckv = result.cache
        header = compact_header(
            ckv,
            request_id=request.request_id,
            fingerprint=self.spec.fingerprint,
            sampling=request.sampling,
            eos_token_ids=list(self.spec.eos_token_ids),
            prompt_tokens=result.modality.m,
            vision_tokens=result.modality.num_vision_tokens,
            policy=result.policy,
        )
        start = time.perf_counter()
        try:
            await self.peers.send(request.decode_address, header, ckv)
        except KVWireError as exc:  # the decode worker's (or the transport's) status and details
            code = exc.code
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                msg = f"KV hand-off to decode worker {request.decode_address} failed: {exc.message}"
                raise VlkvError(msg, grpc.StatusCode.UNAVAILABLE, Refusal.REFUSAL_HAND_OFF_FAILED) from None
            raise VlkvError(f"decode worker refused the cache: {exc.message}", code, exc.reason) from None
        transfer_ms = (time.perf_counter() - start) * 1000
        return worker_pb2.PrefillReply(
            prompt_tokens=result.modality.m,
            vision_tokens=result.modality.num_vision_tokens,
            post_vision_tokens=result.modality.tau,
            first_token_id=ckv.first_token,
            kv_bytes_kept=ckv.nbytes,
            kv_bytes_full=ckv.full_nbytes,
            compression_ratio=ckv.compression_ratio,
            layer_budgets=ckv.layer_lengths,
            prefill_ms=result.prefill_ms,
            transfer_ms=transfer_ms,
            policy=result.policy,
            image_cache_hit=bool(result.reuse and result.reuse.hit),
            recomputed_image_tokens=result.reuse.recomputed_tokens if result.reuse else 0,
            recompute_ratio=result.reuse.ratio if result.reuse and result.reuse.hit else 1.0,
            compression_profile=result.profile,
            kv_bytes_window_saved=result.window_saved_bytes,
            cached_prompt_tokens=result.prefix.cached_tokens if result.prefix else 0,
            continued_tokens=result.continued_tokens,
            continue_refused=result.continue_refused,
            **verdict_fields(result.verdict),
        )

    def _run_counted(self, *args):
        with self._count:
            self.running += 1
        try:
            result = self.engine.run(*args)
            result.cache = quantize_compact(result.cache, self.cfg.transfer.kv_dtype)  # --kv-dtype
            with self._count:
                self.window_saved += result.window_saved_bytes
            return result
        finally:
            with self._count:
                self.running -= 1

    def load(self) -> worker_pb2.WorkerLoad:
        return worker_pb2.WorkerLoad(
            address=self.address,
            running=self.running,
            waiting=max(0, self.waiting - self.running),
            draining=self.draining,
            model_fingerprint=self.spec.fingerprint,
            image_cache=cache_stats_proto(self.image_cache, self.engine.hint_mismatches),
            compression_profile=self.engine.profile.label if self.engine.profile else "",
            verifier=worker_pb2.VerifierStats(**self.engine.ledger.snapshot()),
            kv_bytes_window_saved=self.window_saved,
            prefix_cache=prefix_stats_proto(self.prefix_cache),
        )

    async def GetLoad(self, request, context):
        return self.load()

    async def WatchLoad(self, request, context):
        """``load()`` pushed on change and every second, with the image-cache entries added and evicted."""
        seen = -1  # the image cache's version this stream reported last

        def changes(report: worker_pb2.WorkerLoad) -> bool:
            nonlocal seen
            delta = self.image_cache.changes_since(seen)
            seen = delta.version
            report.images_full = delta.full
            report.images_added.extend(
                worker_pb2.ImageDigest(image_hash=k.image_hash, tenant=k.tenant) for k in delta.added
            )
            report.images_evicted.extend(
                worker_pb2.ImageDigest(image_hash=k.image_hash, tenant=k.tenant) for k in delta.dropped
            )
            return bool(delta.full or delta.added or delta.dropped)

        async for report in self.load_stream.watch(self.load, changes):
            yield report


def cache_stats_proto(cache: ImageCache, hint_mismatches: int = 0) -> worker_pb2.ImageCacheStats:
    s = cache.stats()
    return worker_pb2.ImageCacheStats(
        entries=s.entries,
        bytes_held=s.bytes_held,
        capacity_bytes=s.capacity,
        hits=s.hits,
        misses=s.misses,
        evictions=s.evictions,
        hint_mismatches=hint_mismatches,
    )


def prefix_stats_proto(cache: PrefixCache) -> worker_pb2.PrefixCacheStats:
    s = cache.stats()
    return worker_pb2.PrefixCacheStats(
        blocks=s.blocks,
        bytes_held=s.bytes_held,
        capacity_bytes=s.capacity,
        lookups=s.lookups,
        hits=s.hits,
        hit_tokens=s.hit_tokens,
        lookup_tokens=s.lookup_tokens,
        evictions=s.evictions,
        rejected=s.rejected,
        block_tokens=cache.block,
    )


def caller_tenant(context) -> str:
    """The image cache's tenant of a call: the one its authenticated caller (the gateway, holding the
    internal token or a client certificate) names in the call's metadata, beside its credentials; never a
    field of the request message. Anonymous if none is named."""
    named = ""
    for key, value in context.invocation_metadata() or ():
        if key == TENANT_KEY:
            named = value if isinstance(value, str) else ""
    if len(named) > MAX_TENANT_CHARS or not named.isprintable():
        raise InvalidInput(f"metadata {TENANT_KEY}: at most {MAX_TENANT_CHARS} printable characters")
    return named or ANONYMOUS
