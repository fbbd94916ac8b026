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

import grpc
import numpy as np
import torch
from vlkv.common.block_math import ceil_div
from vlkv.common.errors import abort_with
from vlkv.common.handoff.assembler import KVStreamReader
from vlkv.common.handoff.wire import KVWireError, layer_shapes
from vlkv.decode_worker.admission import Admission, sender_of
from vlkv.decode_worker.kv_cache import KVCache
from vlkv.decode_worker.sequence import Sequence
from vlkv.v1 import kv_pb2, worker_pb2

_EXPONENT = {2: np.uint16, 4: np.uint32}  # float bits by item size: all-ones exponent = NaN or inf
_EXPONENT_MASK = {torch.float16: 0x7C00, torch.bfloat16: 0x7F80, torch.float32: 0x7F800000}


def finite_bits(data, dtype: torch.dtype) -> bool:
    """Whether the packed ``dtype`` values in ``data`` hold no NaN or inf (read from their bits in place)."""
    mask = _EXPONENT_MASK[dtype]
    bits = np.frombuffer(data, dtype=_EXPONENT[dtype.itemsize])
    return not bool(np.any(bits & mask == mask))


class PoolRows:
    """The pool's K, V (and 8-bit V-scale) tensors as rows of bytes: row ``(block * H_kv + h) * B + slot``
    holds head ``h``'s token at ``slot`` of ``block`` (``D`` values, or one scale). NumPy views of a CPU
    pool (one fancy-indexed copy per chunk), torch views on a GPU."""

    def __init__(self, cache: KVCache) -> None:
        self.cache = cache
        self.cpu = cache.device.type == "cpu"
        self.tensors = [self._rows(t) for t in (cache.k, cache.v, None, cache.v_scale)]

    def _rows(self, t: torch.Tensor | None):
        if t is None:
            return None
        row = t[0, 0, 0].numel() * t.element_size()
        flat = t.view(-1, *t.shape[3:]).view(torch.uint8).view(-1, row)
        return flat.numpy() if self.cpu else flat

    def write(self, tensor: int, dst: np.ndarray, data) -> None:
        """Rows ``data`` (bytes, a whole number of rows) into pool rows ``dst``."""
        rows = self.tensors[tensor]
        src = np.frombuffer(data, dtype=np.uint8).reshape(len(dst), rows.shape[1])
        if self.cpu:
            rows[dst] = src
        else:
            rows.index_copy_(
                0, torch.from_numpy(dst).to(rows.device), torch.from_numpy(src.copy()).to(rows.device)
            )


class PoolSink:
    """Writes a stream's chunks into one sequence's blocks: K and V (and an 8-bit cache's V scales) row
    by row where each token lives (block ``table[t // B]``, slot ``t % B``), an 8-bit layer's K scales
    (``[H_kv, D]``, one set per layer) into every block of the layer once they are whole.

    A row (one head's token: ``D`` values, or one scale) cut by a chunk boundary is carried to the next
    chunk of its tensor; float payloads are checked finite before they are written."""

    def __init__(self, admission: Admission, rows: PoolRows, seq: Sequence, header: kv_pb2.KVHeader) -> None:
        self.admission = admission
        self.rows = rows
        self.seq = seq
        self.header = header
        self._heads = header.num_kv_heads
        self._carry: dict[tuple[int, int], bytearray] = {}
        self._k_scales: dict[int, bytearray] = {}
        self._dst: dict[int, np.ndarray] = {}

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
            self._write(layer, tensor, first, 1, bytes(carry), dtype)
            first += 1
        whole = len(view) // row
        if whole:
            self._write(layer, tensor, first, whole, view[: whole * row], dtype)
        if whole * row < len(view):
            self._carry[(layer, tensor)] = bytearray(view[whole * row :])

    def _write(self, layer: int, tensor: int, first: int, n: int, data, dtype: torch.dtype) -> None:
        """``n`` rows from ``first`` of tensor ``tensor`` (head-major ``[H_kv, k]`` rows) into their slots."""
        if dtype.is_floating_point and not finite_bits(data, dtype):
            name = ("keys", "values", "key scales", "value scales")[tensor]
            raise KVWireError(
                grpc.StatusCode.INVALID_ARGUMENT, f"the cache holds NaN or inf in layer {layer} {name}"
            )
        self.rows.write(tensor, self._slots(layer)[first : first + n], data)

    def _slots(self, layer: int) -> np.ndarray:
        """Pool row of each of layer ``layer``'s ``[H_kv, k]`` rows (computed once per layer)."""
        dst = self._dst.get(layer)
        if dst is None:
            b = self.rows.cache.block_size
            k = self.header.layer_lengths[layer]
            t = np.arange(k)
            blocks = np.asarray(self.seq.blocks.tables[layer][: ceil_div(k, b)], dtype=np.int64)[t // b]
            base = blocks * (self._heads * b) + t % b  # head 0's row of each token
            dst = self._dst[layer] = (base[None, :] + (np.arange(self._heads) * b)[:, None]).reshape(-1)
        return dst

    def finish(self) -> None:
        """Every byte arrived: an 8-bit cache's K scales into every block of their layer."""
        cache = self.rows.cache
        for layer, raw in self._k_scales.items():
            shape, dtype = layer_shapes(self.header, layer)[2]
            if not finite_bits(raw, dtype):
                raise KVWireError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"the cache holds NaN or inf in layer {layer} key scales",
                )
            scales = torch.frombuffer(raw, dtype=dtype).view(shape).to(cache.device)
            cache.k_scale[
                torch.tensor(self.seq.blocks.tables[layer], dtype=torch.long, device=cache.device)
            ] = scales

    def release(self) -> None:
        self.admission.release(self.seq)


class _GrpcTransfer:
    def __init__(self, reader: KVStreamReader) -> None:
        self.reader = reader

    def abandon(self) -> None:
        self.reader.abort()  # frees the blocks now: nothing but this call writes them


class GrpcKVReceiver:
    transport = "grpc"

    def __init__(self, admission: Admission) -> None:
        self.admission = admission
        self.rows = PoolRows(admission.cache)

    async def receive(self, requests, context) -> worker_pb2.TransferAck:
        adm = self.admission
        deadline = time.monotonic() + adm.t.deadline_s
        sender = sender_of(context)
        reader = KVStreamReader(lambda h: PoolSink(adm, self.rows, adm.admit(h, sender, transfer), h))
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
            adm.arrive(sink.seq, self.transport, sender, transfer)
            return worker_pb2.TransferAck(
                bytes_received=reader.bytes_received, blocks_allocated=sink.seq.blocks.num_blocks
            )
        except KVWireError as exc:
            reader.abort()
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
