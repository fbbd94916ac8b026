"""The public gRPC front: validate, route, run prefill and decode for a request, stream tokens back.

For each ``Generate`` call the gateway validates everything it can before any worker does work (images,
placeholders, prompt length, sampling and compression parameters), picks a decode worker with room and the
least-loaded prefill worker, opens the decode worker's token stream, and starts the prefill (which hands
the cache to that decode worker). A prefill failure cancels the token stream and ends the call with the
prefill's status; a client that goes away cancels both. A decode worker that refuses the cache for lack of
blocks (the load the gateway chose it on was stale: other requests, or other gateways, took the room
first) costs one more pick, waiting in the admission queue, and one more prefill, for as long as the
request's admission wait (``queue.admit_wait_s``) lasts: several gateways may share the workers. A decode
worker that fails (UNAVAILABLE: dead, hung, removed) before the request's first token costs one more pick
and prefill too, once, with a fresh admission wait: the client saw nothing yet.

Validation (image decoding, the processor, tokenizing) is CPU-bound and runs in a small thread pool, never
on the event loop, so a large request does not stall the others. Workers see only ids the gateway draws
(the caller's ``request_id`` is echoed back, never used inside), and what reaches the client is one of the
documented public codes (``PUBLIC_CODES``) with a message that names no internal address; the full
internal message goes to the log.
"""

from __future__ import annotations

import asyncio
import logging
import re
import secrets
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc
from vlkv.common import logs
from vlkv.common.compression.registry import DEFAULT_BUDGET
from vlkv.common.config import GatewayConfig
from vlkv.common.errors import InvalidInput, Refusal, ResourceExhausted, VlkvError, refusal_of
from vlkv.common.grpc_server import abort_stream_on_error
from vlkv.common.model.spec import ModelSpec
from vlkv.common.request import MAX_REQUEST_ID, PreparedRequest, prepare_request, to_prefill_proto
from vlkv.common.reuse import ANONYMOUS, TENANT_KEY, tenant_of
from vlkv.services.decode_continue import KeepPlan, KeptGone, Relay, keep_plan, run_on_kept
from vlkv.services.metrics import GatewayMetrics
from vlkv.services.prefix_index import route_keys
from vlkv.services.router import Reservation, Router
from vlkv.v1 import generate_pb2, generate_pb2_grpc, worker_pb2

log = logging.getLogger(__name__)
# A decode worker that refuses a cache for room (another gateway took it first, or the load was stale): the
# request waits in the admission queue again (and is prefilled again) until its admission wait is spent.
PREPARE_THREADS = 4  # requests validated at once (image decoding, processor); the rest wait their turn
Code = grpc.StatusCode
# The codes a public call can end with (docs/api.md "Public API"); CANCELLED only when the client cancels.
PUBLIC_CODES = frozenset(
    {
        Code.INVALID_ARGUMENT,
        Code.RESOURCE_EXHAUSTED,
        Code.UNAVAILABLE,
        Code.DEADLINE_EXCEEDED,
        Code.UNAUTHENTICATED,
        Code.CANCELLED,
    }
)
# A worker's other codes, as the client sees them: the request's own data is to blame (INVALID_ARGUMENT),
# or the service failed it (UNAVAILABLE, retryable). A worker's UNAUTHENTICATED or CANCELLED is the
# cluster's business, never the client's.
_WORKER_CODES = {
    Code.OUT_OF_RANGE: Code.INVALID_ARGUMENT,
    Code.INVALID_ARGUMENT: Code.INVALID_ARGUMENT,
    Code.RESOURCE_EXHAUSTED: Code.RESOURCE_EXHAUSTED,
    Code.DEADLINE_EXCEEDED: Code.DEADLINE_EXCEEDED,
}
_ADDRESS = re.compile(
    r"(?:ipv4:|ipv6:|dns:/*)?"
    r"(?:\[[0-9A-Fa-f:.%]+\](?::\d+)?|\b(?:\d{1,3}\.){3}\d{1,3}(?::\d+)?\b|\blocalhost:\d+\b"
    r"|\b[\w-]+(?:\.[\w-]+)+:\d{1,5}\b)"
    r"|\bunix:[^\s,;'\"]+"
)


