"""``TransferKVNixl``: header and control over gRPC, the K/V written by NIXL straight into the pool blocks.

``NixlKVReceiver.receive(requests, context)``: the sender's open (its header) -> ``Admission.admit`` ->
the regions of the sequence's blocks (the only regions its sender is told of) -> the sender writes, with a
notification per layer, each layer checksummed (CRC-32C, read in place) as its notification arrives ->
the sender's done (its per-layer CRC-32C, and an 8-bit cache's scales) -> what landed is compared ->
``Admission.arrive`` -> the ack. The sender checked the bytes finite before it wrote them.

If the call ends after the regions went out and before the sender's ``done`` (sender died, deadline,
cancel), writes may still be in flight: the blocks stay reserved until the write window the sender was
given has closed, then are freed (``_NixlTransfer.release``).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time

import grpc
import torch
from vlkv.common import logs
from vlkv.common.block_math import ceil_div
from vlkv.common.errors import Refusal, abort_with
from vlkv.common.handoff.assembler import all_tensor_bytes
from vlkv.common.handoff.block_layout import block_runs, runs_crc32c, tensor_crc32c
from vlkv.common.handoff.nixl_agent import NixlAgent, device_id, mem_type
from vlkv.common.handoff.transport import KVReceiver, Transfer
from vlkv.common.handoff.wire import KVWireError, layer_shapes
from vlkv.decode_worker.admission import Admission, sender_of
from vlkv.decode_worker.block_manager import SequenceBlocks
from vlkv.decode_worker.sequence import Sequence
from vlkv.v1 import worker_pb2

log = logging.getLogger(__name__)


def _extend(crc: int | None, tensors) -> int | None:
    """``crc`` continued over ``tensors``' bytes (None stays None: not checksummed yet)."""
    if crc is None:
        return None
    for t in tensors:
        crc = tensor_crc32c(t, crc)
    return crc


class _NixlTransfer(Transfer):
    """One call's sequence and write window; ``abandon`` (its request was given up) only marks it: the
    sender may be writing, so the blocks are freed at its done, or when its window closes."""

    def __init__(self, admission: Admission) -> None:
        self.admission = admission
        self.seq: Sequence | None = None
        self.window_end = 0.0  # until then writes may land in the blocks
        self.abandoned = False

    def abandon(self) -> None:
        self.abandoned = True

    def release(self) -> None:
        """Free the blocks now, or when the write window closes if writes may still land."""
        seq, self.seq = self.seq, None
        if seq is None:
            return
        wait = self.window_end - time.monotonic()
        if wait <= 0:
            self.admission.release(seq)
            return
        log.warning("NIXL hand-off ended mid-write; its blocks are freed when its write window closes")
        asyncio.get_running_loop().call_later(wait, self.admission.release, seq)


class NixlKVReceiver(KVReceiver):
    transport = "nixl"

    def __init__(self, admission: Admission, nixl: NixlAgent | None) -> None:
        """``nixl``: the agent the pool is registered with (None: this worker does not offer NIXL)."""
        self.admission = admission
        self.nixl = nixl
        cache = admission.cache
        self._registration = nixl.register([cache.k, cache.v]) if nixl is not None else None

    async def receive(self, requests, context):
        """open -> regions -> (the sender writes) -> done -> checksums -> ack."""
        adm = self.admission
        it = requests.__aiter__()
        if self.nixl is None:
            await self._refuse(it, context)
        deadline = time.monotonic() + adm.t.deadline_s
        sender = sender_of(context)
        transfer = _NixlTransfer(adm)
        rid, entered = "", False
        try:
            adm.enter()
            entered = True
            first = await adm.next_message(it, deadline, "open")
            if first is None or first.WhichOneof("part") != "open":
                raise KVWireError(
                    grpc.StatusCode.INVALID_ARGUMENT, "a NIXL transfer starts with its open message"
                )
            header = first.open.header
            seq = transfer.seq = adm.admit(header, sender, transfer)
            rid = header.request_id
            logs.request_id.set(rid)  # this call's task: its log lines name the request
            window = min(adm.t.write_window_s, deadline - time.monotonic())
            transfer.window_end = time.monotonic() + window
            yield worker_pb2.NixlTransferReply(
                regions=self._regions(header, seq.blocks, first.open.known_agent, window)
            )
            done, landed = await self._written(it, header, seq.blocks, min(deadline, transfer.window_end))
            transfer.window_end = 0.0  # the sender wrote everything: the blocks may be freed at once
            if transfer.abandoned:
                raise KVWireError(
                    grpc.StatusCode.CANCELLED, f"request {rid!r} was cancelled during its hand-off"
                )
            self._verify(header, seq.blocks, done, landed)
            transfer.seq, held = None, seq.blocks.num_blocks  # the arrivals own the blocks from here
            adm.arrive(seq, self.transport, sender, transfer)
            nbytes = sum(map(sum, all_tensor_bytes(header)))  # K, V and any scales, as over gRPC
            yield worker_pb2.NixlTransferReply(
                ack=worker_pb2.TransferAck(bytes_received=nbytes, blocks_allocated=held)
            )
        except KVWireError as exc:
            transfer.release()
            await abort_with(context, exc.code, str(exc), exc.reason)
        finally:
            transfer.release()  # cancelled, or the call broke
            if entered:
                adm.leave()
            adm.arrivals.end_transfer(rid, transfer)

    async def _refuse(self, it, context) -> None:
        """This worker offers no NIXL: FAILED_PRECONDITION with REFUSAL_TRANSPORT_UNAVAILABLE. The sender's
        open is read first: a status sent while its write is still in flight can reach grpcio's client as
        "INTERNAL: Internal error from Core", which ``auto`` would not fall back on."""
        try:
            await self.admission.next_message(
                it, time.monotonic() + min(1.0, self.admission.t.idle_s), "open"
            )
        except KVWireError:
            pass
        await abort_with(
            context,
            grpc.StatusCode.FAILED_PRECONDITION,
            "this decode worker does not offer the NIXL KV transport (--kv-transport)",
            Refusal.REFUSAL_TRANSPORT_UNAVAILABLE,
        )

    async def _written(self, it, header, blocks: SequenceBlocks, until: float):
        """Wait for the sender's done, checksumming each layer it reports written meanwhile; returns the
        done and ``{layer: CRC-32C of what landed}``."""
        landed: dict[int, int] = {}
        layers = self.nixl.watch(header.request_id)  # the sender's per-layer notifications
        checker = asyncio.ensure_future(self._check_landed(header, blocks, layers, landed))
        try:
            done = await self.admission.next_message(it, until, "done")
        finally:
            checker.cancel()
            self.nixl.unwatch(header.request_id, layers)
        if done is None or done.WhichOneof("part") != "done":
            raise KVWireError(grpc.StatusCode.INVALID_ARGUMENT, "expected the sender's done")
        return done.done, landed

    def _regions(
        self, header, blocks: SequenceBlocks, known_agent: str, window: float
    ) -> worker_pb2.NixlRegions:
        cache = self.admission.cache
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
        cache = self.admission.cache
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
            self.admission.cache.write_scales(table, k_scale, v_scale)

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
