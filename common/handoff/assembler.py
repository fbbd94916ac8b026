"""Decode side of the compact-KV wire format: validate a header, then hand each checked chunk to a sink.

``KVStreamReader`` is the wire's state machine (header, then data chunks in order with their CRC-32C,
then a trailer whose totals match): ``feed(chunk)`` / ``feed_wire(raw)`` for every message, ``finish()`` at
the end of the stream, ``abort()`` on any failure. Its ``open(header)`` decides what the header means and
where the bytes go: it returns a ``KVSink`` (the decode worker's admission checks the header with
``validate_header`` and returns a sink writing each chunk straight into the sequence's pool blocks,
``decode_worker/grpc_receiver.py``). On any error (or ``abort()``) the sink's ``release`` runs exactly once.

The tests' ``KVAssembler`` (``tests/kv_assembler.py``) is this reader with a host sink that rebuilds the
``CompactKV``.

Status codes (``KVWireError.code``):
- INVALID_ARGUMENT: protocol violations - first message not a header, a second header, an empty
  chunk, anything after the trailer, an insane/oversized header, unknown layer or tensor, an empty
  data chunk, an offset that leaves a gap, overlaps or runs past the tensor's end.
- DATA_LOSS: corruption or loss - CRC-32C mismatch, bytes that do not parse as a KVChunk
  (``feed_wire``), trailer totals that disagree with what arrived, bytes missing at the trailer, a
  stream that ends (``finish()``) before its trailer.
- FAILED_PRECONDITION: a sane header whose fingerprint, layout or dtype is not this worker's model, or
  whose ``kv_dtype`` (fp16 / int8 / fp8) is not the one this worker's pool stores.
- CANCELLED: ``abort()`` by the caller (stored so later calls re-raise it).

A small cache may come as one ``bundle`` message holding its header, data chunks and trailer (in that
order, checked as if streamed); it must be the stream's only message.

Chunks of one tensor must arrive in order (offset == bytes already received); different tensors and
layers may interleave. A payload handed to the sink may be a view of the received message: a sink copies
what it keeps.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple, Protocol

import grpc
import torch
from google.protobuf.message import DecodeError
from vlkv.common.errors import Refusal
from vlkv.common.handoff.codec import crc32c, parse_data_wire, split_bundle_wire
from vlkv.common.handoff.wire import (
    DTYPES,
    FORMAT_VERSION,
    PROMPT_SCORE_DTYPE,
    KVWireError,
    dtype_name,
    header_prompt_scores,
    layer_shapes,
)
from vlkv.common.model.spec import KVLayout
from vlkv.v1 import kv_pb2

MAX_REQUEST_ID_CHARS = 128  # as request.MAX_REQUEST_ID: a cache no Decode call could claim is refused
_INVALID = grpc.StatusCode.INVALID_ARGUMENT
_LOSS = grpc.StatusCode.DATA_LOSS
_PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION


class CheckedHeader(NamedTuple):
    total_bytes: int  # payload bytes (K, V and any scales) the header announces
    prompt_scores: list[torch.Tensor] | None  # per layer ``[k_l]`` fp16, parsed once here


def validate_header(
    header: kv_pb2.KVHeader,
    expected_fingerprint: str,
    expected_layout: KVLayout,
    *,
    max_header_layers: int = 1024,
    max_total_bytes: int = 1 << 34,
    max_prompt_length: int = 1 << 22,
    max_header_bytes: int = 1 << 16,
    expected_kv_dtype: str = "fp16",
) -> CheckedHeader:
    """Check a header for sanity (INVALID_ARGUMENT), then compatibility (FAILED_PRECONDITION).

    Returns the payload bytes it announces and its prompt-time scores (parsed and checked here only).
    """

    def bad(msg: str) -> KVWireError:
        return KVWireError(_INVALID, f"bad KV header: {msg}")

    if header.format_version != FORMAT_VERSION:
        raise bad(f"format_version {header.format_version}, this side speaks {FORMAT_VERSION}")
    if not 0 < len(header.request_id) <= MAX_REQUEST_ID_CHARS:
        raise bad(f"request_id: required, at most {MAX_REQUEST_ID_CHARS} characters")
    scores_bytes = sum(map(len, header.prompt_scores))  # per kept token, checked below
    if header.ByteSize() - scores_bytes > max_header_bytes:
        raise bad(
            f"{header.ByteSize() - scores_bytes} bytes (prompt_scores aside) > limit {max_header_bytes}"
        )
    if header.dtype not in DTYPES:
        raise bad(f"unknown dtype {header.dtype!r}")
    if header.kv_dtype not in ("", "int8", "fp8"):
        raise bad(f"unknown kv_dtype {header.kv_dtype!r}")
    if not 0 < header.num_layers <= max_header_layers:
        raise bad(f"num_layers {header.num_layers} outside [1, {max_header_layers}]")
    if header.num_kv_heads == 0 or header.head_dim == 0:
        raise bad("num_kv_heads and head_dim must be positive")
    if len(header.layer_lengths) != header.num_layers:
        raise bad(f"{len(header.layer_lengths)} layer_lengths for {header.num_layers} layers")
    if not 0 < header.prompt_length <= max_prompt_length:
        raise bad(f"prompt_length {header.prompt_length} outside [1, {max_prompt_length}]")
    if any(not 0 < k <= header.prompt_length for k in header.layer_lengths):
        raise bad(f"a layer length is outside [1, prompt_length={header.prompt_length}]")
    if not header.vision_tokens <= header.prompt_tokens <= header.prompt_length:
        raise bad(
            f"prompt_tokens {header.prompt_tokens} / vision_tokens {header.vision_tokens} do not fit "
            f"prompt_length {header.prompt_length}"
        )
    total = sum(map(sum, all_tensor_bytes(header)))
    if total > max_total_bytes:
        raise bad(f"announces {total} KV bytes > limit {max_total_bytes}")
    if scores_bytes > PROMPT_SCORE_DTYPE.itemsize * sum(header.layer_lengths):
        raise bad(f"{scores_bytes} bytes of prompt_scores for {sum(header.layer_lengths)} kept tokens")
    scores = header_prompt_scores(header)  # their count, sizes and values

    if header.model_fingerprint != expected_fingerprint:
        raise KVWireError(
            _PRECONDITION,
            f"model fingerprint {header.model_fingerprint!r} != this worker's {expected_fingerprint!r}",
            Refusal.REFUSAL_FINGERPRINT_MISMATCH,
        )
    layers, heads, head_dim, dtype = expected_layout
    got = (header.num_layers, header.num_kv_heads, header.head_dim, header.dtype)
    want = (layers, heads, head_dim, dtype_name(dtype))
    if got != want:
        raise KVWireError(
            _PRECONDITION,
            f"KV layout (L, H_kv, D, dtype) {got} != this worker's {want}",
            Refusal.REFUSAL_LAYOUT_MISMATCH,
        )
    got_kv = header.kv_dtype or "fp16"
    if got_kv != expected_kv_dtype:
        raise KVWireError(
            _PRECONDITION,
            f"the cache is stored as kv dtype {got_kv!r}, this decode worker's pool holds {expected_kv_dtype!r} "
            f"(both workers of a deployment need the same --kv-dtype)",
            Refusal.REFUSAL_LAYOUT_MISMATCH,
        )
    return CheckedHeader(total, scores)


def all_tensor_bytes(header: kv_pb2.KVHeader) -> list[list[int]]:
    """Per layer, the bytes of each of its tensors in wire order (K, V, then int8 scales)."""
    return [
        [math.prod(shape) * dtype.itemsize for shape, dtype in layer_shapes(header, layer)]
        for layer in range(header.num_layers)
    ]


class KVSink(Protocol):
    """Where a stream's checked payload goes (see the module docstring)."""

    def write(self, layer: int, tensor: int, offset: int, payload: bytes | memoryview) -> None:
        """``payload``: the next bytes of tensor ``tensor`` (wire order: K, V, K scales, V scales) of
        ``layer``, at byte ``offset`` (every earlier byte of that tensor was written before)."""

    def release(self) -> None:
        """The transfer failed or was aborted: give back what ``open`` took (called at most once)."""