class GatewayServicer(generate_pb2_grpc.GenerationServicer):
    def __init__(self, processor, spec: ModelSpec, cfg: GatewayConfig, router: Router) -> None:
        self.processor = processor
        self.spec = spec
        self.cfg = cfg
        self.router = router
        self.in_flight = 0
        self.requests_total = 0
        self.metrics = GatewayMetrics()
        self._prepare_pool = ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="vlkv-validate")

    async def stop(self) -> None:
        self._prepare_pool.shutdown(wait=False, cancel_futures=True)

    def tenant(self, authorization: str) -> str:
        """The image cache's tenant of a caller: its API token's identity (one anonymous tenant without)."""
        return tenant_of(authorization) if self.cfg.security.api_token else ANONYMOUS

    async def _validate(
        self, request: generate_pb2.GenerateRequest, tenant: str = ANONYMOUS
    ) -> PreparedRequest:
        """The one validation of a request: everything a worker needs, checked before any worker works,
        in the validation thread pool (never on the event loop)."""
        if len(request.request_id) > MAX_REQUEST_ID:
            raise InvalidInput(f"request_id is longer than {MAX_REQUEST_ID} characters")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._prepare_pool,
            lambda: prepare_request(
                request,
                self.processor,
                self.spec,
                self.cfg.limits,
                default_seed=secrets.randbits(62),
                tenant=tenant,
            ),
        )

    async def _prefill(self, request: worker_pb2.PrefillRequest, tenant: str) -> worker_pb2.PrefillReply:
        """Run the prefill; a worker that is gone (UNAVAILABLE) gets one retry on another worker. The
        caller's ``tenant`` travels in the call's metadata (``TENANT_KEY``), beside the internal token."""
        tried: set[str] = set()
        images = tuple(request.image_hashes)
        metadata = ((TENANT_KEY, tenant),)
        reuse = request.reuse.reuse != "off"
        prefix = (
            tuple(route_keys(request.input_ids, images, self.spec.image_token_id, tenant)) if reuse else ()
        )
        while True:
            worker = self.router.pick_prefill(exclude=tried, images=images, tenant=tenant, prefix=prefix)
            tried.add(worker.address)
            worker.in_flight += 1
            try:
                try:
                    reply = await worker.stub.Prefill(
                        request, timeout=self.cfg.transfer.deadline_s * 2, metadata=metadata
                    )
                except asyncio.CancelledError:
                    if not _cancelled_under_us():
                        raise
                    raise grpc.aio.AioRpcError(  # as if the worker had gone: retried once elsewhere
                        grpc.StatusCode.UNAVAILABLE, None, None, "the prefill worker was removed"
                    ) from None
                self.metrics.prefill.observe(reply.prefill_ms / 1000)
                self.metrics.hand_off.observe(reply.transfer_ms / 1000)
                if images:
                    self.metrics.image_cache.labels("hit" if reply.image_cache_hit else "miss").inc()
                    if reuse:
                        self.router.note_images(worker.address, images, tenant)
                if prefix:
                    self.router.note_prefix(worker.address, prefix)
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
        metadata = dict(context.invocation_metadata() or ())
        tenant = self.tenant(str(metadata.get("authorization", "")))
        async for resp in self.stream(request, front="grpc", tenant=tenant):
            yield resp

    async def stream(self, request: generate_pb2.GenerateRequest, *, front: str, tenant: str = ANONYMOUS):
        """One request's responses (token chunks, then ``finished``), counted in the metrics under ``front``
        (``grpc``, ``http``): the one serving path of every public front; ``tenant``: the caller (``tenant``), whose
        images' cache entries are its own. Raises VlkvError."""
        start = time.perf_counter()
        self.requests_total += 1
        self.in_flight += 1
        self.metrics.in_flight.labels(front).inc()
        status = "OK"
        try:
            async for resp in self._generate(request, start, front, tenant):
                yield resp
        except VlkvError as exc:
            public = self._public_error(exc)
            status = public.code.name
            raise public from None
        except asyncio.CancelledError:
            if not _cancelled_under_us():  # the client went away
                status = "CANCELLED"
                raise
            # A call inside was cancelled, not this request (a removed worker's channel closed under it):
            # a retryable failure the client is told of (a handler that raised CancelledError left it open).
            log.warning("request failed: an internal call was cancelled (a worker left the router)")
            status = Code.UNAVAILABLE.name
            raise VlkvError("a worker left the service during the request", Code.UNAVAILABLE) from None
        except GeneratorExit:  # the client went away
            status = "CANCELLED"
            raise
        except Exception:  # a bug: logged with its trace; the client gets a retryable status, no internals
            log.exception("request failed in the gateway")
            status = Code.UNAVAILABLE.name
            raise VlkvError("the request failed inside the service", Code.UNAVAILABLE) from None
        finally:
            self.in_flight -= 1
            self.metrics.in_flight.labels(front).dec()
            self.metrics.requests.labels(status, front).inc()

    def _public_error(self, exc: VlkvError) -> VlkvError:
        """``exc`` as the client may see it: a documented code, no internal address in the message."""
        code = exc.code if exc.code in PUBLIC_CODES else Code.UNAVAILABLE
        message = redact_addresses(exc.message, [*self.router.prefill, *self.router.decode])
        if code == exc.code and message == exc.message:
            return exc
        log.warning("request failed: %s: %s (answered %s)", exc.code.name, exc.message, code.name)
        return VlkvError(message, code, exc.reason)

    async def _generate(self, request, start: float, front: str, tenant: str = ANONYMOUS):
        # Workers key everything on this id, drawn here: two callers (or one caller twice) choosing the
        # same request_id never meet inside. The caller's id is only echoed back in the responses.
        rid = uuid.uuid4().hex
        caller_id = request.request_id or rid
        logs.request_id.set(rid)
        if request.request_id:
            log.info("request %s: caller's request_id %r", rid, request.request_id[:MAX_REQUEST_ID])
        req = await self._validate(request, tenant)
        req.request_id = rid
        layer_tokens = req.compression.layer_tokens_estimate(req.m, self.spec.num_layers)
        sampling = req.sampling
        prefill_req = to_prefill_proto(req, decode_address="")  # serialized once, re-addressed per attempt
        keep = keep_plan(req, prefill_req, self.cfg.verify)
        found = self.router.kept.find(keep.tenant, keep.ids, keep.images) if keep is not None else None
        if found is not None:
            try:
                async for resp in run_on_kept(self, found, keep, prefill_req, rid, start, caller_id, front):
                    yield resp
                return
            except KeptGone:  # the worker gave the blocks back (or left) before the first token
                self.metrics.kept_turns.labels("gone").inc()
        queue = self.cfg.queue
        loop = asyncio.get_running_loop()
        give_up = loop.time() + queue.admit_wait_s
        attempt = 0
        lost: VlkvError | None = None  # a decode worker failed before the first token: retried once
        while True:
            wait_s = queue.admit_wait_s if attempt == 0 else max(give_up - loop.time(), 0.0)
            try:
                slot = await self.router.pick_decode(
                    layer_tokens, sampling.max_new_tokens, wait_s, queue.max_waiting
                )
            except ResourceExhausted:
                if lost is not None:
                    raise lost from None
                if attempt == 0:
                    raise
                msg = f"no decode worker had room for this request within {queue.admit_wait_s:g} s"
                raise ResourceExhausted(msg) from None
            prefill_req.decode_address = slot.worker.address
            prefill_req.request_id = rid if attempt == 0 else f"{rid}~{attempt}"  # workers' ids stay unique
            try:
                async for resp in self._run(
                    prefill_req, slot, start, caller_id, front, req.tenant or ANONYMOUS, keep
                ):
                    yield resp
                return
            except _NoRoom as exc:  # the load it was picked on is stale; the worker's exact count disagreed
                attempt += 1
                self.router.note_refusal(slot.worker)
                if loop.time() >= give_up:
                    raise exc.error from None
                self.metrics.hand_off_retries.inc()
                log.info("request %s: %s; waiting for room again", rid, exc.error.message)
            except _DecodeLost as exc:  # nothing reached the client yet: once more, on a worker with room
                if lost is not None:
                    raise exc.error from None
                lost, attempt = exc.error, attempt + 1
                self.router.note_lost(slot.worker)  # its last report may still look fresh: not drawn again
                give_up = loop.time() + queue.admit_wait_s
                log.warning("request %s: %s; retrying once on another decode worker", rid, exc.error.message)

    async def _run(
        self,
        prefill_req: worker_pb2.PrefillRequest,
        slot: Reservation,
        start: float,
        caller_id: str,
        front: str,
        tenant: str = ANONYMOUS,
        keep: KeepPlan | None = None,
    ):
        """One attempt: the decode worker's token stream, fed by a prefill that hands its cache there;
        responses carry the caller's id. ``keep``: the decode worker is asked to keep the cache for the
        conversation's next turn (``kept_turns.py``)."""
        decode = slot.worker
        deadline = self.cfg.transfer.deadline_s
        decode_call = decode.stub.Decode(
            worker_pb2.DecodeRequest(
                request_id=prefill_req.request_id,
                wait_ms=int(deadline * 3000),
                retain_key=keep.key if keep is not None else "",
            )
        )
        decode.in_flight += 1
        prefill_task = asyncio.ensure_future(self._prefill(prefill_req, tenant))
        prefill_task.add_done_callback(
            lambda t: slot.settle()
        )  # cache arrived or never will: ends at the next report
        prefill_task.add_done_callback(
            lambda t: t.cancelled() or t.exception() is None or decode_call.cancel()
        )
        relay = Relay(self.metrics, front, start, caller_id)
        try:
            async for resp in decode_call:
                relay.see(resp)
                if resp.HasField("finished"):
                    usage = resp.finished.usage
                    await _add_reuse_usage(usage, prefill_task)
                    relay.finish(usage, prefill_req.compression.budget or DEFAULT_BUDGET)
                    if keep is not None:
                        await relay.note_kept(self.router.kept, decode_call, keep, decode.address)
                yield resp
        except (grpc.aio.AioRpcError, asyncio.CancelledError) as exc:
            last = relay.last
            failure = _prefill_failure(prefill_task)
            if failure is not None:
                if last is None and _refused_for_room(failure):
                    raise _NoRoom(failure) from None
                if last is None and failure.reason == Refusal.REFUSAL_HAND_OFF_FAILED:
                    raise _DecodeLost(failure) from None
                raise failure from None
            if isinstance(exc, asyncio.CancelledError):
                if not _cancelled_under_us():
                    raise  # the client went away
                error = VlkvError("the decode worker was removed", grpc.StatusCode.UNAVAILABLE)
            else:
                error = VlkvError(f"the decode worker failed: {exc.details()}", _public_code(exc.code()))
            log.warning("decode worker %s failed: %s", decode.address, error.message)
            if last is None and error.code == grpc.StatusCode.UNAVAILABLE:
                raise _DecodeLost(error) from None
            raise error from None
        finally:
            slot.settle()
            decode.in_flight -= 1
            decode_call.cancel()
            if not prefill_task.done():
                prefill_task.cancel()


