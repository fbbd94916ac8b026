"""Hand-rolled protobuf encoding of the hot message, ``KVChunk{data: KVData}``, with one copy per chunk.

Generic protobuf costs three copies per data chunk on the sender (tensor -> ``bytes`` field ->
serialized message) and two on the receiver (parse, then every ``.data`` access copies again). At
MiB-sized chunks those copies, not the network, bound loopback throughput. So:

- ``encode_data_wire`` writes the exact bytes ``KVChunk(data=KVData(...)).SerializeToString()``
  would (fields in number order, proto3 zero scalars omitted) with a single join;
- ``encode_bundle_wire`` joins a small cache's serialized chunks into one ``KVChunk{bundle: KVBundle}``
  (the bundle's fields carry the chunks' own field numbers, so each chunk's bytes are a bundle entry as
  they are) and ``split_bundle_wire`` hands them back as zero-copy views, each parsed like a message;
- ``parse_data_wire`` reads a canonical data chunk as a zero-copy ``memoryview`` of the payload and
  returns None for anything else (header, trailer, unknown or repeated fields, non-minimal
  lengths, out-of-range values, truncation), which then goes through the real protobuf parser. So
  the fast path never accepts a message protobuf would read differently; the fuzz test checks this.

Each chunk carries the CRC-32C (Castagnoli polynomial, as in iSCSI/SCTP; ``crc32c``) of its payload.
``google_crc32c``'s C extension computes it with the CPU's CRC32 instruction (SSE4.2 / ARMv8), ~10-20
GB/s against ~1-3 GB/s for zlib's CRC-32, which was the main CPU cost of a transfer on both ends.
"""

from __future__ import annotations

import logging
import warnings

import numpy as np

with warnings.catch_warnings():  # its own "using pure Python" warning: we log ours below
    warnings.simplefilter("ignore", RuntimeWarning)
    import google_crc32c

log = logging.getLogger(__name__)

# "c": hardware CRC32C through the C extension; "python": google_crc32c's pure-Python fallback (correct,
# but orders of magnitude slower), used only where its C extension is missing.
CRC32C_IMPLEMENTATION: str = google_crc32c.implementation
_crc32c_value = google_crc32c.value
_crc32c_extend = google_crc32c.extend

if CRC32C_IMPLEMENTATION == "c":

    def crc32c(buf: bytes | bytearray | memoryview) -> int:
        """CRC-32C of ``buf`` without copying it.

        The C extension reads only objects without a buffer-release hook (``bytes``, NumPy arrays), not
        a ``memoryview`` or ``bytearray``; ``np.frombuffer`` wraps any contiguous buffer in an array.
        """
        return _crc32c_value(buf if type(buf) is bytes else np.frombuffer(buf, dtype=np.uint8))

    def crc32c_extend(crc: int, buf: bytes | bytearray | memoryview | np.ndarray) -> int:
        """CRC-32C of the bytes that gave ``crc`` followed by ``buf`` (no copy of ``buf``)."""
        return _crc32c_extend(crc, buf if type(buf) in (bytes, np.ndarray) else np.frombuffer(buf, np.uint8))

else:  # pragma: no cover - only where the wheel's C extension cannot load
    log.warning("google_crc32c has no C extension here: KV chunk checksums use pure Python (slow)")

    def crc32c(buf: bytes | bytearray | memoryview) -> int:
        """CRC-32C of ``buf`` (pure Python: correct, slow)."""
        return _crc32c_value(bytes(buf))

    def crc32c_extend(crc: int, buf: bytes | bytearray | memoryview | np.ndarray) -> int:
        """CRC-32C of the bytes that gave ``crc`` followed by ``buf`` (pure Python: correct, slow)."""
        return _crc32c_extend(crc, bytes(memoryview(buf).cast("B")))


