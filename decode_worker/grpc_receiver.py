"""``TransferKV``: a cache's bytes in gRPC messages, written straight into its sequence's pool blocks.

``GrpcKVReceiver.receive(requests, context)`` reads the stream through ``KVStreamReader`` (order, offsets,
CRC-32C, trailer totals), whose ``open`` is ``Admission.admit`` (the header checked once, the blocks
taken, the sequence built); every data chunk is then checked finite and copied once, into the blocks
(``PoolSink``): no host copy of the cache is ever assembled. At the trailer the sequence arrives
(``Admission.arrive``); any failure, cancellation or deadline frees the blocks and ends the call with its
status and refusal reason, after draining a refused sender (bounded) so it sees that status.

The messages come as raw bytes (``server.add_decode_servicer`` registers ``TransferKV`` without a
deserializer: data chunks are parsed zero-copy) or as ``KVChunk`` messages from a generic registration.
"""

from __future__ import annotations

import time
import warnings

import grpc
import numpy as np
import torch
from vlkv.common import logs
from vlkv.common.block_math import ceil_div
from vlkv.common.errors import abort_with
from vlkv.common.handoff.assembler import KVStreamReader
from vlkv.common.handoff.compact_kv import all_finite
from vlkv.common.handoff.transport import KVReceiver, Transfer
from vlkv.common.handoff.wire import KVWireError, layer_shapes
from vlkv.decode_worker.admission import Admission, sender_of
from vlkv.decode_worker.kv_cache import KVCache
from vlkv.decode_worker.sequence import Sequence
from vlkv.v1 import kv_pb2, worker_pb2