class KVStreamReader:
    """Incremental, validating reader of one KV stream (see the module docstring for the rules)."""

    def __init__(self, open: Callable[[kv_pb2.KVHeader], KVSink]) -> None:
        """``open(header)`` checks the header (raise KVWireError to refuse) and returns its sink."""
        self._open = open
        self._state = "start"  # start -> streaming -> trailer -> done; any -> failed
        self._error: KVWireError | None = None
        self.sink: KVSink | None = None
        self.header: kv_pb2.KVHeader | None = None
        self.bytes_received = 0
        self.chunks_received = 0
        self._layer_bytes: list[list[int]] = []
        self._filled: list[list[int]] = []

    # -- public API --------------------------------------------------------------------------------
    def feed(self, chunk: kv_pb2.KVChunk) -> None:
        """Consume one message; raises KVWireError (and releases the sink) on a bad one."""
        self._check_open()
        try:
            self._feed(chunk)
        except BaseException as exc:
            self._fail(exc)
            raise

    def feed_wire(self, raw: bytes | bytearray | memoryview) -> None:
        """``feed`` for a serialized KVChunk: data chunks are read zero-copy (``parse_data_wire``);
        anything else is parsed by protobuf, and bytes that do not parse are DATA_LOSS."""
        self._check_open()
        try:
            fields = parse_data_wire(raw) if self._state == "streaming" else None
            if fields is not None:
                self._on_data(*fields)
                return
            entries = split_bundle_wire(raw) if self._state == "start" else None
            if entries is not None:  # header, data..., trailer: each the bytes of its own KVChunk
                if not entries or entries[0][0] != 0x0A:
                    raise KVWireError(_INVALID, "a bundle starts with its header")
                for entry in entries:
                    if self._state == "trailer":
                        raise KVWireError(_INVALID, "bundle entries after its trailer")
                    self._feed_entry(entry)
                if self._state != "trailer":
                    raise KVWireError(_INVALID, "a bundle ends with its trailer")
                return
            try:
                chunk = kv_pb2.KVChunk.FromString(raw)
            except DecodeError as err:
                raise KVWireError(_LOSS, f"unparsable KVChunk ({len(raw)} bytes): {err}") from err
            self._feed(chunk)
        except BaseException as exc:
            self._fail(exc)
            raise

    def _feed_entry(self, raw: memoryview) -> None:
        fields = parse_data_wire(raw) if self._state == "streaming" else None
        if fields is not None:
            self._on_data(*fields)
            return
        try:
            chunk = kv_pb2.KVChunk.FromString(raw)
        except DecodeError as err:
            raise KVWireError(_LOSS, f"unparsable bundle entry ({len(raw)} bytes): {err}") from err
        self._feed(chunk)

    def finish(self) -> kv_pb2.KVHeader:
        """End of stream: the header; DATA_LOSS if the stream was truncated. The sink is the caller's."""
        if self._state == "failed":
            raise self._error or KVWireError(grpc.StatusCode.ABORTED, "transfer already failed")
        if self._state != "trailer":
            missing = "header" if self._state == "start" else "trailer"
            exc = KVWireError(_LOSS, f"stream ended before its {missing} (truncated)")
            self._fail(exc)
            raise exc
        self._state = "done"
        return self.header

    def abort(self) -> None:
        """Give up (client went away, deadline, shutdown): release the sink once; idempotent."""
        if self._state not in ("done", "failed"):
            self._fail(KVWireError(grpc.StatusCode.CANCELLED, "transfer aborted"))

    def __enter__(self) -> KVStreamReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.abort()

    # -- internals ---------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._state == "failed":
            raise self._error or KVWireError(grpc.StatusCode.ABORTED, "transfer already failed")
        if self._state == "done":
            raise KVWireError(_INVALID, "message after the transfer finished")

    def _fail(self, exc: BaseException) -> None:
        self._state = "failed"
        self._error = exc if isinstance(exc, KVWireError) else None
        sink, self.sink = self.sink, None  # before calling out: release runs at most once
        if sink is not None:
            sink.release()

    def _feed(self, chunk: kv_pb2.KVChunk) -> None:
        if not isinstance(chunk, kv_pb2.KVChunk):
            raise KVWireError(_INVALID, f"expected a KVChunk, got {type(chunk).__name__}")
        part = chunk.WhichOneof("part")
        if self._state == "start":
            if part == "bundle":  # read by protobuf (not in the canonical form ``split_bundle_wire`` reads)
                self._on_bundle(chunk.bundle)
            elif part != "header":
                raise KVWireError(_INVALID, f"first message must be a header, got {part or 'empty chunk'}")
            else:
                self._on_header(chunk.header)
        elif self._state == "trailer":
            raise KVWireError(_INVALID, f"{part or 'empty chunk'} after the trailer")
        elif part == "data":
            d = chunk.data
            self._on_data(d.layer, d.tensor, d.offset, d.data, d.crc32c)  # .data copies: read once
        elif part == "trailer":
            self._on_trailer(chunk.trailer)
        elif part == "bundle":
            raise KVWireError(_INVALID, "a bundle after the header")
        else:
            raise KVWireError(_INVALID, "second header" if part == "header" else "empty chunk")

    def _on_bundle(self, b: kv_pb2.KVBundle) -> None:
        if not (b.HasField("header") and b.HasField("trailer")):
            raise KVWireError(_INVALID, "a bundle holds its header and its trailer")
        self._on_header(b.header)
        for d in b.data:
            self._on_data(d.layer, d.tensor, d.offset, d.data, d.crc32c)
        self._on_trailer(b.trailer)

    def _on_header(self, header: kv_pb2.KVHeader) -> None:
        self.sink = self._open(header)  # checks the header first
        self._layer_bytes = all_tensor_bytes(header)
        self._filled = [[0] * len(sizes) for sizes in self._layer_bytes]
        self.header = header
        self._state = "streaming"

    def _on_data(self, layer: int, tensor: int, offset: int, payload: bytes | memoryview, crc: int) -> None:
        n = len(payload)
        if crc32c(payload) != crc:
            raise KVWireError(_LOSS, f"CRC-32C mismatch in layer {layer} tensor {tensor} at offset {offset}")
        if layer >= len(self._layer_bytes):
            raise KVWireError(_INVALID, f"layer {layer} not in the header's {len(self._layer_bytes)}")
        if not 0 <= tensor < len(self._layer_bytes[layer]):
            raise KVWireError(_INVALID, f"unknown tensor kind {tensor}")
        if n == 0:
            raise KVWireError(_INVALID, "empty data chunk")
        size, filled = self._layer_bytes[layer][tensor], self._filled[layer][tensor]
        where = f"layer {layer} tensor {tensor}"
        if offset != filled:
            kind = "overlaps" if offset < filled else "leaves a gap after"
            raise KVWireError(_INVALID, f"{where}: offset {offset} {kind} the {filled} bytes received")
        if filled + n > size:
            raise KVWireError(
                _INVALID, f"{where}: chunk ends at {filled + n}, past the tensor's {size} bytes"
            )
        self.sink.write(layer, tensor, offset, payload)
        self._filled[layer][tensor] = filled + n
        self.bytes_received += n
        self.chunks_received += 1

    def _on_trailer(self, t: kv_pb2.KVTrailer) -> None:
        if t.num_chunks != self.chunks_received or t.total_bytes != self.bytes_received:
            raise KVWireError(
                _LOSS,
                f"trailer says {t.num_chunks} chunks / {t.total_bytes} bytes, "
                f"received {self.chunks_received} / {self.bytes_received}",
            )
        for layer, (sizes, filled) in enumerate(zip(self._layer_bytes, self._filled, strict=True)):
            if filled != sizes:
                raise KVWireError(_LOSS, f"layer {layer} incomplete: {filled} of {sizes} bytes per tensor")
        self._state = "trailer"
