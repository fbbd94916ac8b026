"""The decode worker's receiving side of the hand-off: ``TransferKV`` (gRPC) and ``TransferKVNixl``.

Both transports end the same way (``TransferReceiver._arrive``): the header checked against this model
once (``admit``: layout, fingerprint, sampling, ids inside the vocabulary), blocks taken under the admission
policy, the K/V in those blocks and checked (gRPC: finite here; NIXL: the sender's per-layer CRC-32C over
what landed, each layer checksummed as its write's notification arrives, the bytes checked finite by the
sender before it wrote them), then the sequence handed to its ``Decode`` call through the ``Rendezvous``.

Limits on what one sender can hold (issue 15): at most ``max_transfers`` hand-offs at once (more are refused
with RESOURCE_EXHAUSTED); each ends at ``deadline_s`` and when no message comes for ``idle_s`` (blocks
freed); a refused gRPC sender is drained of at most ``drain_bytes`` so it sees the refusal's own status, with
at most ``MAX_DRAINING`` such drains at once; a sender may park ``max_unclaimed_per_sender`` caches nobody
claims, each for ``unclaimed_lease_s``.

NIXL: the blocks of one request are the only regions its sender is told of. If the call ends after the
regions went out and before the sender's ``done`` (sender died, deadline, cancel), writes may still be in
flight: the blocks stay reserved until the write window the sender was given has closed, then are freed.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator, Callable

import grpc
import torch
from vlkv.common import logs
from vlkv.common.config import DecodeConfig
from vlkv.common.errors import Refusal, VlkvError, abort_with
from vlkv.common.handoff.assembler import KVAssembler, all_tensor_bytes, validate_header
from vlkv.common.handoff.block_layout import block_runs, ceil_div, runs_crc32c, tensor_crc32c
from vlkv.common.handoff.nixl_agent import NixlAgent, device_id, mem_type
from vlkv.common.handoff.wire import KVWireError, compact_layers, layer_shapes
from vlkv.common.model.spec import ModelSpec
from vlkv.decode_worker.block_manager import AdmissionRefusal, BlockManager, RefusalKind, SequenceBlocks
from vlkv.decode_worker.kv_cache import KVCache
from vlkv.decode_worker.rendezvous import Rendezvous
from vlkv.v1 import kv_pb2, worker_pb2

log = logging.getLogger(__name__)


def _extend(crc: int | None, tensors) -> int | None:
    """``crc`` continued over ``tensors``' bytes (None stays None: not checksummed yet)."""
    if crc is None:
        return None
    for t in tensors:
        crc = tensor_crc32c(t, crc)
    return crc


MAX_DRAINING = 4
_REFUSALS = {  # the block manager's refusal kinds as the wire's machine-readable reasons
    RefusalKind.POOL_FULL: Refusal.REFUSAL_POOL_FULL,
    RefusalKind.NEVER_FITS: Refusal.REFUSAL_NEVER_FITS,
}
_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED


def sender_of(context) -> str:
    """Who sends (the peer's host: its ports change per connection)."""
    peer = context.peer() or ""
    return peer.rsplit(":", 1)[0] if ":" in peer else peer


class _GrpcTransfer:
    def __init__(self, assembler: KVAssembler) -> None:
        self.assembler = assembler

    def abandon(self) -> None:
        self.assembler.abort()  # frees the blocks now: nothing but this call writes them


class _NixlTransfer:
    abandoned = False

    def abandon(self) -> None:
        self.abandoned = True  # the sender may be writing: freed at its done, or when its window closes


