"""The decode worker's gRPC service.

A request's compact cache arrives through ``TransferKV`` (``grpc_receiver.GrpcKVReceiver``) or
``TransferKVNixl`` (``nixl_receiver.NixlKVReceiver``), both through one ``admission.Admission`` (admit ->
write -> arrive), and its tokens leave through ``Decode`` (to the gateway); the two meet on the request id
in either order (``rendezvous.Rendezvous``). Pool blocks are reserved when the header is admitted,
released on any transfer failure, and a cache that no ``Decode`` call claims within its lease is freed;
one whose ``Decode`` call already ended is freed at once.

Everything a header carries is checked against this model before a block is taken (``Admission.admit``),
and a cache holding NaN or inf is refused as it arrives: INVALID_ARGUMENT, so one bad sequence never
reaches the batch it would break. Should the decode loop die,
the worker fails its sequences with UNAVAILABLE, turns NOT_SERVING and exits (``exit_process``) to be
replaced.

``TransferKV`` takes its messages as raw bytes (register the servicer with ``add_decode_servicer``, not
the generated ``add_DecodeWorkerServicer_to_server``): ``KVStreamReader.feed_wire`` reads data chunks
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
from vlkv.common import logs
from vlkv.common.config import DecodeConfig
from vlkv.common.errors import VlkvError
from vlkv.common.grpc_server import abort_stream_on_error
from vlkv.common.handoff.nixl_agent import NixlAgent
from vlkv.common.load_stream import LoadStream
from vlkv.common.model.spec import ModelSpec
from vlkv.common.request import sampling_from_proto
from vlkv.decode_worker.admission import Admission
from vlkv.decode_worker.core import DecodeCore
from vlkv.decode_worker.engine import DecodeEngine
from vlkv.decode_worker.grpc_receiver import GrpcKVReceiver
from vlkv.decode_worker.nixl_receiver import NixlKVReceiver
from vlkv.decode_worker.rendezvous import Rendezvous
from vlkv.decode_worker.retention import RETAINED_KEY, continued_sequence
from vlkv.decode_worker.sequence import FINISH_REASON_PROTO, Sequence
from vlkv.v1 import generate_pb2, worker_pb2, worker_pb2_grpc

if TYPE_CHECKING:
    from grpc_health.v1._async import HealthServicer

log = logging.getLogger(__name__)
ENGINE_DIED_EXIT_CODE = 70  # EX_SOFTWARE: the decode loop died; the process exits to be replaced
EXIT_GRACE_S = 0.5
MAX_RETAIN_KEY = 128  # characters of a retain_key kept (the gateway's are 32)


class DecodeServicer(worker_pb2_grpc.DecodeWorkerServicer):
    def __init__(
        self,
        model,
        tokenizer,
        spec: ModelSpec,
        cfg: DecodeConfig,
        exit_process: Callable[[int], object] = os._exit,
        nixl: NixlAgent | None = None,
    ) -> None:
        """``exit_process(code)`` ends the process when the decode loop dies (tests pass a recorder);
        ``health`` (set by whoever serves this servicer) is turned NOT_SERVING first; ``nixl``: the agent
        to register the pool with and offer ``TransferKVNixl`` through (None: gRPC hand-offs only)."""
        self.cfg = cfg
        self.exit_process = exit_process
        self.health: HealthServicer | None = None
        self.spec = spec
        self.layout = spec.kv_layout
        self.fingerprint = spec.fingerprint
        core = DecodeCore.from_config(model, spec, cfg.pool, cfg.transfer.kv_dtype, cfg.device)
        self.kv_cache = core.cache
        self.pool = core.blocks  # block accounting, admission
        self.engine = DecodeEngine(core, on_death=self._engine_died)
        self.address = ""
        self.draining = False
        t = cfg.transfer
        self.rendezvous: Rendezvous[Sequence] = Rendezvous(
            self._free_unclaimed,
            claim_wait_s=cfg.pool.cache_wait_ms / 1000,
            unclaimed_lease_s=t.unclaimed_lease_s,
            max_unclaimed_per_sender=t.max_unclaimed_per_sender,
        )
        self.receiver = Admission(  # the receiving side both transports share (admit -> write -> arrive)
            core, spec, self.rendezvous, limits=cfg.limits, transfer=t, tokenizer=tokenizer
        )
        self.grpc_receiver = GrpcKVReceiver(self.receiver)
        self.nixl_receiver = NixlKVReceiver(self.receiver, nixl)
        self._exiting: asyncio.Task | None = None  # NOT_SERVING, then exit, once the decode loop died
        self.load_stream = LoadStream()  # WatchLoad: the load pushed to the gateways

    async def start(self) -> None:
        self.engine.start()

    async def stop(self) -> None:
        self.load_stream.close()
        self.rendezvous.expire_all()
        await self.engine.stop()

    def _free_unclaimed(self, seq: Sequence) -> None:
        self.pool.free(seq.blocks)
        self.engine.notify()

    def _engine_died(self, exc: BaseException) -> None:
        """The decode loop is gone: take no more work, report NOT_SERVING, then exit the process so Ray
        and the autoscaler replace this worker (a live server with a dead loop would hang every call)."""
        log.critical("decode worker %s: the decode loop died (%r); NOT_SERVING, exiting", self.address, exc)
        self.draining = True
        self.receiver.closed = VlkvError("this decode worker is shutting down", grpc.StatusCode.UNAVAILABLE)
        self.rendezvous.expire_all()
        self.rendezvous.fail_waiters(self.engine.dead_error())
        self._exiting = asyncio.get_running_loop().create_task(self._exit_after_death())

    async def _exit_after_death(self) -> None:
        try:
            if self.health is not None:
                await self.health.enter_graceful_shutdown()  # every service NOT_SERVING, for good
            await asyncio.sleep(EXIT_GRACE_S)  # the failed streams' statuses reach their callers
        finally:
            self.exit_process(ENGINE_DIED_EXIT_CODE)

    # -- hand-off ------------------------------------------------------------------------------------
    async def TransferKV(self, request_iterator, context):
        return await self.grpc_receiver.receive(request_iterator, context)

    async def TransferKVNixl(self, request_iterator, context):
        async for reply in self.nixl_receiver.receive(request_iterator, context):
            yield reply

    # -- token stream --------------------------------------------------------------------------------
    @abort_stream_on_error
    async def Decode(self, request, context):
        if not request.request_id:
            raise VlkvError("request_id is required", grpc.StatusCode.INVALID_ARGUMENT)
        logs.request_id.set(request.request_id)
        if request.HasField("continue_from"):
            seq = self._continued(request)
            await self._feed(seq)
        else:
            seq = await self._claim(request)
        seq.retain_key = request.retain_key[:MAX_RETAIN_KEY]
        try:
            out = self.engine.submit(seq)
            while (delta := await out.get()) is not None:
                chunk = generate_pb2.TokenChunk(token_ids=delta.token_ids, text=delta.text)
                yield generate_pb2.GenerateResponse(request_id=seq.request_id, token=chunk)
            if seq.error is not None:
                raise seq.error
            if seq.retained_positions:
                context.set_trailing_metadata(((RETAINED_KEY, str(seq.retained_positions)),))
            finished = generate_pb2.Finished(reason=FINISH_REASON_PROTO[seq.finish_reason], usage=seq.usage)
            yield generate_pb2.GenerateResponse(request_id=seq.request_id, finished=finished)
        finally:
            if not seq.finished:
                self.engine.cancel(seq)

    async def _feed(self, seq: Sequence) -> None:
        """A continued turn's prompt tokens in one forward (``DecodeCore.feed``), in the model's thread, when
        it can; else, or if the forward fails, its first steps feed them. Cancelled: its blocks go back to
        the pool once the forward no longer writes them."""
        core = self.engine.core
        if not core.can_feed(seq):
            return
        done = asyncio.ensure_future(self.engine.run_model(core.feed, seq))
        try:
            await asyncio.shield(done)
        except asyncio.CancelledError:  # the gateway gave up: free the blocks when the forward is over
            done.add_done_callback(lambda _: self.pool.free(seq.blocks))
            raise
        except Exception:  # e.g. out of memory: ``feed`` changed nothing of ``seq``; its steps feed them
            log.warning(
                "request %s: one-forward feed failed; feeding step by step", seq.request_id, exc_info=True
            )

    async def _claim(self, request: worker_pb2.DecodeRequest) -> Sequence:
        """The sequence whose cache a prefill worker hands off (or has) under the request's id."""
        try:
            return await self.rendezvous.claim(request.request_id, request.wait_ms / 1000)
        except VlkvError as exc:
            if exc.code != grpc.StatusCode.ALREADY_EXISTS:
                self.rendezvous.abandon(request.request_id)
            raise
        except (
            asyncio.CancelledError
        ):  # the gateway gave up (client cancel): free the cache whenever it comes
            self.rendezvous.abandon(request.request_id)
            raise

    def _continued(self, request: worker_pb2.DecodeRequest) -> Sequence:
        """A follow-up turn on a cache this worker kept (``retention.py``); FAILED_PRECONDITION when it
        holds the key no longer or the turn could never finish in its pool (the gateway then serves it the
        usual way), INVALID_ARGUMENT for a turn that does not fit the kept cache."""
        c = request.continue_from
        if self.draining:
            raise VlkvError("this decode worker is draining", grpc.StatusCode.UNAVAILABLE)
        sampling = sampling_from_proto(c.sampling, self.cfg.limits)
        vocab = getattr(self.spec, "vocab_size", 0)
        if vocab and any(t >= vocab for t in c.input_ids):
            raise VlkvError(
                f"an input id is outside the vocabulary of {vocab}", grpc.StatusCode.INVALID_ARGUMENT
            )
        detok = self.receiver.detokenizer(sampling)
        entry = self.engine.core.retained.take(c.key)
        if entry is None:
            raise VlkvError(
                "the kept cache is gone (its blocks were needed)", grpc.StatusCode.FAILED_PRECONDITION
            )
        seq = continued_sequence(
            entry,
            self.pool,
            request_id=request.request_id,
            keep_positions=c.keep_positions,
            input_ids=list(c.input_ids),
            sampling=sampling,
            prompt_tokens=c.prompt_tokens,
            continued_tokens=c.continued_tokens,
            detok=detok,
            token_bytes=self.kv_cache.token_bytes,
            full_token_bytes=self.receiver.full_token_bytes,
        )
        self.engine.core.retained.continued += 1
        return seq

    async def GetLoad(self, request, context):
        return self.load()

    async def WatchLoad(self, request, context):
        """``load()`` pushed to a gateway: at once, on change and at least every second."""
        async for report in self.load_stream.watch(self.load):
            yield report

    def load(self) -> worker_pb2.WorkerLoad:
        return worker_pb2.WorkerLoad(
            address=self.address,
            running=self.engine.num_running,
            waiting=self.engine.num_waiting + self.rendezvous.num_unclaimed,
            free_blocks=self.pool.num_free,
            total_blocks=self.pool.num_blocks,
            block_size=self.pool.block_size,
            draining=self.draining,
            model_fingerprint=self.fingerprint,
            admit_blocks=self.pool.admit_room(self.engine.num_swapped),
            reserves_new_tokens=self.pool.reserves_new_tokens,
            swapped=self.engine.num_swapped,
            preemptions=self.engine.preemptions,
            kv_dtype=self.kv_cache.kv_dtype,
            block_bytes=self.kv_cache.block_bytes,
            retained=len(self.engine.core.retained),
            retained_blocks=self.engine.core.retained.held,
        )


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
    its requests undeserialized (bytes) for the zero-copy ``KVStreamReader.feed_wire`` path."""
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
