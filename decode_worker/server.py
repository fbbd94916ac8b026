"""The decode worker's gRPC service.

A request's compact cache arrives through ``TransferKV`` (from its prefill worker) and its tokens leave
through ``Decode`` (to the gateway); the two calls meet on the request id in either order. Pool blocks are
reserved when the header arrives (after the fingerprint and layout checks), released on any transfer
failure, and a cache that no ``Decode`` call claims within its lease is freed.

Everything a header carries is checked against this model before a block is taken (sampling settings, a
first token and EOS ids inside the vocabulary), and a cache holding NaN or inf is refused once it is whole:
INVALID_ARGUMENT, so one bad sequence never reaches the batch it would break. Should the decode loop die,
the worker fails its sequences with UNAVAILABLE, turns NOT_SERVING and exits (``exit_process``) to be
replaced.

``TransferKV`` takes its messages as raw bytes (register the servicer with ``add_decode_servicer``, not
the generated ``add_DecodeWorkerServicer_to_server``): ``KVAssembler.feed_wire`` reads data chunks
zero-copy. The bytes are serialized ``KVChunk`` messages, so any sender works: the prefill worker's
pre-encoded stream and the generated stub's ``TransferKV`` alike.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

import grpc
import torch
from vlkv.common import logs
from vlkv.common.config import DecodeConfig
from vlkv.common.errors import InvalidInput, Refusal, VlkvError, abort_with
from vlkv.common.grpc_server import abort_stream_on_error
from vlkv.common.handoff.assembler import KVAssembler
from vlkv.common.handoff.wire import KVWireError
from vlkv.common.model.spec import ModelSpec
from vlkv.common.request import sampling_from_proto
from vlkv.decode_worker.block_manager import AdmissionPolicy, AdmissionRefusal, BlockManager, RefusalKind
from vlkv.decode_worker.core import DecodeCore
from vlkv.decode_worker.detokenizer import IncrementalText, text_decoder
from vlkv.decode_worker.engine import DecodeEngine, Sequence
from vlkv.decode_worker.kv_cache import KVCache
from vlkv.decode_worker.model_runner import ModelRunner
from vlkv.v1 import generate_pb2, kv_pb2, worker_pb2, worker_pb2_grpc

if TYPE_CHECKING:
    from grpc_health.v1._async import HealthServicer

log = logging.getLogger(__name__)
ENGINE_DIED_EXIT_CODE = 70  # EX_SOFTWARE: the decode loop died; the process exits to be replaced
EXIT_GRACE_S = 0.5
DRAIN_LIMIT_BYTES = 1 << 30  # what a refused sender may still stream before the refusal is sent anyway
_REFUSALS = {  # the block manager's refusal kinds as the wire's machine-readable reasons
    RefusalKind.POOL_FULL: worker_pb2.REFUSAL_POOL_FULL,
    RefusalKind.NEVER_FITS: worker_pb2.REFUSAL_NEVER_FITS,
}


class DecodeServicer(worker_pb2_grpc.DecodeWorkerServicer):
    def __init__(
        self,
        model,
        tokenizer,
        spec: ModelSpec,
        cfg: DecodeConfig,
        exit_process: Callable[[int], object] = os._exit,
    ) -> None:
        """``exit_process(code)`` ends the process when the decode loop dies (tests pass a recorder);
        ``health`` (set by whoever serves this servicer) is turned NOT_SERVING first."""
        self.cfg = cfg
        self.exit_process = exit_process
        self.health: HealthServicer | None = None
        self.spec = spec
        self.tokenizer = tokenizer
        self.decode_text = text_decoder(tokenizer)
        self.layout = spec.kv_layout
        self.fingerprint = spec.fingerprint
        _, kv_heads, head_dim, dtype = self.layout
        self.kv_cache = KVCache.from_bytes(
            cfg.pool.pool_bytes, cfg.pool.block_size, kv_heads, head_dim, dtype, cfg.device
        )
        num_blocks = self.kv_cache.num_blocks
        policy = AdmissionPolicy.from_config(cfg.pool.admission, cfg.pool.watermark, num_blocks)
        self.pool = BlockManager(num_blocks, cfg.pool.block_size, policy)  # block accounting, admission
        swap = cfg.pool.swap_bytes or cfg.pool.pool_bytes
        runner = ModelRunner(model, self.kv_cache)
        core = DecodeCore(runner, self.pool, self.kv_cache, cfg.pool.max_batch, swap)
        self.engine = DecodeEngine(core, on_death=self._engine_died)
        self.address = ""
        self.draining = False
        self._arrived: dict[str, tuple[Sequence, asyncio.TimerHandle]] = {}
        self._waiters: dict[str, asyncio.Future] = {}
        self._in_transfer: dict[str, KVAssembler] = {}  # request id -> the transfer that carries it
        self._superseded: set[KVAssembler] = set()
        self._exiting: asyncio.Task | None = None  # NOT_SERVING, then exit, once the decode loop died

    async def start(self) -> None:
        self.engine.start()

    async def stop(self) -> None:
        for rid in list(self._arrived):
            self._expire(rid)
        await self.engine.stop()

    def _engine_died(self, exc: BaseException) -> None:
        """The decode loop is gone: take no more work, report NOT_SERVING, then exit the process so Ray
        and the autoscaler replace this worker (a live server with a dead loop would hang every call)."""
        log.critical("decode worker %s: the decode loop died (%r); NOT_SERVING, exiting", self.address, exc)
        self.draining = True
        for rid in list(self._arrived):
            self._expire(rid)
        for fut in self._waiters.values():
            if not fut.done():
                fut.set_exception(self.engine.dead_error())
        self._exiting = asyncio.get_running_loop().create_task(self._exit_after_death())

    async def _exit_after_death(self) -> None:
        try:
            if self.health is not None:
                await self.health.enter_graceful_shutdown()  # every service NOT_SERVING, for good
            await asyncio.sleep(EXIT_GRACE_S)  # the failed streams' statuses reach their callers
        finally:
            self.exit_process(ENGINE_DIED_EXIT_CODE)

    # -- hand-off ------------------------------------------------------------------------------------
    def _check_header(self, header: kv_pb2.KVHeader) -> None:
        """What a header carries beyond the layout, checked against this model before any block is taken:
        the sampling settings, the first token and the EOS ids (all inside the vocabulary)."""
        try:
            sampling_from_proto(header.sampling, self.cfg.limits)
        except InvalidInput as exc:
            raise KVWireError(grpc.StatusCode.INVALID_ARGUMENT, f"bad KV header: {exc.message}") from None
        vocab = self.spec.vocab_size
        if vocab and header.first_token_id >= vocab:
            raise KVWireError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"bad KV header: first_token_id {header.first_token_id} is outside the vocabulary of {vocab}",
            )
        if vocab and any(t >= vocab for t in header.eos_token_ids):
            raise KVWireError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"bad KV header: an eos_token_id is outside the vocabulary of {vocab}",
            )

    def _allocate(self, header: kv_pb2.KVHeader):
        if self.engine.dead is not None:
            raise KVWireError(grpc.StatusCode.UNAVAILABLE, "this decode worker is shutting down")
        self._check_header(header)
        if header.request_id in self._arrived:
            raise KVWireError(
                grpc.StatusCode.ALREADY_EXISTS, f"a cache for {header.request_id!r} is already here"
            )
        earlier = self._in_transfer.get(header.request_id)
        if earlier is not None:  # a retried prefill: its first sender died mid-transfer
            log.warning("request %s: a new transfer supersedes an unfinished one", header.request_id)
            self._superseded.add(earlier)
        got = self.pool.admit(
            list(header.layer_lengths), max(1, header.sampling.max_new_tokens), self.engine.num_swapped
        )
        if isinstance(got, AdmissionRefusal):
            raise KVWireError(grpc.StatusCode.RESOURCE_EXHAUSTED, got.message, _REFUSALS[got.kind])
        return got

    async def TransferKV(self, request_iterator, context):
        assembler = KVAssembler(
            self.fingerprint,
            self.layout,
            allocate=self._allocate,
            release=self.pool.free,
        )
        rid = ""
        try:
            async for chunk in request_iterator:
                if isinstance(chunk, bytes):  # registered through add_decode_servicer
                    assembler.feed_wire(chunk)
                else:  # a KVChunk (a servicer registered with the generated deserializer)
                    assembler.feed(chunk)
                if not rid and assembler.header is not None:
                    rid = assembler.header.request_id
                    logs.request_id.set(rid)
                    self._in_transfer[rid] = assembler
            header, ckv = assembler.finish()
            bad = _non_finite(ckv)
            if bad:
                self.pool.free(assembler.handle)
                raise KVWireError(grpc.StatusCode.INVALID_ARGUMENT, f"the cache holds NaN or inf in {bad}")
            if assembler in self._superseded:
                self.pool.free(assembler.handle)
                raise KVWireError(
                    grpc.StatusCode.ABORTED,
                    f"a newer transfer of {rid!r} superseded this one",
                    Refusal.REFUSAL_SUPERSEDED,
                )
        except KVWireError as exc:
            self._end_transfer(rid, assembler)
            await _drain(request_iterator, DRAIN_LIMIT_BYTES)
            await abort_with(context, exc.code, str(exc), exc.reason)
        except BaseException:
            assembler.abort()
            self._end_transfer(rid, assembler)
            raise
        self._end_transfer(rid, assembler)
        blocks = assembler.handle
        for layer, table in enumerate(blocks.tables):
            self.kv_cache.write(table, ckv.keys[layer], ckv.values[layer])
        try:
            seq = self._make_sequence(header, ckv, blocks)
        except VlkvError as exc:
            self.pool.free(blocks)
            await context.abort(exc.code, exc.message)
        self._deliver(seq)
        return worker_pb2.TransferAck(
            bytes_received=assembler.bytes_received, blocks_allocated=blocks.num_blocks
        )

    def _end_transfer(self, rid: str, assembler: KVAssembler) -> None:
        if self._in_transfer.get(rid) is assembler:
            del self._in_transfer[rid]
        self._superseded.discard(assembler)

    def _make_sequence(self, header: kv_pb2.KVHeader, ckv, blocks) -> Sequence:
        sampling = sampling_from_proto(header.sampling, self.cfg.limits)
        usage = generate_pb2.Usage(
            prompt_tokens=header.prompt_tokens,
            vision_tokens=header.vision_tokens,
            kv_bytes_kept=ckv.nbytes,
            kv_bytes_full=ckv.full_nbytes,
            compression_ratio=ckv.compression_ratio,
            layer_budgets=ckv.layer_lengths,
            policy=header.policy,
        )
        return Sequence(
            request_id=header.request_id,
            blocks=blocks,
            lengths=list(ckv.layer_lengths),
            prompt_length=ckv.prompt_length,
            first_token=header.first_token_id,
            sampling=sampling,
            eos_token_ids=set(header.eos_token_ids),
            usage=usage,
            detok=IncrementalText(self.tokenizer, sampling.stop, self.decode_text),
        )

    def _deliver(self, seq: Sequence) -> None:
        waiter = self._waiters.get(seq.request_id)
        if waiter is not None and not waiter.done():
            waiter.set_result(seq)
            return
        lease = asyncio.get_running_loop().call_later(
            self.cfg.pool.cache_wait_ms / 1000, self._expire, seq.request_id
        )
        self._arrived[seq.request_id] = (seq, lease)

    def _expire(self, request_id: str) -> None:
        entry = self._arrived.pop(request_id, None)
        if entry is not None:
            entry[1].cancel()
            log.warning("request %s: cache not claimed within its lease; freed", request_id)
            self.pool.free(entry[0].blocks)
            self.engine.notify()

    # -- token stream --------------------------------------------------------------------------------
    async def _claim(self, request_id: str, wait_ms: int) -> Sequence:
        entry = self._arrived.pop(request_id, None)
        if entry is not None:
            entry[1].cancel()
            return entry[0]
        if request_id in self._waiters:
            raise VlkvError(
                f"request {request_id!r} is already being decoded", grpc.StatusCode.ALREADY_EXISTS
            )
        fut = asyncio.get_running_loop().create_future()
        self._waiters[request_id] = fut
        try:
            return await asyncio.wait_for(fut, (wait_ms or self.cfg.pool.cache_wait_ms) / 1000)
        except asyncio.TimeoutError:
            raise VlkvError(
                f"the cache of request {request_id!r} did not arrive in time",
                grpc.StatusCode.DEADLINE_EXCEEDED,
            ) from None
        finally:
            self._waiters.pop(request_id, None)

    @abort_stream_on_error
    async def Decode(self, request, context):
        if not request.request_id:
            raise VlkvError("request_id is required", grpc.StatusCode.INVALID_ARGUMENT)
        logs.request_id.set(request.request_id)
        seq = await self._claim(request.request_id, request.wait_ms)
        try:
            self.engine.submit(seq)
            while True:
                kind, *rest = await seq.events.get()
                if kind == "token":
                    ids, text = rest
                    yield generate_pb2.GenerateResponse(
                        request_id=seq.request_id, token=generate_pb2.TokenChunk(token_ids=ids, text=text)
                    )
                elif kind == "finished":
                    yield generate_pb2.GenerateResponse(
                        request_id=seq.request_id,
                        finished=generate_pb2.Finished(reason=rest[0], usage=seq.usage),
                    )
                    return
                else:
                    raise rest[0]
        finally:
            if not seq.done:
                self.engine.cancel(seq)

    async def GetLoad(self, request, context):
        return worker_pb2.WorkerLoad(
            address=self.address,
            running=self.engine.num_running,
            waiting=self.engine.num_waiting + len(self._arrived),
            free_blocks=self.pool.num_free,
            total_blocks=self.pool.num_blocks,
            block_size=self.pool.block_size,
            draining=self.draining,
            model_fingerprint=self.fingerprint,
            admit_blocks=self.pool.admit_room(self.engine.num_swapped),
            reserves_new_tokens=self.pool.reserves_new_tokens,
            swapped=self.engine.num_swapped,
            preemptions=self.engine.preemptions,
        )


def _non_finite(ckv) -> str:
    """Where a received cache holds NaN or inf (``"layer L keys"``), or ``""``: one float64 sum per tensor
    (exact enough that only a NaN or inf makes it non-finite), no copy."""
    for layer, (k, v) in enumerate(zip(ckv.keys, ckv.values, strict=True)):
        for name, t in (("keys", k), ("values", v)):
            if t.numel() and not torch.isfinite(t.sum(dtype=torch.float64)):
                return f"layer {layer} {name}"
    return ""


async def _drain(requests, limit: int) -> None:
    """Read (and drop) what the sender still streams before ending the call with a refusal.

    A status sent while the client is still writing a large message reaches grpcio's client as
    ``INTERNAL: Internal error from Core`` instead of the status; reading the rest first lets the sender see
    the refusal's own code and message (e.g. RESOURCE_EXHAUSTED, which the gateway acts on). Bounded by
    ``limit`` bytes and the call's deadline.
    """
    seen = 0
    async for chunk in requests:
        seen += len(chunk) if isinstance(chunk, bytes) else chunk.ByteSize()
        if seen > limit:
            return


class _CaptureHandlers:
    """Stands in for a server to read the method handlers a generated ``add_*_to_server`` registers."""

    def __init__(self) -> None:
        self.handlers: dict[str, grpc.RpcMethodHandler] = {}

    def add_generic_rpc_handlers(self, handlers) -> None:
        pass

    def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
        self.handlers = dict(handlers)


def add_decode_servicer(servicer: DecodeServicer, server: grpc.aio.Server) -> None:
    """Register the DecodeWorker service as the generated code does, except that ``TransferKV`` gets
    its requests undeserialized (bytes) for the zero-copy ``KVAssembler.feed_wire`` path."""
    capture = _CaptureHandlers()
    worker_pb2_grpc.add_DecodeWorkerServicer_to_server(servicer, capture)
    handlers = capture.handlers
    generated = handlers["TransferKV"]
    handlers["TransferKV"] = grpc.stream_unary_rpc_method_handler(
        generated.stream_unary, request_deserializer=None, response_serializer=generated.response_serializer
    )
    service = worker_pb2.DESCRIPTOR.services_by_name["DecodeWorker"].full_name
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
    server.add_registered_method_handlers(service, handlers)
