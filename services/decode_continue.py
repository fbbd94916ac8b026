"""A conversation's ``continue`` turn on the decode worker's own cache: the gateway's side.

An unverified ``continue`` turn (``keep_plan``: reuse on, ``conversation: continue``, and no verification for
its compression settings) is decoded with a ``retain_key``; when the worker says it kept the cache (the
``vlkv-retained`` trailer), ``Relay.note_kept`` records the turn (``kept_turns.KeptTurns``). The next such
turn whose prompt starts with a kept one runs there (``run_on_kept``): no prefill, no hand-off, the kept
positions it shares and the rest of its prompt fed by the decode worker. A verified turn goes to the prefill worker, whose
verifier decides whether its continued cache holds (``docs/conversations.md``).

The worker may have given the blocks back: ``KeptGone`` before the first token, and the gateway serves the
turn the usual way (the prefill worker's prefix cache still holds the history).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

import grpc
from vlkv.common.compression.registry import DEFAULT_BUDGET
from vlkv.common.compression.verify import VerifyConfig
from vlkv.common.errors import VlkvError
from vlkv.common.request import PreparedRequest
from vlkv.common.reuse import ANONYMOUS, RETAINED_KEY
from vlkv.services.kept_turns import KeptTurn, KeptTurns
from vlkv.services.metrics import GatewayMetrics
from vlkv.v1 import generate_pb2, worker_pb2


@dataclass(frozen=True)
class KeepPlan:
    """A turn whose decode worker is asked to keep its cache: its key, tenant, prompt ids and the position
    from which the cache may be cut back (the conversation's first prompt length)."""

    key: str
    tenant: str
    ids: tuple[int, ...]
    full_from: int
    images: tuple[str, ...] = ()

    @property
    def prompt_tokens(self) -> int:
        return len(self.ids)


class KeptGone(Exception):
    """The kept cache is not there (given back, or its worker left) and nothing was streamed yet."""


def keep_plan(
    req: PreparedRequest, prefill_req: worker_pb2.PrefillRequest, verify: VerifyConfig
) -> KeepPlan | None:
    """The plan of an unverified ``continue`` turn (None for any other request)."""
    if not (req.reuse.enabled and req.reuse.conversation == "continue"):
        return None
    if verify.plan(req.compression) is not None:
        return None
    ids = tuple(prefill_req.input_ids)
    return KeepPlan(uuid.uuid4().hex, req.tenant or ANONYMOUS, ids, len(ids), tuple(prefill_req.image_hashes))


class Relay:
    """One token stream's responses on their way to the client: the caller's id on each, TTFT, inter-token
    latency and tokens counted, the ids streamed collected, and at the end the usage's metrics."""

    def __init__(self, metrics: GatewayMetrics, front: str, start: float, caller_id: str) -> None:
        self.metrics, self.front, self.start, self.caller_id = metrics, front, start, caller_id
        self.last: float | None = None
        self.ttft_ms = 0.0
        self.emitted: list[int] = []

    def see(self, resp: generate_pb2.GenerateResponse) -> None:
        resp.request_id = self.caller_id
        now = time.perf_counter()
        if self.last is None:
            self.ttft_ms = (now - self.start) * 1000
            self.metrics.ttft.labels(self.front).observe(now - self.start)
        elif resp.HasField("token"):
            self.metrics.itl.labels(self.front).observe(now - self.last)
        self.last = now
        if resp.HasField("token"):
            self.metrics.tokens.labels(self.front).inc(len(resp.token.token_ids))
            self.emitted.extend(resp.token.token_ids)

    async def note_kept(self, kept: KeptTurns, call, plan: KeepPlan, address: str) -> bool:
        """Record the turn if the worker kept its cache (its trailer names the positions it holds): the ids at
        those positions are the prompt's and the streamed tokens' (the last one never went in)."""
        trailer = dict(await call.trailing_metadata() or ())
        try:
            positions = int(trailer.get(RETAINED_KEY, 0))
        except ValueError:
            return False
        ids = (plan.ids + tuple(self.emitted))[:positions]
        if positions < plan.full_from or len(ids) != positions:
            return False
        turn = KeptTurn(plan.key, address, plan.tenant, ids, plan.full_from, plan.prompt_tokens, plan.images)
        kept.note(turn)
        self.metrics.kept_turns.labels("kept").inc()
        return True

    def finish(self, usage: generate_pb2.Usage, budget: float) -> None:
        m = self.metrics
        usage.ttft_ms = self.ttft_ms
        m.compression.observe(usage.compression_ratio)
        m.record_verdict(usage, budget)
        m.kv_bytes.inc(usage.kv_bytes_kept)
        m.window_saved.inc(usage.kv_bytes_window_saved)
        m.record_prompt(usage)


async def run_on_kept(
    gateway, found: tuple[KeptTurn, int], plan: KeepPlan, prefill_req, rid: str, start, caller_id, front
):
    """Decode a turn on the kept cache ``found`` (the turn, the positions to keep) and keep it again for the
    next. KeptGone when the worker no longer holds it before anything was streamed."""
    turn, keep_positions = found
    kept: KeptTurns = gateway.router.kept
    kept.drop(turn.key)  # the worker takes it, whatever happens next
    worker = gateway.router.decode.get(turn.address)
    if worker is None or worker.draining or not worker.reachable:
        raise KeptGone
    plan = KeepPlan(plan.key, plan.tenant, plan.ids, turn.full_from, plan.images)  # it starts where it did
    request = worker_pb2.DecodeRequest(
        request_id=rid,
        wait_ms=int(gateway.cfg.transfer.deadline_s * 3000),
        retain_key=plan.key,
        continue_from=worker_pb2.ContinueFrom(
            key=turn.key,
            keep_positions=keep_positions,
            input_ids=plan.ids[keep_positions:],
            sampling=prefill_req.sampling,
            prompt_tokens=len(plan.ids),
            continued_tokens=len(plan.ids) - turn.prompt_tokens,
        ),
    )
    call = worker.stub.Decode(request)
    worker.in_flight += 1
    relay = Relay(gateway.metrics, front, start, caller_id)
    try:
        async for resp in call:
            relay.see(resp)
            if resp.HasField("finished"):
                gateway.metrics.kept_turns.labels("continued").inc()
                relay.finish(resp.finished.usage, prefill_req.compression.budget or DEFAULT_BUDGET)
                await relay.note_kept(kept, call, plan, worker.address)
            yield resp
    except grpc.aio.AioRpcError as exc:
        if relay.last is None:  # nothing streamed: the usual way serves the turn (the entry is dropped)
            raise KeptGone from None
        raise VlkvError(f"the decode worker failed: {exc.details()}", exc.code()) from None
    finally:
        worker.in_flight -= 1
        call.cancel()