class TransferReceiver:
    def __init__(
        self,
        spec: ModelSpec,
        cfg: DecodeConfig,
        pool: BlockManager,
        kv_cache: KVCache,
        rendezvous: Rendezvous,
        check_header: Callable[[kv_pb2.KVHeader], object],
        make_sequence: Callable[[kv_pb2.KVHeader, object, SequenceBlocks], object],
        num_swapped: Callable[[], int],
        nixl: NixlAgent | None = None,
    ) -> None:
        """``check_header(header)`` raises KVWireError or returns the parsed sampling settings, which
        ``make_sequence(header, sampling, blocks)`` takes (one parse); ``nixl``: the agent the pool is
        registered with (None: this worker offers gRPC only)."""
        self.spec = spec
        self.cfg = cfg
        self.t = cfg.transfer
        self.pool = pool
        self.kv_cache = kv_cache
        self.rendezvous = rendezvous
        self.check_header = check_header
        self.make_sequence = make_sequence
        self.num_swapped = num_swapped
        self.nixl = nixl
        self.active = 0
        self.draining = 0
        self.received = {"grpc": 0, "nixl": 0}  # caches handed on, per transport
        self._nixl_reg = nixl.register([kv_cache.k, kv_cache.v]) if nixl is not None else None

    # -- admission, shared by both transports --------------------------------------------------------
    def admit(self, header: kv_pb2.KVHeader, sender: str, transfer) -> tuple[object, SequenceBlocks]:
        """Check ``header`` and take its blocks; KVWireError with the refusal otherwise."""
        validate_header(
            header, self.spec.fingerprint, self.spec.kv_layout, expected_kv_dtype=self.kv_cache.kv_dtype
        )
        sampling = self.check_header(header)
        rid = header.request_id
        try:
            self.rendezvous.check_new(rid)
        except VlkvError as exc:
            raise KVWireError(exc.code, exc.message) from None
        if not self.rendezvous.may_park(rid, sender):
            raise KVWireError(
                _EXHAUSTED,
                f"{sender} already holds {self.t.max_unclaimed_per_sender} caches nobody claimed",
                Refusal.REFUSAL_POOL_FULL,
            )
        got = self.pool.admit(
            list(header.layer_lengths), max(1, header.sampling.max_new_tokens), self.num_swapped()
        )
        if isinstance(got, AdmissionRefusal):
            raise KVWireError(_EXHAUSTED, got.message, _REFUSALS[got.kind])
        logs.request_id.set(rid)
        self.rendezvous.begin_transfer(rid, transfer)
        return sampling, got

    def _arrive(self, header, sampling, blocks: SequenceBlocks, transfer, sender: str) -> None:
        """The cache is whole in ``blocks``: hand it on, unless it was superseded or abandoned meanwhile."""
        rid = header.request_id
        if self.rendezvous.superseded(transfer):
            self.pool.free(blocks)
            raise KVWireError(
                grpc.StatusCode.ABORTED,
                f"a newer transfer of {rid!r} superseded this one",
                Refusal.REFUSAL_SUPERSEDED,
            )
        try:
            seq = self.make_sequence(header, sampling, blocks)
        except VlkvError as exc:
            self.pool.free(blocks)
            raise KVWireError(exc.code, exc.message) from None
        if not self.rendezvous.deliver(seq, sender):
            raise KVWireError(grpc.StatusCode.CANCELLED, f"request {rid!r} was cancelled during its hand-off")

    def _enter(self) -> None:
        if self.active >= self.t.max_transfers:
            raise KVWireError(
                _EXHAUSTED,
                f"{self.active} hand-offs in progress (limit {self.t.max_transfers})",
                Refusal.REFUSAL_POOL_FULL,
            )
        self.active += 1

    async def _next(self, it: AsyncIterator, deadline: float, what: str):
        """The next message within the idle limit and the transfer's deadline; None at the end."""
        wait = min(self.t.idle_s, deadline - time.monotonic())
        try:
            return await asyncio.wait_for(it.__anext__(), max(0.0, wait))
        except StopAsyncIteration:
            return None
        except asyncio.TimeoutError:
            raise KVWireError(
                grpc.StatusCode.DEADLINE_EXCEEDED, f"no {what} within the transfer's limits"
            ) from None

    # -- gRPC ----------------------------------------------------------------------------------------
    async def grpc(self, requests, context) -> worker_pb2.TransferAck:
        deadline = time.monotonic() + self.t.deadline_s
        sender = sender_of(context)
        holder: dict = {}

        def allocate(header):
            holder["sampling"], blocks = self.admit(header, sender, transfer)
            return blocks

        assembler = KVAssembler(
            self.spec.fingerprint,
            self.spec.kv_layout,
            expected_kv_dtype=self.kv_cache.kv_dtype,
            allocate=allocate,
            release=self.pool.free,
        )
        transfer = _GrpcTransfer(assembler)
        rid, entered = "", False
        it = requests.__aiter__()
        try:
            self._enter()
            entered = True
            while (chunk := await self._next(it, deadline, "KV chunk")) is not None:
                if isinstance(chunk, bytes):  # registered through add_decode_servicer
                    assembler.feed_wire(chunk)
                else:  # a KVChunk (a servicer registered with the generated deserializer)
                    assembler.feed(chunk)
                rid = rid or (assembler.header.request_id if assembler.header is not None else "")
            header, ckv = assembler.finish()
            blocks = assembler.handle
            for layer, tensors in enumerate(compact_layers(ckv)):
                self.kv_cache.write(blocks.tables[layer], *tensors)
            bad = ckv.non_finite_part()
            if bad:
                self.pool.free(blocks)
                raise KVWireError(grpc.StatusCode.INVALID_ARGUMENT, f"the cache holds NaN or inf in {bad}")
            self._arrive(header, holder["sampling"], blocks, transfer, sender)
            self.received["grpc"] += 1
            return worker_pb2.TransferAck(
                bytes_received=assembler.bytes_received, blocks_allocated=blocks.num_blocks
            )
        except KVWireError as exc:
            assembler.abort()
            if exc.code != grpc.StatusCode.DEADLINE_EXCEEDED:
                await self._drain(it, deadline)
            await abort_with(context, exc.code, str(exc), exc.reason)
        except BaseException:
            assembler.abort()
            raise
        finally:
            self.active -= entered
            self.rendezvous.end_transfer(rid, transfer)

    async def _drain(self, it: AsyncIterator, deadline: float) -> None:
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
                chunk = await self._next(it, deadline, "message")
                if chunk is None:
                    return
                seen += len(chunk) if isinstance(chunk, bytes) else chunk.ByteSize()
        except KVWireError:
            return
        finally:
            self.draining -= 1

    # -- NIXL ----------------------------------------------------------------------------------------
    async def nixl_stream(self, requests, context):
        """``TransferKVNixl``: open -> regions -> (the sender writes) -> done -> checksums -> ack."""
        if self.nixl is None:
            # read the sender's open first: a status sent while its write is still in flight can reach
            # grpcio's client as "INTERNAL: Internal error from Core", which ``auto`` would not fall back on
            it = requests.__aiter__()
            try:
                await self._next(it, time.monotonic() + min(1.0, self.t.idle_s), "open")
            except KVWireError:
                pass
            await abort_with(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                "this decode worker does not offer the NIXL KV transport (--kv-transport)",
                Refusal.REFUSAL_TRANSPORT_UNAVAILABLE,
            )
        deadline = time.monotonic() + self.t.deadline_s
        sender = sender_of(context)
        transfer = _NixlTransfer()
        it = requests.__aiter__()
        rid, blocks, window_end, entered = "", None, 0.0, False
        try:
            self._enter()
            entered = True
            first = await self._next(it, deadline, "open")
            if first is None or first.WhichOneof("part") != "open":
                raise KVWireError(
                    grpc.StatusCode.INVALID_ARGUMENT, "a NIXL transfer starts with its open message"
                )
            header = first.open.header
            sampling, blocks = self.admit(header, sender, transfer)
            rid = header.request_id
            window = min(self.t.write_window_s, deadline - time.monotonic())
            window_end = time.monotonic() + window
            landed: dict[int, int] = {}  # layer -> CRC-32C of what landed there
            layers = self.nixl.watch(rid)  # the sender's per-layer notifications
            try:
                yield worker_pb2.NixlTransferReply(
                    regions=self._regions(header, blocks, first.open.known_agent, window)
                )
                checker = asyncio.ensure_future(self._check_landed(header, blocks, layers, landed))
                try:
                    done = await self._next(it, min(deadline, window_end), "done")
                finally:
                    checker.cancel()
            finally:
                self.nixl.unwatch(rid, layers)
            if done is None or done.WhichOneof("part") != "done":
                raise KVWireError(grpc.StatusCode.INVALID_ARGUMENT, "expected the sender's done")
            window_end = 0.0  # the sender wrote everything: the blocks may be freed at once from here on
            if transfer.abandoned:
                raise KVWireError(
                    grpc.StatusCode.CANCELLED, f"request {rid!r} was cancelled during its hand-off"
                )
            self._verify(header, blocks, done.done, landed)
            held, blocks = blocks, None
            self._arrive(header, sampling, held, transfer, sender)
            self.received["nixl"] += 1
            nbytes = sum(map(sum, all_tensor_bytes(header)))  # K, V and any scales, as over gRPC
            yield worker_pb2.NixlTransferReply(
                ack=worker_pb2.TransferAck(bytes_received=nbytes, blocks_allocated=held.num_blocks)
            )
        except KVWireError as exc:
            self._release(blocks, window_end)
            blocks = None
            await abort_with(context, exc.code, str(exc), exc.reason)
        finally:
            self._release(blocks, window_end)  # cancelled, or the call broke
            self.active -= entered
            self.rendezvous.end_transfer(rid, transfer)

    def _release(self, blocks: SequenceBlocks | None, window_end: float) -> None:
        """Free ``blocks`` now, or when the write window closes if writes may still land."""
        if blocks is None or not blocks.tables:
            return
        wait = window_end - time.monotonic()
        if wait <= 0:
            self.pool.free(blocks)
            return
        log.warning("NIXL hand-off ended mid-write; its blocks are freed when its write window closes")
        asyncio.get_running_loop().call_later(wait, self.pool.free, blocks)

    def _regions(
        self, header, blocks: SequenceBlocks, known_agent: str, window: float
    ) -> worker_pb2.NixlRegions:
        cache = self.kv_cache
        block_bytes = cache.kv_bytes_per_block  # one tensor's (K's or V's) data in a block
        k0, v0 = cache.k.data_ptr(), cache.v.data_ptr()
        out = worker_pb2.NixlRegions(
            agent_name=self.nixl.name,
            mem_type=mem_type(cache.k),
            device_id=device_id(cache.k),
            block_size=cache.block_size,
            write_window_ms=max(1, int(window * 1000)),
        )
        if known_agent != self.nixl.name:
            out.agent_metadata = self.nixl.metadata
        for k, table in zip(header.layer_lengths, blocks.tables, strict=True):
            runs = block_runs(table[: ceil_div(k, cache.block_size)])
            layer = out.layers.add()
            layer.key_addrs.extend(k0 + first * block_bytes for first, _ in runs)
            layer.value_addrs.extend(v0 + first * block_bytes for first, _ in runs)
            layer.lengths.extend(n * block_bytes for _, n in runs)
        return out

    def _landed(self, header, blocks: SequenceBlocks, layer: int) -> int:
        """CRC-32C of layer ``layer``'s K then V blocks where they landed (read in place, no copy)."""
        cache = self.kv_cache
        k = header.layer_lengths[layer]
        runs = block_runs(blocks.tables[layer][: ceil_div(k, cache.block_size)])
        return runs_crc32c(cache.v, runs, runs_crc32c(cache.k, runs))

    async def _check_landed(
        self, header, blocks: SequenceBlocks, layers: asyncio.Queue, landed: dict
    ) -> None:
        """Checksum each layer the sender reports written while it writes the next ones (its ``done`` then
        only compares); a layer whose checksum differs is read again at ``done``."""
        while True:
            layer = await layers.get()
            if 0 <= layer < len(header.layer_lengths) and layer not in landed:
                landed[layer] = self._landed(header, blocks, layer)
                await asyncio.sleep(0)  # one layer at a time: other calls run in between

    def _verify(
        self, header, blocks: SequenceBlocks, done: worker_pb2.NixlDone, landed: dict[int, int]
    ) -> None:
        """What landed is what was sent (CRC-32C per layer, read in place): the layers checksummed as they
        landed (``landed``) are compared, the rest (and any mismatch: it may have been read before its
        bytes landed) are read now. The sender checked those bytes finite before writing them (the gRPC
        path checks here instead), so they need no second read. An int8 cache's scales come in ``done``
        (the layer's CRC continues over them); once they check out they are written into the pool."""
        crcs = list(done.layer_crc32c)
        n = len(header.layer_lengths)
        if len(crcs) != n:
            raise KVWireError(grpc.StatusCode.INVALID_ARGUMENT, f"{len(crcs)} checksums for {n} layers")
        scales = self._scales(header, done)
        for layer, want in enumerate(crcs):
            tail = scales[layer] if scales else ()
            if _extend(landed.get(layer), tail) == want:
                continue
            if _extend(self._landed(header, blocks, layer), tail) != want:
                raise KVWireError(
                    grpc.StatusCode.DATA_LOSS, f"CRC-32C mismatch in layer {layer} after the NIXL write"
                )
        for layer, (k_scale, v_scale) in enumerate(scales):
            table = blocks.tables[layer]
            self.kv_cache.write_scales(table, k_scale, v_scale)

    def _scales(self, header, done: worker_pb2.NixlDone) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """An int8 cache's per-layer (K scales ``[H_kv, D]``, V scales ``[H_kv, k_l]``) from ``done``;
        missing or truncated ones are DATA_LOSS."""
        if not header.kv_dtype:
            return []
        n = len(header.layer_lengths)
        if len(done.key_scales) != n or len(done.value_scales) != n:
            raise KVWireError(
                grpc.StatusCode.DATA_LOSS,
                f"{len(done.key_scales)} K and {len(done.value_scales)} V scale sets for {n} layers",
            )
        out = []
        for layer in range(n):
            shapes = layer_shapes(header, layer)[2:]
            pair = []
            for raw, (shape, dtype) in zip(
                (done.key_scales[layer], done.value_scales[layer]), shapes, strict=True
            ):
                if len(raw) != math.prod(shape) * dtype.itemsize:
                    raise KVWireError(
                        grpc.StatusCode.DATA_LOSS, f"layer {layer}: {len(raw)} scale bytes, expected {shape}"
                    )
                pair.append(torch.frombuffer(bytearray(raw), dtype=dtype).view(shape))
            out.append((pair[0], pair[1]))
        return out
