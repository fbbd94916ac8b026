"""Compact-KV hand-off through ``torch.distributed`` point-to-point (NCCL on one node, gloo on CPU).

Protocol between the sender and the receiver rank (all tensors on the backend's device):
1. sender -> receiver: int64 ``[MAGIC, FORMAT_VERSION, header_len, 0]``, then the serialized
   ``KVHeader`` as ``header_len`` uint8.
2. receiver validates the header with the same rules as ``KVAssembler`` (``validate_header``), calls
   ``allocate(header)`` only if it passed, and answers int64 ``[status]`` (0 = go on, else the
   ``grpc.StatusCode`` value of the refusal) so a refused sender never blocks on sends nobody posts.
3. sender -> receiver: per layer, K then V as raw bytes (a uint8 view, so bf16 works on every
   backend). Layer l is posted with ``isend`` and the next layer is produced while it is in flight;
   at most ``window`` layers are in flight, bounding the memory held alive for pending sends.

There are no checksums: the link is in-node (NVLink/PCIe/shared memory). A peer that dies surfaces
as a backend error (after the process group's timeout), mapped to KVWireError(DATA_LOSS), with the
allocation released. A sender whose layer iterator fails after the receiver accepted leaves the receiver
waiting until that timeout: keep the process-group timeout short (seconds) for hand-off groups.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import grpc
import torch
import torch.distributed as dist
from google.protobuf.message import DecodeError
from vlkv.common.handoff.assembler import validate_header
from vlkv.common.handoff.compact_kv import CompactKV
from vlkv.common.handoff.grpc_transport import Layers
from vlkv.common.handoff.wire import DTYPES, FORMAT_VERSION, KVWireError
from vlkv.common.model.spec import KVLayout
from vlkv.v1 import kv_pb2, worker_pb2

MAGIC = 0x564C4B56  # "VLKV"
_STATUS = {c.value[0]: c for c in grpc.StatusCode}


def _device(group: dist.ProcessGroup | None) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _raw(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t.detach().to(device).contiguous().view(torch.uint8)


def send_compact_kv(
    header: kv_pb2.KVChunk,
    layers: Layers,
    dst: int,
    *,
    group: dist.ProcessGroup | None = None,
    window: int = 2,
) -> int:
    """Send one cache to rank ``dst``; returns payload bytes. Raises KVWireError if refused."""
    device = _device(group)
    h = header.header
    blob = h.SerializeToString()
    meta = torch.tensor([MAGIC, FORMAT_VERSION, len(blob), 0], dtype=torch.int64, device=device)
    dist.send(meta, dst, group=group)
    dist.send(torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(device), dst, group=group)
    status = torch.zeros(1, dtype=torch.int64, device=device)
    dist.recv(status, dst, group=group)
    if int(status.item()) != 0:
        code = _STATUS.get(int(status.item()), grpc.StatusCode.UNKNOWN)
        raise KVWireError(code, f"rank {dst} refused the KV cache of request {h.request_id!r}")
    pending: list[tuple[list[dist.Work], list[torch.Tensor]]] = []  # tensors stay alive until sent
    total = seen = 0
    dtype = DTYPES[h.dtype]
    try:
        for layer, (k, v) in enumerate(layers):
            if layer >= h.num_layers:
                raise ValueError(f"more layers than the header's {h.num_layers}")
            shape = (h.num_kv_heads, h.layer_lengths[layer], h.head_dim)
            if any(tuple(t.shape) != shape or t.dtype != dtype for t in (k, v)):
                raise ValueError(f"layer {layer} does not match the header's {shape} {dtype}")
            raw = [_raw(k, device), _raw(v, device)]
            pending.append(([dist.isend(t, dst, group=group) for t in raw], raw))
            total += sum(t.numel() for t in raw)
            seen = layer + 1
            while len(pending) > window:  # at most `window` layers in flight while the next is produced
                for work in pending.pop(0)[0]:
                    work.wait()
    finally:  # also on a producer error: posted sends must finish before their buffers can go
        for works, _ in pending:
            for work in works:
                with contextlib.suppress(RuntimeError):
                    work.wait()
    if seen != h.num_layers:
        raise ValueError(f"sent {seen} layers, the header announced {h.num_layers}")
    return total


def recv_compact_kv(
    src: int,
    expected_fingerprint: str,
    expected_layout: KVLayout,
    *,
    group: dist.ProcessGroup | None = None,
    allocate: Callable[[kv_pb2.KVHeader], object] | None = None,
    release: Callable[[object], None] | None = None,
    max_header_bytes: int = 1 << 16,
    **limits: int,
) -> tuple[kv_pb2.KVHeader, CompactKV, object]:
    """Receive one cache from rank ``src``: ``(header, CompactKV, allocate's handle)``.

    Refusals (INVALID_ARGUMENT, FAILED_PRECONDITION, or a KVWireError raised by ``allocate``) are
    reported to the sender before raising here. ``limits`` go to ``validate_header``.
    """
    device = _device(group)
    meta = torch.zeros(4, dtype=torch.int64, device=device)
    dist.recv(meta, src, group=group)
    magic, version, blob_len, _ = (int(x) for x in meta.tolist())
    if magic != MAGIC or version != FORMAT_VERSION or not 0 < blob_len <= max_header_bytes:
        # The stream is not ours or is desynchronized: no status reply, the sender's state is unknown.
        raise KVWireError(grpc.StatusCode.INVALID_ARGUMENT, f"bad KV metadata {meta.tolist()}")
    blob = torch.empty(blob_len, dtype=torch.uint8, device=device)
    dist.recv(blob, src, group=group)
    status = torch.zeros(1, dtype=torch.int64, device=device)
    allocated, handle = False, None
    try:
        header = kv_pb2.KVHeader()
        try:
            header.ParseFromString(blob.cpu().numpy().tobytes())
        except DecodeError as err:
            raise KVWireError(grpc.StatusCode.INVALID_ARGUMENT, f"unparsable KV header: {err}") from err
        validate_header(
            header, expected_fingerprint, expected_layout, max_header_bytes=max_header_bytes, **limits
        )
        handle = allocate(header) if allocate is not None else None
        allocated = True
    except KVWireError as err:
        status[0] = err.code.value[0]
        dist.send(status, src, group=group)
        raise
    try:
        dist.send(status, src, group=group)
        dtype = DTYPES[header.dtype]
        keys, values = [], []
        for k_l in header.layer_lengths:
            shape = (header.num_kv_heads, k_l, header.head_dim)
            pair = [torch.empty(shape, dtype=dtype, device=device) for _ in range(2)]
            works = [dist.irecv(t.view(torch.uint8), src, group=group) for t in pair]
            for work in works:
                work.wait()
            keys.append(pair[0])
            values.append(pair[1])
        ckv = CompactKV(keys, values, prompt_length=header.prompt_length, first_token=header.first_token_id)
    except BaseException as err:
        if allocated and release is not None:
            release(handle)
        if isinstance(err, RuntimeError):
            raise KVWireError(grpc.StatusCode.DATA_LOSS, f"KV transfer from rank {src} broke: {err}") from err
        raise
    return header, ckv, handle


class TorchDistKVSender:
    """``KVSender`` over torch.distributed; the blocking collectives run in a worker thread."""

    def __init__(self, dst: int, *, group: dist.ProcessGroup | None = None, window: int = 2) -> None:
        self.dst, self.group, self.window = dst, group, window

    async def send(self, header: kv_pb2.KVChunk, layers: Layers) -> worker_pb2.TransferAck:
        """Send and report the payload bytes (the receiver's allocation is not echoed back)."""
        total = await asyncio.to_thread(
            send_compact_kv, header, layers, self.dst, group=self.group, window=self.window
        )
        return worker_pb2.TransferAck(bytes_received=total)
