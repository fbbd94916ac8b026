"""The public gRPC front: validate, route, run prefill and decode for a request, stream tokens back.

For each ``Generate`` call the gateway validates everything it can before any worker does work (images,
placeholders, prompt length, sampling and compression parameters), picks a decode worker with room and the
least-loaded prefill worker, opens the decode worker's token stream, and starts the prefill (which hands
the cache to that decode worker). A prefill failure cancels the token stream and ends the call with the
prefill's status; a client that goes away cancels both. A decode worker that refuses the cache for lack of
blocks (the load the gateway chose it on was stale: other requests took the room first) costs one more
pick, waiting in the admission queue, and one more prefill.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid

import grpc
from vlkv.common import logs
from vlkv.common.config import GatewayConfig
from vlkv.common.errors import InvalidInput, Refusal, VlkvError, refusal_of
from vlkv.common.grpc_server import abort_stream_on_error
from vlkv.common.model.spec import ModelSpec
from vlkv.common.request import PreparedRequest, prepare_request, to_prefill_proto
from vlkv.services.metrics import GatewayMetrics
from vlkv.services.router import DecodeSlot, Router
from vlkv.v1 import generate_pb2, generate_pb2_grpc, worker_pb2

log = logging.getLogger(__name__)
MAX_REQUEST_ID = 128
HAND_OFF_ATTEMPTS = 2  # a decode worker that refuses a cache for room gets one more pick (and prefill)


class GatewayServicer(generate_pb2_grpc.GenerationServicer):
    def __init__(self, processor, spec: ModelSpec, cfg: GatewayConfig, router: Router) -> None:
        self.processor = processor
        self.spec = spec
        self.cfg = cfg
        self.router = router
        self.in_flight = 0
        self.requests_total = 0
        self.metrics = GatewayMetrics()

    def _validate(self, request: generate_pb2.GenerateRequest) -> PreparedRequest:
        """The one validation of a request: everything a worker needs, checked before any worker works."""
        if len(request.request_id) > MAX_REQUEST_ID:
            raise InvalidInput(f"request_id is longer than {MAX_REQUEST_ID} characters")
        return prepare_request(
            request, self.processor, self.spec, self.cfg.limits, default_seed=secrets.randbits(62)
        )

    async def _prefill(self, request: worker_pb2.PrefillRequest) -> worker_pb2.PrefillReply:
        """Run the prefill; a worker that is gone (UNAVAILABLE) gets one retry on another worker."""
        tried: set[str] = set()
        while True:
            worker = self.router.pick_prefill(exclude=tried)
            tried.add(worker.address)
            worker.in_flight += 1
            try:
                reply = await worker.stub.Prefill(request, timeout=self.cfg.transfer.deadline_s * 2)
                self.metrics.prefill.observe(reply.prefill_ms / 1000)
                self.metrics.hand_off.observe(reply.transfer_ms / 1000)
                return reply
            except grpc.aio.AioRpcError as exc:
                retry = (
                    exc.code() == grpc.StatusCode.UNAVAILABLE
                    and len(tried) < 2
                    and refusal_of(exc) != Refusal.REFUSAL_HAND_OFF_FAILED  # retrying prefill will not help
                )
                if not retry or not any(a not in tried for a in self.router.prefill):
                    raise
                log.warning(
                    "request %s: prefill worker %s failed (%s); retrying once",
                    request.request_id,
                    worker.address,
                    exc.details(),
                )
            finally:
                worker.in_flight -= 1

    @abort_stream_on_error
    async def Generate(self, request, context):
        async for resp in self.stream(request, front="grpc"):
            yield resp

    async def stream(self, request: generate_pb2.GenerateRequest, *, front: str):
        """One request's responses (token chunks, then ``finished``), counted in the metrics under ``front``
        (``grpc``, ``http``): the one serving path of every public front. Raises VlkvError."""
        start = time.perf_counter()
        self.requests_total += 1
        self.in_flight += 1
        self.metrics.in_flight.labels(front).inc()
        status = "OK"
        try:
            async for resp in self._generate(request, start, front):
                yield resp
        except VlkvError as exc:
            status = exc.code.name
            raise
        except (asyncio.CancelledError, GeneratorExit):  # the client went away
            status = "CANCELLED"
            raise
        finally:
            self.in_flight -= 1
            self.metrics.in_flight.labels(front).dec()
            self.metrics.requests.labels(status, front).inc()

    async def _generate(self, request, start: float, front: str):
        req = self._validate(request)
        rid = req.request_id = request.request_id or uuid.uuid4().hex
        logs.request_id.set(rid)
        layer_tokens = req.compression.layer_tokens_estimate(req.m, self.spec.num_layers)
        sampling = req.sampling
        prefill_req = to_prefill_proto(req, decode_address="")  # serialized once, re-addressed per attempt
        queue = self.cfg.queue
        for attempt in range(HAND_OFF_ATTEMPTS):
            slot = await self.router.pick_decode(
                layer_tokens, sampling.max_new_tokens, queue.admit_wait_s, queue.max_waiting
            )
            prefill_req.decode_address = slot.worker.address
            prefill_req.request_id = rid if attempt == 0 else f"{rid}~{attempt}"  # workers' ids stay unique
            try:
                async for resp in self._run(prefill_req, slot, start, rid, front):
                    yield resp
                return
            except _NoRoom as exc:  # the load it was picked on is stale; the worker's exact count disagreed
                if attempt + 1 == HAND_OFF_ATTEMPTS:
                    raise exc.error from None
                self.metrics.hand_off_retries.inc()
                log.info("request %s: %s; waiting for room again", rid, exc.error.message)

    async def _run(
        self, prefill_req: worker_pb2.PrefillRequest, slot: DecodeSlot, start: float, rid: str, front: str
    ):
        """One attempt: the decode worker's token stream, fed by a prefill that hands its cache there."""
        decode = slot.worker
        deadline = self.cfg.transfer.deadline_s
        decode_call = decode.stub.Decode(
            worker_pb2.DecodeRequest(request_id=prefill_req.request_id, wait_ms=int(deadline * 3000))
        )
        decode.in_flight += 1
        prefill_task = asyncio.ensure_future(self._prefill(prefill_req))
        prefill_task.add_done_callback(lambda t: slot.release())  # the worker's load shows the cache now
        prefill_task.add_done_callback(
            lambda t: t.cancelled() or t.exception() is None or decode_call.cancel()
        )
        last = None
        try:
            async for resp in decode_call:
                resp.request_id = rid
                now = time.perf_counter()
                if last is None:
                    ttft_ms = (now - start) * 1000
                    self.metrics.ttft.labels(front).observe(now - start)
                elif resp.HasField("token"):
                    self.metrics.itl.labels(front).observe(now - last)
                last = now
                if resp.HasField("token"):
                    self.metrics.tokens.labels(front).inc(len(resp.token.token_ids))
                else:
                    usage = resp.finished.usage
                    usage.ttft_ms = ttft_ms
                    self.metrics.compression.observe(usage.compression_ratio)
                    self.metrics.kv_bytes.inc(usage.kv_bytes_kept)
                yield resp
        except (grpc.aio.AioRpcError, asyncio.CancelledError) as exc:
            failure = _prefill_failure(prefill_task)
            if failure is not None:
                if last is None and _refused_for_room(failure):
                    raise _NoRoom(failure) from None
                raise failure from None
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise VlkvError(
                f"decode worker {decode.address} failed: {exc.details()}", _public_code(exc.code())
            ) from None
        finally:
            slot.release()
            decode.in_flight -= 1
            decode_call.cancel()
            if not prefill_task.done():
                prefill_task.cancel()


class _NoRoom(Exception):
    """The chosen decode worker refused the cache for lack of blocks (before any token was streamed)."""

    def __init__(self, error: VlkvError) -> None:
        super().__init__(error.message)
        self.error = error


def _refused_for_room(error: VlkvError) -> bool:
    return error.reason == Refusal.REFUSAL_POOL_FULL


def _public_code(code: grpc.StatusCode) -> grpc.StatusCode:
    """Internal failures a client cannot act on are reported as UNAVAILABLE (retryable)."""
    if code in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL):
        return grpc.StatusCode.UNAVAILABLE
    return code


def _prefill_failure(task: asyncio.Future) -> VlkvError | None:
    if not task.done() or task.cancelled():
        return None
    exc = task.exception()
    if exc is None:
        return None
    if isinstance(exc, grpc.aio.AioRpcError):
        return VlkvError(exc.details() or "prefill failed", _public_code(exc.code()), refusal_of(exc))
    return VlkvError(f"prefill failed: {exc}", grpc.StatusCode.UNAVAILABLE)
