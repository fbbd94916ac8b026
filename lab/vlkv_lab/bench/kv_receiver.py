"""A decode worker's receiving side without a model, in its own process: for the hand-off benchmark and tests.

It serves ``TransferKV`` and ``TransferKVNixl`` through the decode worker's own receivers and ``Admission``
over a real ``KVCache`` pool and ``BlockManager`` (a ``DecodeCore`` with no model); every cache that arrives
whole is freed again right after. This is also the tools' and tests' ``TransferKV`` handler. With a
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
from pathlib import Path
from types import SimpleNamespace

import grpc
import torch
from vlkv.common.config import Limits, PoolConfig, TransferConfig
from vlkv.common.handoff.grpc_transport import grpc_message_options, tune_malloc
from vlkv.common.handoff.nixl_agent import POLL_S, NixlAgent
from vlkv.common.model.spec import KVLayout
from vlkv.decode_worker.admission import Admission
from vlkv.decode_worker.core import DecodeCore
from vlkv.decode_worker.grpc_receiver import GrpcKVReceiver
from vlkv.decode_worker.nixl_receiver import NixlKVReceiver
from vlkv.decode_worker.sequence import Sequence
from vlkv.decode_worker.server import add_decode_servicer
from vlkv.v1 import worker_pb2, worker_pb2_grpc

FINGERPRINT = "kv-receiver"


class _FreeOnArrival:
    """Arrivals that free each cache at once (after ``on_arrival``, e.g. a dump), as an unclaimed lease
    would."""

    def __init__(self, core: DecodeCore, on_arrival=None) -> None:
        self.core = core
        self.on_arrival = on_arrival

    def check_new(self, rid: str) -> None:
        pass

    def may_park(self, rid: str, sender: str) -> bool:
        return True

    def begin_transfer(self, rid: str, transfer) -> None:
        pass

    def end_transfer(self, rid: str, transfer) -> None:
        pass

    def superseded(self, transfer) -> bool:
        return False

    def deliver(self, seq: Sequence, sender: str = "") -> bool:
        if self.on_arrival is not None:
            self.on_arrival(seq)
        self.core.blocks.free(seq.blocks)
        return True


class ReceiverServicer(worker_pb2_grpc.DecodeWorkerServicer):
    def __init__(
        self, layout: KVLayout, pool_bytes: int, nixl: bool, dump_dir: str | None, **transfer
    ) -> None:
        t = TransferConfig(**transfer)
        spec = SimpleNamespace(fingerprint=FINGERPRINT, kv_layout=layout, vocab_size=0)
        pool = PoolConfig(pool_bytes=pool_bytes, block_size=16, watermark=0.0)
        self.core = DecodeCore.from_config(None, spec, pool, t.kv_dtype, "cpu")
        self.cache, self.pool = self.core.cache, self.core.blocks
        self.dump_dir = Path(dump_dir) if dump_dir else None
        arrivals = _FreeOnArrival(self.core, self._dump if self.dump_dir is not None else None)
        self.admission = Admission(self.core, spec, arrivals, limits=Limits(), transfer=t)
        self.grpc_receiver = GrpcKVReceiver(self.admission)
        self.nixl_receiver = NixlKVReceiver(self.admission, NixlAgent("decode") if nixl else None)

    def _dump(self, seq: Sequence) -> None:
        parts = []
        for table, k in zip(seq.blocks.tables, seq.lengths, strict=True):
            for t in self.cache.read(table, k):
                parts.append(t.contiguous().view(torch.uint8).reshape(-1).numpy().tobytes())
        (self.dump_dir / f"{seq.request_id}.kv").write_bytes(b"".join(parts))

    async def GetLoad(self, request, context):
        r = self.admission.received
        return worker_pb2.WorkerLoad(
            free_blocks=self.pool.num_free,
            total_blocks=self.pool.num_blocks,
            running=r["grpc"],
            waiting=r["nixl"],
        )

    async def TransferKV(self, request_iterator, context):
        return await self.grpc_receiver.receive(request_iterator, context)

    async def TransferKVNixl(self, request_iterator, context):
        async for reply in self.nixl_receiver.receive(request_iterator, context):
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
