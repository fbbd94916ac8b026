"""The compact-KV wire format: one ``KVHeader``, per-layer K/V byte chunks with CRC-32C, one ``KVTrailer``.

Sender: ``encode_compact_kv`` (or ``encode_header`` + ``encode_stream`` when layers are gathered one by
one) yields ``KVChunk`` messages lazily, so layer l is on the wire while layer l+1 is being produced.
Bytes are taken straight from tensor memory (a uint8 view; bf16 has no numpy dtype) in little-endian
host order; the only copy is the one protobuf makes into its ``bytes`` field (``wire=True`` streams
skip protobuf: ``codec`` serializes each chunk with one copy).

Format version 1 (``FORMAT_VERSION``; a receiver refuses any other with INVALID_ARGUMENT): the messages
of ``protos/vlkv/v1/kv.proto``, each data chunk checksummed with CRC-32C (``KVData.crc32c``,
hardware-accelerated through ``google_crc32c``). Development builds before any deployment used zlib's
CRC-32 under the same version number; no deployed peer speaks that.

Receiver: ``assembler.KVStreamReader`` validates the stream and hands each checked chunk to a sink (the
decode worker's writes into pool blocks). Status codes:
protocol violations (bad order, bad header, unknown layer, offset gaps/overlaps) are INVALID_ARGUMENT;
evidence of corruption or loss (CRC mismatch, trailer totals disagree, stream ends early, bytes
missing) is DATA_LOSS; a sane cache built for another model/layout/dtype is FAILED_PRECONDITION.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import grpc
import numpy as np
import torch
from vlkv.common.handoff.codec import crc32c, encode_data_wire
from vlkv.common.handoff.compact_kv import CompactKV
from vlkv.common.handoff.quantize import SCALE_DTYPE
from vlkv.v1 import generate_pb2, kv_pb2

FORMAT_VERSION = 1  # see the module docstring; bump on any incompatible change
# 4 MiB: fewer messages (gRPC's per-message cost) and, for a 7B-shaped cache at 2K tokens, every
# per-layer K or V (H_kv * k_l * D * 2 bytes <= 4 MiB) travels whole, which the receiver keeps as a
# view of the message instead of copying (see ``assembler``).
DEFAULT_CHUNK_BYTES = 4 << 20
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
PROMPT_SCORE_DTYPE = torch.float16  # KVHeader.prompt_scores


class KVWireError(Exception):
    """A rejected KV stream; ``code`` is the gRPC status the receiver should answer with, ``reason`` the
    machine-readable ``worker_pb2.Refusal`` its sender acts on (``errors.refusal_metadata``)."""

    def __init__(self, code: grpc.StatusCode, message: str, reason: int = 0) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.reason = reason


def dtype_name(dtype: torch.dtype | str) -> str:
    """Wire name of a KV dtype ("float32", "float16", "bfloat16"); ValueError for anything else."""
    name = dtype if isinstance(dtype, str) else DTYPE_NAMES.get(dtype, "")
    if name not in DTYPES:
        raise ValueError(f"unsupported KV dtype {dtype!r}; expected one of {sorted(DTYPES)}")
    return name


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """Flat byte view of ``t``'s memory (zero-copy for a contiguous CPU tensor, else one copy)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    return memoryview(t.view(torch.uint8).numpy())


def encode_header(
    *,
    request_id: str,
    fingerprint: str,
    dtype: torch.dtype | str,
    num_kv_heads: int,
    head_dim: int,
    layer_lengths: Sequence[int],
    prompt_length: int,
    first_token_id: int = 0,
    sampling: generate_pb2.SamplingParams | None = None,
    eos_token_ids: Iterable[int] = (),
    prompt_tokens: int = 0,
    vision_tokens: int = 0,
    policy: str = "",
    kv_dtype: str = "",
    prompt_scores: Sequence[torch.Tensor] | None = None,
) -> kv_pb2.KVChunk:
    """The header chunk; ``layer_lengths`` (k_l) must be known before the first layer is sent.
    ``dtype``: the model's KV dtype; ``kv_dtype``: "int8" when the layers travel quantized (with scales);
    ``prompt_scores``: per layer ``[k_l]`` (``CompactKV.prompt_scores``), sent as fp16."""
    header = kv_pb2.KVHeader(
        format_version=FORMAT_VERSION,
        request_id=request_id,
        model_fingerprint=fingerprint,
        dtype=dtype_name(dtype),
        num_layers=len(layer_lengths),
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        layer_lengths=list(layer_lengths),
        prompt_length=prompt_length,
        first_token_id=first_token_id,
        eos_token_ids=list(eos_token_ids),
        prompt_tokens=prompt_tokens,
        vision_tokens=vision_tokens,
        policy=policy,
        kv_dtype="" if kv_dtype == "fp16" else kv_dtype,
        prompt_scores=[bytes(tensor_bytes(t.to(PROMPT_SCORE_DTYPE))) for t in prompt_scores or ()],
    )
    if sampling is not None:
        header.sampling.CopyFrom(sampling)
    return kv_pb2.KVChunk(header=header)


