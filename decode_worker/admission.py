"""Where every cache enters a decode core: admit -> write -> arrive, the same for every transport.

``Admission.admit(header)`` checks the header once (``validate_header``: sanity, fingerprint, layout, kv
dtype; then the sampling settings, the first token and the EOS ids against this model), asks the arrivals
whether the request may hand over a cache now, takes its blocks under the admission policy (refusals
carry their ``worker_pb2.Refusal`` reason) and builds its ``Sequence`` (``WAITING_FOR_KV``, its usage, its
detokenizer, its accumulated mass seeded from the header's prompt-time scores). The transport then writes
the K/V into the sequence's blocks (``grpc_receiver.py`` chunk by chunk as they arrive, ``nixl_receiver.py``
by one-sided writes, ``deploy/inprocess.py`` a whole ``CompactKV`` through ``write_cache``) and calls
``arrive(seq)``: the sequence turns ``WAITING`` and goes to its arrivals (the server's ``Rendezvous``, where
its ``Decode`` call claims it; ``LocalArrivals`` for the in-process engine and the tools' receiver). A
transport that fails after ``admit`` calls ``release(seq)``, which frees the blocks.

Limits on what one sender can hold (issue 15, enforced by the transports through ``enter``/``leave`` and
``next_message``): at most ``max_transfers`` hand-offs at once (more are refused with RESOURCE_EXHAUSTED);
each ends at ``deadline_s`` and when no message comes for ``idle_s``; a refused gRPC sender is drained of
at most ``drain_bytes`` so it sees the refusal's own status, with at most ``MAX_DRAINING`` drains at once;
a sender may park ``max_unclaimed_per_sender`` caches nobody claims, each for ``unclaimed_lease_s``.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import Protocol

import grpc
from vlkv.common.config import Limits, TransferConfig
from vlkv.common.errors import InvalidInput, Refusal, VlkvError
from vlkv.common.handoff.assembler import validate_header
from vlkv.common.handoff.compact_kv import CompactKV
from vlkv.common.handoff.transport import Transfer
from vlkv.common.handoff.wire import KVWireError, compact_layers
from vlkv.common.request import sampling_from_proto
from vlkv.decode_worker.block_manager import AdmissionRefusal, RefusalKind
from vlkv.decode_worker.core import DecodeCore
from vlkv.decode_worker.detokenizer import IncrementalText, text_decoder
from vlkv.decode_worker.sequence import FinishReason, Sequence, SequenceStatus, kv_usage
from vlkv.v1 import generate_pb2, kv_pb2

MAX_DRAINING = 4
_REFUSALS = {  # the block manager's refusal kinds as the wire's machine-readable reasons
    RefusalKind.POOL_FULL: Refusal.REFUSAL_POOL_FULL,
    RefusalKind.NEVER_FITS: Refusal.REFUSAL_NEVER_FITS,
}
_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
_INVALID = grpc.StatusCode.INVALID_ARGUMENT


class Arrivals(Protocol):
    """Where admitted caches go: ``rendezvous.Rendezvous`` on a server, ``LocalArrivals`` in one process."""

    def check_new(self, rid: str) -> None: ...
    def may_park(self, rid: str, sender: str) -> bool: ...
    def begin_transfer(self, rid: str, transfer: Transfer) -> None: ...
    def end_transfer(self, rid: str, transfer: Transfer) -> None: ...
    def superseded(self, transfer: Transfer) -> bool: ...
    def deliver(self, seq: Sequence, sender: str = "") -> bool: ...


class LocalArrivals:
    """Arrived sequences in a queue, for whoever drives the core itself (``InProcessEngine``, tools)."""

    def __init__(self) -> None:
        self.arrived: deque[Sequence] = deque()

    def check_new(self, rid: str) -> None:
        pass

    def may_park(self, rid: str, sender: str) -> bool:
        return True

    def begin_transfer(self, rid: str, transfer: Transfer) -> None:
        pass

    def end_transfer(self, rid: str, transfer: Transfer) -> None:
        pass

    def superseded(self, transfer: Transfer) -> bool:
        return False

    def deliver(self, seq: Sequence, sender: str = "") -> bool:
        self.arrived.append(seq)
        return True


class Admission:
    def __init__(
        self,
        core: DecodeCore,
        spec,
        arrivals: Arrivals,
        *,
        limits: Limits | None = None,
        transfer: TransferConfig | None = None,
        tokenizer=None,
    ) -> None:
        """``spec``: the served model's ``ModelSpec`` (fingerprint, kv layout, vocabulary);
        ``tokenizer``: detokenizes (and finds stop strings) for the sequences it builds (None: ids only)."""
        self.core = core
        self.spec = spec
        self.arrivals = arrivals
        self.limits = limits or Limits()
        self.t = transfer or TransferConfig()
        self.tokenizer = tokenizer
        self._decode_text = text_decoder(tokenizer) if tokenizer is not None else None
        self.closed: VlkvError | None = None  # set when the worker stops taking caches
        self.active = 0  # hand-offs in progress
        self.draining = 0  # refused gRPC senders being drained
        self.received = {"grpc": 0, "nixl": 0, "local": 0}  # caches arrived, per transport

    @property
    def cache(self):
        return self.core.cache

    # -- admit ---------------------------------------------------------------------------------------
    def admit(self, header: kv_pb2.KVHeader, sender: str = "", transfer: Transfer | None = None) -> Sequence:
        """Check ``header`` (once), take its blocks and build its sequence; KVWireError with the refusal
        otherwise (nothing taken)."""
        if self.closed is not None:
            raise KVWireError(self.closed.code, self.closed.message)
        checked = validate_header(
            header, self.spec.fingerprint, self.spec.kv_layout, expected_kv_dtype=self.cache.kv_dtype
        )
        sampling = self._check_model_fields(header)
        rid = header.request_id
        try:
            self.arrivals.check_new(rid)
        except VlkvError as exc:
            raise KVWireError(exc.code, exc.message) from None
        if not self.arrivals.may_park(rid, sender):
            raise KVWireError(
                _EXHAUSTED,
                f"{sender} already holds {self.t.max_unclaimed_per_sender} caches nobody claimed",
                Refusal.REFUSAL_POOL_FULL,
            )
        lengths = list(header.layer_lengths)
        got = self.core.blocks.admit(lengths, max(1, sampling.max_new_tokens), self.core.num_swapped)
        if isinstance(got, AdmissionRefusal):
            raise KVWireError(_EXHAUSTED, got.message, _REFUSALS[got.kind])
        seq = Sequence(
            request_id=rid,
            blocks=got,
            lengths=lengths,
            prompt_length=header.prompt_length,
            first_token=header.first_token_id,
            sampling=sampling,
            eos_token_ids=frozenset(header.eos_token_ids),
            detok=self.detokenizer(sampling),
            usage=self._usage(header),
            status=SequenceStatus.WAITING_FOR_KV,
        )
        self.core.seed(seq, checked.prompt_scores)
        if transfer is not None:
            self.arrivals.begin_transfer(rid, transfer)
        return seq

    def detokenizer(self, sampling) -> IncrementalText | None:
        """A new sequence's detokenizer (its text and stop strings; None: ids only)."""
        return None if self.tokenizer is None else IncrementalText(None, sampling.stop, self._decode_text)

    def _check_model_fields(self, header: kv_pb2.KVHeader):
        """What a header carries beyond the layout, against this model: the sampling settings (returned,
        parsed once), the first token and the EOS ids (inside the vocabulary)."""
        try:
            sampling = sampling_from_proto(header.sampling, self.limits)
        except InvalidInput as exc:
            raise KVWireError(_INVALID, f"bad KV header: {exc.message}") from None
        vocab = getattr(self.spec, "vocab_size", 0)
        if vocab and header.first_token_id >= vocab:
            raise KVWireError(
                _INVALID,
                f"bad KV header: first_token_id {header.first_token_id} is outside the vocabulary of {vocab}",
            )
        if vocab and any(t >= vocab for t in header.eos_token_ids):
            raise KVWireError(
                _INVALID, f"bad KV header: an eos_token_id is outside the vocabulary of {vocab}"
            )
        return sampling

    @property
    def full_token_bytes(self) -> int:
        """Bytes of one token of one layer of the full cache, in the model's dtype (K and V)."""
        _, kv_heads, head_dim, _ = self.spec.kv_layout
        return 2 * kv_heads * head_dim * self.cache.dtype.itemsize

    def _usage(self, header: kv_pb2.KVHeader) -> generate_pb2.Usage:
        return kv_usage(
            list(header.layer_lengths),
            header.prompt_length,
            self.cache.token_bytes,
            self.full_token_bytes,
            prompt_tokens=header.prompt_tokens,
            vision_tokens=header.vision_tokens,
            policy=header.policy,
        )

    # -- write ---------------------------------------------------------------------------------------
    def write_cache(self, seq: Sequence, cache: CompactKV) -> None:
        """A whole cache into ``seq``'s blocks (in one process: the bytes are already here)."""
        for table, tensors in zip(seq.blocks.tables, compact_layers(cache), strict=True):
            self.cache.write(table, *tensors)

    # -- arrive --------------------------------------------------------------------------------------
    def arrive(
        self, seq: Sequence, transport: str, sender: str = "", transfer: Transfer | None = None
    ) -> None:
        """The cache is whole in ``seq``'s blocks: hand it on, unless it was superseded or abandoned."""
        rid = seq.request_id
        if transfer is not None and self.arrivals.superseded(transfer):
            self.release(seq)
            raise KVWireError(
                grpc.StatusCode.ABORTED,
                f"a newer transfer of {rid!r} superseded this one",
                Refusal.REFUSAL_SUPERSEDED,
            )
        seq.status = SequenceStatus.WAITING
        if not self.arrivals.deliver(seq, sender):
            raise KVWireError(grpc.StatusCode.CANCELLED, f"request {rid!r} was cancelled during its hand-off")
        self.received[transport] += 1

    def release(self, seq: Sequence) -> None:
        """A hand-off failed after ``admit``: its blocks go back to the pool."""
        seq.finish(FinishReason.ERROR)
        if seq.blocks.num_blocks:
            self.core.blocks.free(seq.blocks)

    # -- limits on transfers -------------------------------------------------------------------------
    def enter(self) -> None:
        if self.active >= self.t.max_transfers:
            raise KVWireError(
                _EXHAUSTED,
                f"{self.active} hand-offs in progress (limit {self.t.max_transfers})",
                Refusal.REFUSAL_POOL_FULL,
            )
        self.active += 1

    def leave(self) -> None:
        self.active -= 1

    async def next_message(self, it: AsyncIterator, deadline: float, what: str):
        """The next message within the idle limit and the transfer's deadline; None at the end."""
        try:
            async with asyncio.timeout(max(0.0, min(self.t.idle_s, deadline - time.monotonic()))):
                return await it.__anext__()
        except StopAsyncIteration:
            return None
        except TimeoutError:
            raise KVWireError(
                grpc.StatusCode.DEADLINE_EXCEEDED, f"no {what} within the transfer's limits"
            ) from None

    async def drain(self, it: AsyncIterator, deadline: float) -> None:
        """Read (and drop) what a refused sender still streams, so it sees the refusal's own status.

        A status sent while the client is still writing a large message reaches grpcio's client as
        ``INTERNAL: Internal error from Core``. Bounded: ``drain_bytes`` per call, ``MAX_DRAINING`` calls
        at once, the idle limit and the transfer's deadline; past any bound the status is sent at once."""
        if self.draining >= MAX_DRAINING:
            return
        self.draining += 1
        seen = 0
        try:
            while seen <= self.t.drain_bytes:
                chunk = await self.next_message(it, deadline, "message")
                if chunk is None:
                    return
                seen += len(chunk) if isinstance(chunk, bytes) else chunk.ByteSize()
        except KVWireError:
            return
        finally:
            self.draining -= 1


def sender_of(context) -> str:
    """Who sends (the peer's host: its ports change per connection)."""
    peer = context.peer() or ""
    return peer.rsplit(":", 1)[0] if ":" in peer else peer