def _bytes_tensor(data) -> torch.Tensor:
    """A uint8 tensor over received bytes (immutable: only read, then copied into the pool)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The given buffer is not writable", UserWarning)
        return torch.frombuffer(data, dtype=torch.uint8)


class PoolBlocks:
    """The pool's K, V (and 8-bit V-scale) tensors as ``[N, H_kv, B, row bytes]``: a row is one head's
    token (``D`` values, or one scale). A run of one head's tokens inside a block is contiguous there as
    in the wire's ``[H_kv, k, D]``, so a chunk lands as a few slice copies and one block-granular indexed
    copy per head. NumPy views of a CPU pool, torch views on a GPU."""

    def __init__(self, cache: KVCache) -> None:
        self.cache = cache
        self.cpu = cache.device.type == "cpu"
        self.tensors = [self._blocks(t) for t in (cache.k, cache.v, None, cache.v_scale)]

    def _blocks(self, t: torch.Tensor | None):
        if t is None:
            return None
        n, heads, b = t.shape[:3]
        flat = t.view(n, heads, b, -1).view(torch.uint8)  # [N, H_kv, B, row bytes]
        return flat.numpy() if self.cpu else flat

    def write(self, tensor: int, table, k: int, first: int, rows) -> None:
        """``rows`` (``[n, row bytes]``) are the wire rows ``first..`` of a layer of ``k`` tokens (row
        ``h * k + t``), whose blocks are ``table``."""
        pool, b = self.tensors[tensor], self.cache.block_size
        if not self.cpu:
            rows = rows.to(pool.device)
        i, n = 0, len(rows)
        while i < n:
            h, t = divmod(first + i, k)
            m = min(k - t, n - i)  # this head's tokens t .. t + m
            self._head(pool, table, h, t, rows[i : i + m], b)
            i += m

    @staticmethod
    def _head(pool, table, h: int, t: int, rows, b: int) -> None:
        m, j = len(rows), 0
        if t % b:  # the end of a block already begun
            j = min(b - t % b, m)
            pool[table[t // b], h, t % b : t % b + j] = rows[:j]
        full = (m - j) // b
        if full:
            first = (t + j) // b
            pool[table[first : first + full], h] = rows[j : j + full * b].reshape(full, b, -1)
            j += full * b
        if j < m:
            pool[table[(t + j) // b], h, : m - j] = rows[j:]


class PoolSink:
    """Writes a stream's chunks into one sequence's blocks: K and V (and an 8-bit cache's V scales) where
    each token lives (block ``table[t // B]``, slot ``t % B``), an 8-bit layer's K scales (``[H_kv, D]``,
    one set per layer) into every block of the layer once they are whole.

    A row (one head's token: ``D`` values, or one scale) cut by a chunk boundary is carried to the next
    chunk of its tensor; float payloads are checked finite before they are written."""

    def __init__(
        self, admission: Admission, pool: PoolBlocks, seq: Sequence, header: kv_pb2.KVHeader
    ) -> None:
        self.admission = admission
        self.pool = pool
        self.seq = seq
        self.header = header
        self._carry: dict[tuple[int, int], bytearray] = {}
        self._k_scales: dict[int, bytearray] = {}
        self._tables: dict[int, object] = {}

    def write(self, layer: int, tensor: int, offset: int, payload: bytes | memoryview) -> None:
        shape, dtype = layer_shapes(self.header, layer)[tensor]
        if tensor == 2:  # an 8-bit layer's K scales: a few hundred bytes, written whole at the end
            self._k_scales.setdefault(layer, bytearray()).extend(payload)
            return
        row = shape[2] * dtype.itemsize if tensor < 2 else dtype.itemsize
        first, view = offset // row, memoryview(payload)
        carry = self._carry.pop((layer, tensor), None)
        if carry is not None:  # the rest of a row the last chunk began
            take = row - len(carry)
            carry += view[:take]
            view = view[take:]
            if len(carry) < row:
                self._carry[(layer, tensor)] = carry
                return
            self._write(layer, tensor, first, bytes(carry), dtype, row)
            first += 1
        whole = len(view) // row * row
        if whole:
            self._write(layer, tensor, first, view[:whole], dtype, row)
        if whole < len(view):
            self._carry[(layer, tensor)] = bytearray(view[whole:])

    def _write(self, layer: int, tensor: int, first: int, data, dtype: torch.dtype, row: int) -> None:
        """Whole rows from ``first`` of tensor ``tensor`` (head-major ``[H_kv, k]`` rows) into their slots."""
        src = _bytes_tensor(data)
        if dtype.is_floating_point and not all_finite(src.view(dtype)):
            name = ("keys", "values", "key scales", "value scales")[tensor]
            raise KVWireError(
                grpc.StatusCode.INVALID_ARGUMENT, f"the cache holds NaN or inf in layer {layer} {name}"
            )
        rows = src.view(-1, row)
        k = self.header.layer_lengths[layer]
        self.pool.write(tensor, self._table(layer), k, first, rows.numpy() if self.pool.cpu else rows)

    def _table(self, layer: int):
        table = self._tables.get(layer)
        if table is None:
            ids = self.seq.blocks.tables[layer][
                : ceil_div(self.header.layer_lengths[layer], self.pool.cache.block_size)
            ]
            table = np.asarray(ids, dtype=np.int64)
            if not self.pool.cpu:
                table = torch.from_numpy(table).to(self.pool.cache.device)
            self._tables[layer] = table
        return table

    def finish(self) -> None:
        """Every byte arrived: an 8-bit cache's K scales into every block of their layer."""
        cache = self.pool.cache
        for layer, raw in self._k_scales.items():
            shape, dtype = layer_shapes(self.header, layer)[2]
            scales = _bytes_tensor(bytes(raw)).view(dtype).view(shape)
            if not all_finite(scales):
                raise KVWireError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"the cache holds NaN or inf in layer {layer} key scales",
                )
            ids = torch.tensor(self.seq.blocks.tables[layer], dtype=torch.long, device=cache.device)
            cache.k_scale[ids] = scales.to(cache.device)

    def release(self) -> None:
        self.admission.release(self.seq)


class _GrpcTransfer(Transfer):
    def __init__(self, reader: KVStreamReader) -> None:
        self.reader = reader

    def abandon(self) -> None:
        self.reader.abort()  # frees the blocks now: nothing but this call writes them


class GrpcKVReceiver(KVReceiver):
    transport = "grpc"

    def __init__(self, admission: Admission) -> None:
        self.admission = admission
        self.pool = PoolBlocks(admission.cache)

    async def receive(self, requests, context) -> worker_pb2.TransferAck:
        adm = self.admission
        deadline = time.monotonic() + adm.t.deadline_s
        sender = sender_of(context)

        def open_sink(header: kv_pb2.KVHeader) -> PoolSink:
            seq = adm.admit(header, sender, transfer)
            logs.request_id.set(header.request_id)  # this call's task: its log lines name the request
            return PoolSink(adm, self.pool, seq, header)

        reader = KVStreamReader(open_sink)
        transfer = _GrpcTransfer(reader)
        it = requests.__aiter__()
        entered = False
        try:
            adm.enter()
            entered = True
            while (chunk := await adm.next_message(it, deadline, "KV chunk")) is not None:
                if isinstance(chunk, bytes):  # registered through add_decode_servicer
                    reader.feed_wire(chunk)
                else:  # a KVChunk (a servicer registered with the generated deserializer)
                    reader.feed(chunk)
            sink = reader.sink
            reader.finish()
            try:
                sink.finish()
            except KVWireError:
                sink.release()
                raise
            held = sink.seq.blocks.num_blocks  # the arrivals own the blocks from here
            adm.arrive(sink.seq, self.transport, sender, transfer)
            return worker_pb2.TransferAck(bytes_received=reader.bytes_received, blocks_allocated=held)
        except KVWireError as exc:
            reader.abort()
            # gRPC keeps the abort's traceback (this frame, and the error's own frames as its context) for a
            # while: neither may hold the refused chunk (tens of MB)
            chunk = None  # noqa: F841
            exc.__traceback__ = None
            if exc.code != grpc.StatusCode.DEADLINE_EXCEEDED:
                await adm.drain(it, deadline)
            await abort_with(context, exc.code, str(exc), exc.reason)
        except BaseException:
            reader.abort()
            raise
        finally:
            if entered:
                adm.leave()
            if reader.header is not None:
                adm.arrivals.end_transfer(reader.header.request_id, transfer)