_KINDS = (
    kv_pb2.KV_TENSOR_KEY,
    kv_pb2.KV_TENSOR_VALUE,
    kv_pb2.KV_TENSOR_KEY_SCALE,
    kv_pb2.KV_TENSOR_VALUE_SCALE,
)


def layer_shapes(h: kv_pb2.KVHeader, layer: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """(shape, dtype) of each tensor of layer ``layer`` in wire order: K, V (and K, V scales for int8)."""
    kv = (h.num_kv_heads, h.layer_lengths[layer], h.head_dim)
    if not h.kv_dtype:
        return [(kv, DTYPES[h.dtype])] * 2
    return [(kv, torch.int8), (kv, torch.int8), (kv[::2], SCALE_DTYPE), (kv[:2], SCALE_DTYPE)]


def encode_layer(
    layer_idx: int, k: torch.Tensor, v: torch.Tensor, chunk_bytes: int = DEFAULT_CHUNK_BYTES, *scales
) -> Iterator[kv_pb2.KVChunk]:
    """Data chunks of one layer: K's bytes then V's (then an int8 layer's K and V ``scales``), each split
    into pieces of <= ``chunk_bytes``."""
    for kind, off, piece in _pieces((k, v, *scales), chunk_bytes):
        data = kv_pb2.KVData(
            layer=layer_idx, tensor=kind, offset=off, data=bytes(piece), crc32c=crc32c(piece)
        )
        yield kv_pb2.KVChunk(data=data)


def encode_layer_wire(
    layer_idx: int, k: torch.Tensor, v: torch.Tensor, chunk_bytes: int = DEFAULT_CHUNK_BYTES, *scales
) -> Iterator[bytes]:
    """``encode_layer`` already serialized, copying each piece once (see ``codec``)."""
    for kind, off, piece in _pieces((k, v, *scales), chunk_bytes):
        yield encode_data_wire(layer_idx, kind, off, piece)


def _pieces(tensors: tuple[torch.Tensor, ...], chunk_bytes: int) -> Iterator[tuple[int, int, memoryview]]:
    if chunk_bytes <= 0:
        raise ValueError("chunk_bytes must be positive")
    for kind, t in zip(_KINDS, tensors, strict=False):
        mv = tensor_bytes(t)
        for off in range(0, mv.nbytes, chunk_bytes):
            yield kind, off, mv[off : off + chunk_bytes]


def encode_trailer(num_chunks: int, total_bytes: int) -> kv_pb2.KVChunk:
    """The trailer: how many data chunks and payload bytes the sender produced."""
    return kv_pb2.KVChunk(trailer=kv_pb2.KVTrailer(num_chunks=num_chunks, total_bytes=total_bytes))


def encode_stream(
    header: kv_pb2.KVChunk,
    layers: Iterable[tuple[torch.Tensor, torch.Tensor]],
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    *,
    wire: bool = False,
) -> Iterator[kv_pb2.KVChunk] | Iterator[bytes]:
    """Header, the chunks of each (K, V) pair as ``layers`` yields it, then the trailer.

    ``wire=True`` yields serialized messages instead (for a bytes-level transport such as gRPC with
    an identity serializer), which saves two copies per chunk.

    Each layer is checked against the header (shape ``[H_kv, k_l, D]``, dtype; an int8 layer is
    ``(k, v, k_scale, v_scale)``) before it is sent, so a sender bug surfaces as ValueError here rather
    than as a rejected stream on the decode side.
    """
    h = header.header
    encode = encode_layer_wire if wire else encode_layer
    yield header.SerializeToString() if wire else header
    num_chunks = total = seen = 0
    for layer_idx, tensors in enumerate(layers):
        if layer_idx >= h.num_layers:
            raise ValueError(f"more layers than the header's {h.num_layers}")
        want = layer_shapes(h, layer_idx)
        if len(tensors) != len(want):
            raise ValueError(f"layer {layer_idx}: {len(tensors)} tensors, header needs {len(want)}")
        for t, (shape, dtype) in zip(tensors, want, strict=True):
            if tuple(t.shape) != shape or t.dtype != dtype:
                raise ValueError(
                    f"layer {layer_idx}: {tuple(t.shape)} {t.dtype}, header says {shape} {dtype}"
                )
        k, v, *scales = tensors
        for chunk in encode(layer_idx, k, v, chunk_bytes, *scales):
            num_chunks += 1
            yield chunk
        total += sum(t.numel() * t.element_size() for t in tensors)
        seen = layer_idx + 1
    if seen != h.num_layers:
        raise ValueError(f"got {seen} layers, the header announced {h.num_layers}")
    trailer = encode_trailer(num_chunks, total)
    yield trailer.SerializeToString() if wire else trailer


def compact_header(
    ckv: CompactKV,
    *,
    request_id: str,
    fingerprint: str,
    sampling: generate_pb2.SamplingParams | None = None,
    eos_token_ids: Iterable[int] = (),
    prompt_tokens: int = 0,
    vision_tokens: int = 0,
    policy: str = "",
) -> kv_pb2.KVChunk:
    """The header chunk describing ``ckv`` (its layout, per-layer lengths and first token)."""
    return encode_header(
        request_id=request_id,
        fingerprint=fingerprint,
        dtype=ckv.source_dtype if ckv.quantized else ckv.dtype,
        num_kv_heads=ckv.num_kv_heads,
        head_dim=ckv.head_dim,
        layer_lengths=ckv.layer_lengths,
        prompt_length=ckv.prompt_length,
        first_token_id=ckv.first_token,
        sampling=sampling,
        eos_token_ids=eos_token_ids,
        prompt_tokens=prompt_tokens,
        vision_tokens=vision_tokens,
        policy=policy,
        kv_dtype=ckv.kv_dtype,
        prompt_scores=ckv.prompt_scores,
    )


def header_prompt_scores(h: kv_pb2.KVHeader) -> list[torch.Tensor] | None:
    """The header's ``prompt_scores`` as per-layer fp16 ``[k_l]`` tensors (None when it has none); a wrong
    count or size, or a value that is negative or not finite, is INVALID_ARGUMENT."""
    raw = h.prompt_scores
    if not raw:
        return None
    if len(raw) != len(h.layer_lengths):
        raise KVWireError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"bad KV header: {len(raw)} prompt_scores for {len(h.layer_lengths)} layers",
        )
    size = PROMPT_SCORE_DTYPE.itemsize
    out = []
    for layer, (b, n) in enumerate(zip(raw, h.layer_lengths, strict=True)):
        if len(b) != n * size:
            raise KVWireError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"bad KV header: layer {layer}'s prompt_scores hold {len(b)} bytes, expected {n * size}",
            )
        a = np.frombuffer(b, dtype=np.float16)
        if not (np.isfinite(a).all() and (a >= 0).all()):
            raise KVWireError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"bad KV header: layer {layer}'s prompt_scores hold a negative or non-finite value",
            )
        t = torch.from_numpy(a.copy())
        out.append(t)
    return out


def compact_layers(ckv: CompactKV) -> Iterator[tuple[torch.Tensor, ...]]:
    """The tensors of each layer in wire order: (K, V), or (K, V, K scales, V scales) for int8."""
    if ckv.quantized:
        return zip(ckv.keys, ckv.values, ckv.k_scales, ckv.v_scales, strict=True)
    return zip(ckv.keys, ckv.values, strict=True)


def encode_compact_kv(
    ckv: CompactKV,
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    wire: bool = False,
    **header_fields,
) -> Iterator[kv_pb2.KVChunk] | Iterator[bytes]:
    """The whole wire stream of ``ckv`` (a lazy generator: header, layer chunks, trailer); ``header_fields``
    go to ``compact_header``. ``wire=True`` yields the serialized messages (see ``encode_stream``)."""
    header = compact_header(ckv, **header_fields)
    return encode_stream(header, compact_layers(ckv), chunk_bytes, wire=wire)
