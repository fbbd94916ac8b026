"""A decode worker's receiving side without a model, in its own process: for the hand-off benchmark and tests.

It serves ``TransferKV`` and ``TransferKVNixl`` through the decode worker's own ``TransferReceiver`` over a
real ``KVCache`` pool and ``BlockManager``; every cache that arrives whole is freed again right after. With a
``dump_dir``, each arrived cache is first read back from the pool and written there as raw bytes
(``<request id>.kv``: every layer's K then V, ``[H_kv, k_l, D]``, then with ``kv_dtype="int8"`` its K and V
scales), so a test can compare bit for bit.
``GetLoad`` reports the pool's free and total blocks, and caches received over gRPC (``running``) and NIXL
(``waiting``).

    serve([layout, ...], port_q, stop, pool_mib=..., dump_dir=None, nixl=True)   # multiprocessing target
    serve_raw(nbytes, port_q, stop)   # NIXL alone: one registered buffer, no vlkv receiving code
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import grpc
import torch
from vlkv.common.config import DecodeConfig, Limits, PoolConfig, TransferConfig
from vlkv.common.handoff.grpc_transport import grpc_message_options, tune_malloc
from vlkv.common.handoff.nixl_agent import POLL_S, NixlAgent
from vlkv.common.model.spec import KVLayout
from vlkv.decode_worker.block_manager import AdmissionPolicy, BlockManager, SequenceBlocks
from vlkv.decode_worker.kv_cache import KVCache
from vlkv.decode_worker.rendezvous import Rendezvous
from vlkv.decode_worker.server import add_decode_servicer
from vlkv.decode_worker.transfers import TransferReceiver
from vlkv.v1 import worker_pb2, worker_pb2_grpc

FINGERPRINT = "kv-receiver"


@dataclass(eq=False)
class Arrived:
    request_id: str
    blocks: SequenceBlocks
    lengths: list[int] = field(default_factory=list)


class ReceiverServicer(worker_pb2_grpc.DecodeWorkerServicer):
    def __init__(
        self, layout: KVLayout, pool_bytes: int, nixl: bool, dump_dir: str | None, **transfer
    ) -> None:
        layers, heads, dim, dtype = layout
        kv_dtype = transfer.get("kv_dtype", "fp16")
        self.cache = KVCache.from_bytes(pool_bytes, 16, heads, dim, dtype, kv_dtype=kv_dtype)
        self.pool = BlockManager(self.cache.num_blocks, 16, AdmissionPolicy(False, 0))
        cfg = DecodeConfig(Limits(), PoolConfig(pool_bytes=pool_bytes), "cpu", TransferConfig(**transfer))
        spec = SimpleNamespace(fingerprint=FINGERPRINT, kv_layout=layout, vocab_size=0)
        self.rendezvous = Rendezvous(
            lambda s: self.pool.free(s.blocks),
            claim_wait_s=1,
            unclaimed_lease_s=1e-3,
            max_unclaimed_per_sender=1 << 20,
        )
        self.dump_dir = Path(dump_dir) if dump_dir else None
        agent = NixlAgent("decode") if nixl else None
        self.receiver = TransferReceiver(
            spec, cfg, self.pool, self.cache, self.rendezvous, lambda h: None, self._arrived, lambda: 0, agent
        )

    def _arrived(self, header, sampling, blocks: SequenceBlocks) -> Arrived:
        seq = Arrived(header.request_id, blocks, list(header.layer_lengths))
        if self.dump_dir is not None:
            parts = []
            for table, k in zip(blocks.tables, seq.lengths, strict=True):
                for t in self.cache.read(table, k):
                    parts.append(t.contiguous().view(torch.uint8).reshape(-1).numpy().tobytes())
            (self.dump_dir / f"{header.request_id}.kv").write_bytes(b"".join(parts))
        return seq

    async def GetLoad(self, request, context):
        r = self.receiver.received
        return worker_pb2.WorkerLoad(
            free_blocks=self.pool.num_free,
            total_blocks=self.pool.num_blocks,
            running=r["grpc"],
            waiting=r["nixl"],
        )

    async def TransferKV(self, request_iterator, context):
        return await self.receiver.grpc(request_iterator, context)

    async def TransferKVNixl(self, request_iterator, context):
        async for reply in self.receiver.nixl_stream(request_iterator, context):
            yield reply


def serve(
    layouts: list[KVLayout],
    port_q: mp.Queue,
    stop: mp.Event,
    pool_mib: int = 1280,
    dump_dir: str | None = None,
    nixl: bool = True,
    **transfer,
) -> None:
    """One receiver per layout, each on a free loopback port (``[(port, blocks)]`` put on ``port_q``), until
    ``stop`` is set."""
    tune_malloc()
    torch.set_num_threads(1)  # as a decode worker runs (ModelConfig.torch_threads)

    async def main() -> None:
        servers, ports = [], []
        for layout in layouts:
            servicer = ReceiverServicer(layout, pool_mib << 20, nixl, dump_dir, **transfer)
            server = grpc.aio.server(options=grpc_message_options())
            add_decode_servicer(servicer, server)
            ports.append((server.add_insecure_port("127.0.0.1:0"), servicer.cache.num_blocks))
            await server.start()
            servers.append(server)
        port_q.put(ports)
        while not stop.is_set():
            await asyncio.sleep(0.05)
        for server in servers:
            await server.stop(1)

    asyncio.run(main())


def serve_raw(nbytes: int, port_q: mp.Queue, stop: mp.Event) -> None:
    """The ceiling for the NIXL column: an agent with one registered ``nbytes`` buffer that a peer writes
    into, and nothing else (no admission, regions, checksums). Puts ``(agent name, metadata, buffer
    address)`` on ``port_q``; progresses the agent every ``POLL_S`` (UCX over TCP needs the target to) until
    ``stop`` is set."""
    agent = NixlAgent("raw-receiver")
    buf = torch.zeros(nbytes, dtype=torch.uint8)
    agent.register([buf])
    port_q.put((agent.name, agent.metadata, buf.data_ptr()))
    while not stop.is_set():
        agent.progress()  # its notifications are not used
        time.sleep(POLL_S)