_KV_CHUNK_DATA_TAG = 0x12  # KVChunk field 2 (data), length-delimited
_KV_CHUNK_BUNDLE_TAG = 0x22  # KVChunk field 4 (bundle), length-delimited
_BUNDLE_ENTRY_TAGS = (0x0A, 0x12, 0x1A)  # KVBundle header, data, trailer = KVChunk header, data, trailer
_U32, _U64 = 1 << 32, 1 << 64


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def encode_data_wire(layer: int, tensor: int, offset: int, piece: memoryview) -> bytes:
    """Serialized ``KVChunk(data=KVData(layer, tensor, offset, data=piece, crc32c=crc32c(piece)))``."""
    head = bytearray()
    for key, value in ((0x08, layer), (0x10, tensor), (0x18, offset)):
        if value:
            head.append(key)
            head += _varint(value)
    head.append(0x22)
    head += _varint(piece.nbytes)
    crc = crc32c(piece)
    tail = b"\x2d" + crc.to_bytes(4, "little") if crc else b""
    body_len = len(head) + piece.nbytes + len(tail)
    return b"".join((bytes([_KV_CHUNK_DATA_TAG]), _varint(body_len), head, piece, tail))


def encode_bundle_wire(chunks: list[bytes]) -> bytes:
    """One serialized ``KVChunk{bundle}`` of the serialized header, data and trailer chunks of a stream."""
    return b"".join((bytes([_KV_CHUNK_BUNDLE_TAG]), _varint(sum(map(len, chunks))), *chunks))


def split_bundle_wire(raw: bytes | bytearray | memoryview) -> list[memoryview] | None:
    """The entries of a canonical serialized bundle, each the bytes of the KVChunk it stands for (a
    zero-copy view), in order; None for anything else (protobuf's parser then reads it)."""
    if len(raw) < 2 or raw[0] != _KV_CHUNK_BUNDLE_TAG:
        return None
    size, pos = _read_varint(raw, 1, len(raw))
    end = len(raw)
    if size < 0 or pos + size != end:
        return None
    view, entries = memoryview(raw), []
    while pos < end:
        start = pos
        if raw[pos] not in _BUNDLE_ENTRY_TAGS:
            return None
        length, pos = _read_varint(raw, pos + 1, end)
        if length < 0 or pos + length > end:
            return None
        pos += length
        entries.append(view[start:pos])
    return entries


def _read_varint(buf: bytes | bytearray | memoryview, pos: int, end: int) -> tuple[int, int]:
    """(value, next position); value -1 when truncated, longer than 10 bytes or non-minimal."""
    value = shift = 0
    for i in range(pos, min(end, pos + 10)):
        byte = buf[i]
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            if byte == 0 and i > pos:  # non-minimal encoding: leave it to protobuf
                return -1, i + 1
            return value, i + 1
        shift += 7
    return -1, end


def parse_data_wire(raw: bytes | bytearray | memoryview) -> tuple[int, int, int, memoryview, int] | None:
    """(layer, tensor, offset, payload view, crc32c) of a canonical data chunk, else None."""
    if len(raw) < 2 or raw[0] != _KV_CHUNK_DATA_TAG:
        return None
    size, pos = _read_varint(raw, 1, len(raw))
    end = len(raw)
    if size < 0 or pos + size != end:
        return None
    fields: dict[int, int] = {}
    payload = memoryview(b"")
    while pos < end:
        key, pos = _read_varint(raw, pos, end)
        if key in fields or key < 0:
            return None
        if key in (0x08, 0x10, 0x18):  # layer, tensor, offset: varints
            value, pos = _read_varint(raw, pos, end)
            limit = _U64 if key == 0x18 else _U32 if key == 0x08 else 1 << 31
            if not 0 <= value < limit:
                return None
            fields[key] = value
        elif key == 0x22:  # data
            length, pos = _read_varint(raw, pos, end)
            if length < 0 or pos + length > end:
                return None
            payload = memoryview(raw)[pos : pos + length]
            fields[key], pos = length, pos + length
        elif key == 0x2D and pos + 4 <= end:  # crc32c: fixed32
            fields[key], pos = int.from_bytes(raw[pos : pos + 4], "little"), pos + 4
        else:
            return None
    if pos != end:
        return None
    return fields.get(0x08, 0), fields.get(0x10, 0), fields.get(0x18, 0), payload, fields.get(0x2D, 0)
