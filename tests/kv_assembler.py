"""The KV wire reader with a host sink, for tests: ``KVAssembler(...)`` -> ``feed`` -> ``finish()`` returns
``(header, CompactKV)``. The product's reader writes into pool blocks instead (``decode_worker/grpc_receiver.py``
``PoolSink``); both are ``common/handoff/assembler.py`` ``KVStreamReader`` with its one ``validate_header``.

The pool handle returned by ``allocate`` (run only after the header passed every check, so a cache for
another model never touches the pool) is given back through ``release`` on failure, and belongs to the
caller after ``finish()``. Buffers are allocated lazily per tensor, so a header that lies about sizes costs
no memory until bytes actually arrive. A tensor that arrives whole in one chunk of an immutable ``bytes``
message is not copied: its tensor is a ``torch.frombuffer`` view of that message (read it, never write it).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from vlkv.common.handoff.assembler import KVStreamReader, all_tensor_bytes, validate_header
from vlkv.common.handoff.compact_kv import CompactKV
from vlkv.common.handoff.wire import DTYPES, layer_shapes
from vlkv.common.model.spec import KVLayout
from vlkv.v1 import kv_pb2


def _immutable(payload: bytes | memoryview) -> bool:
    """Whether ``payload``'s memory can never change (``bytes``, or a view of ``bytes``)."""
    return type(payload) is bytes or (isinstance(payload, memoryview) and type(payload.obj) is bytes)


def _byte_view(payload: bytes | memoryview) -> torch.Tensor:
    """A uint8 tensor sharing ``payload``'s memory (it keeps the received message alive)."""
    with warnings.catch_warnings():  # received bytes are immutable; the decoded cache is only read
        warnings.filterwarnings("ignore", "The given buffer is not writable", UserWarning)
        return torch.frombuffer(payload, dtype=torch.uint8)


class _HostSink:
    """Per-tensor host buffers (a tensor that arrives whole in one immutable message is a view of it)."""

    def __init__(self, header: kv_pb2.KVHeader, handle: object, release: Callable[[object], None] | None):
        self.handle = handle
        self._release = release
        self.bufs: list[list[torch.Tensor | None]] = [[None] * len(s) for s in all_tensor_bytes(header)]
        self._sizes = all_tensor_bytes(header)

    def write(self, layer: int, tensor: int, offset: int, payload: bytes | memoryview) -> None:
        n, size = len(payload), self._sizes[layer][tensor]
        buf = self.bufs[layer][tensor]
        if buf is None and n == size and _immutable(payload):  # whole tensor in one chunk: a view
            self.bufs[layer][tensor] = _byte_view(payload)
            return
        if buf is None:
            buf = self.bufs[layer][tensor] = torch.empty(size, dtype=torch.uint8)
        memoryview(buf.numpy())[offset : offset + n] = payload

    def release(self) -> None:
        self.bufs = []
        if self._release is not None:
            self._release(self.handle)


class KVAssembler(KVStreamReader):
    """``KVStreamReader`` into host buffers: ``finish()`` returns ``(header, CompactKV)``."""

    def __init__(
        self,
        expected_fingerprint: str,
        expected_layout: KVLayout,
        *,
        allocate: Callable[[kv_pb2.KVHeader], object] | None = None,
        release: Callable[[object], None] | None = None,
        **limits,
    ) -> None:
        """``allocate(header)`` reserves pool blocks (raise KVWireError(RESOURCE_EXHAUSTED) to refuse);
        whatever it returns is passed to ``release`` if the transfer fails afterwards. ``limits``:
        ``validate_header``'s (``max_total_bytes``, ``expected_kv_dtype``, ...)."""
        self.expected_bytes = 0
        self.handle: object = None
        self._scores: list[torch.Tensor] | None = None

        def open_host(header: kv_pb2.KVHeader) -> _HostSink:
            self.expected_bytes, self._scores = validate_header(
                header, expected_fingerprint, expected_layout, **limits
            )
            self.handle = allocate(header) if allocate is not None else None
            return _HostSink(header, self.handle, release)

        super().__init__(open_host)

    def finish(self) -> tuple[kv_pb2.KVHeader, CompactKV]:  # type: ignore[override]
        """End of stream: the header and the decoded cache; DATA_LOSS if the stream was truncated."""
        sink = self.sink
        h = super().finish()
        layers = [
            [
                buf.view(dtype).view(shape)
                for buf, (shape, dtype) in zip(bufs, layer_shapes(h, i), strict=True)
            ]
            for i, bufs in enumerate(sink.bufs)
        ]
        sink.bufs = []
        keys, values = [t[0] for t in layers], [t[1] for t in layers]
        scales = {}
        if h.kv_dtype:
            scales = dict(
                k_scales=[t[2] for t in layers],
                v_scales=[t[3] for t in layers],
                source_dtype=DTYPES[h.dtype],
                qformat=h.kv_dtype,
            )
        ckv = CompactKV(
            keys,
            values,
            prompt_length=h.prompt_length,
            first_token=h.first_token_id,
            prompt_scores=self._scores,
            **scales,
        )
        return h, ckv