class _NoRoom(Exception):
    """The chosen decode worker refused the cache for lack of blocks (before any token was streamed)."""

    def __init__(self, error: VlkvError) -> None:
        super().__init__(error.message)
        self.error = error


class _DecodeLost(Exception):
    """The chosen decode worker failed (or its hand-off did) before any token was streamed."""

    def __init__(self, error: VlkvError) -> None:
        super().__init__(error.message)
        self.error = error


def _refused_for_room(error: VlkvError) -> bool:
    return error.reason == Refusal.REFUSAL_POOL_FULL


def _public_code(code: grpc.StatusCode) -> grpc.StatusCode:
    """A worker's status as the client sees it (``_WORKER_CODES``): anything but the request's own fault,
    the pool's room or a deadline is reported as UNAVAILABLE (retryable)."""
    return _WORKER_CODES.get(code, Code.UNAVAILABLE)


def redact_addresses(message: str, known: list[str]) -> str:
    """``message`` without internal addresses: the ``known`` worker addresses and anything shaped like a
    host:port, an IP address or a unix socket (grpcio's own details name the peer it failed to reach)."""
    for address in sorted(known, key=len, reverse=True):
        if address:
            message = message.replace(address, "<worker>")
    return _ADDRESS.sub("<worker>", message)


async def _add_reuse_usage(usage: generate_pb2.Usage, prefill_task: asyncio.Future) -> None:
    """The image cache's figures of the prefill and the compression profile it used (its reply comes right
    after the hand-off it fed)."""
    try:
        reply = await asyncio.shield(prefill_task)
    except Exception:  # noqa: BLE001 - the prefill's failure is reported by the caller, not here
        return
    usage.image_cache_hit = reply.image_cache_hit
    usage.recomputed_image_tokens = reply.recomputed_image_tokens
    usage.recompute_ratio = reply.recompute_ratio
    usage.compression_profile = reply.compression_profile
    for name in PREFILL_USAGE_FIELDS:
        setattr(usage, name, getattr(reply, name))
    if usage.continued_tokens:
        usage.continued_on = "prefill"  # the prefill worker's kept compact cache, handed off again


PREFILL_USAGE_FIELDS = (
    "verify",
    "verified_candidate",
    "verified_agreement",
    "verified_kl",
    "budget_raises",
    "floor_met",
    "verified_budget",
    "draft_tokens",
    "kv_bytes_window_saved",
    "cached_prompt_tokens",
    "continued_tokens",
    "continue_refused",
)


def _cancelled_under_us() -> bool:
    """Whether a CancelledError came from the call, not from this task's cancellation: the router closes a
    removed worker's channel, which cancels the calls still open on it. Those requests failed (UNAVAILABLE);
    they were not cancelled by their client."""
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)  # Python 3.11+
    return task is not None and cancelling is not None and cancelling() == 0


def _prefill_failure(task: asyncio.Future) -> VlkvError | None:
    if not task.done() or task.cancelled():
        return None
    exc = task.exception()
    if exc is None:
        return None
    if isinstance(exc, grpc.aio.AioRpcError):
        return VlkvError(exc.details() or "prefill failed", _public_code(exc.code()), refusal_of(exc))
    return VlkvError(f"prefill failed: {exc}", grpc.StatusCode.UNAVAILABLE)
