"""Benchmark of the compact-KV hand-off: bytes on the wire and gRPC vs plain-TCP loopback throughput.

A 2K-token prompt on a 7B-shaped layout (32 layers, 8 KV heads, head dim 128, fp16) at budgets 10%
and 100%. Receivers run in a separate process. Four transfers of the same cache, interleaved in
every repeat so they see the same machine load (ratios are medians of per-repeat ratios):

- gRPC: the decode worker's own ``TransferKV`` receiver (``kv_receiver``: raw bytes, CRC-32C and finite
  checks, each chunk written straight into a real ``KVCache`` pool's blocks, admission and arrival); the
  client encodes lazily from the tensors (CRC-32C, one-copy framing) and streams through ``GrpcKVSender``,
  as the prefill worker does.
- TCP: a plain socket sending the already-serialized chunk bytes, drained into a buffer: the ceiling.
- TCP+fmt (diagnostic): the same socket, but the sender encodes lazily and the receiver runs the same
  ``KVStreamReader`` (header checks, order, CRC-32C) on length-prefixed messages, copying each payload
  into host buffers - what the wire format costs without gRPC.
- gRPC raw (diagnostic): grpcio's own data path with no vlkv work at all - the same channel options and
  ``GrpcKVSender.send_chunks`` stream the already-serialized chunk bytes into a handler that only counts
  them (no encode, no CRC-32C, no assembler): the ceiling any code on top of grpcio can reach.

CPU s/GB is the user+system time of the sender and the receiving process per GB moved, averaged over
the repeats (also split into send/recv): on a machine whose cores are busy with other work, throughput
follows it. The load average before and after the run is printed: the TCP ceiling moves with it.

Where gRPC loses (grpcio 1.85.1, the newest release; 2-vCPU KVM guest, ``perf record`` at 100%): its
Python layer needs a ``bytes`` per message, copies it once more into a core slice when sending, and
copies every received slice into a ``bytes`` and joins those when receiving - four user-space copies per
byte (~0.11 s/GB each) on top of the kernel's two, plus event-engine thread wake-ups per read (the
receiver's kernel time is ~0.5 s/GB against TCP's ~0.26) and ~0.15 ms of CPU per message per side.
Channel options (HTTP/2 frame size up to 16 MiB, lookahead/BDP windows, write buffer, TCP read chunk
and buffer sizes, TX zero-copy), chunk sizes (0.25-4 MiB) and several concurrent streams per transfer
do not lower that CPU per GB. So "gRPC raw" - grpcio alone, no vlkv work - stays around 50-65% of the plain socket,
and the product path (which adds CRC-32C on both ends, ~0.09 s/GB each, and the one copy that makes the
message) sits about 10-15 points below it. At the 10% budget, 66 messages of ~0.4 MB each, the
per-message cost dominates.

- NIXL: the product's ``NixlKVSender`` against the decode worker's own receiver (``kv_receiver``: a real
  ``KVCache`` pool): header over gRPC, regions back, each layer packed into block order (a two-layer
  staging ring, checksummed and checked finite while in cache) and written by NIXL (UCX; ``cma`` on one
  node: one kernel copy) straight into the pool blocks with a per-layer notification, each layer's CRC-32C
  taken where it landed as its notification arrives (no copy on the decode side), then done and the ack.
  Set ``UCX_TLS=tcp`` for the cross-node path (UCX over TCP sockets) on one host. Per byte NIXL does one
  pack copy, the UCX copy, a CRC-32C on each side and a finiteness pass; the TCP column does two kernel
  copies and nothing else, so on a machine short of CPU the ratio follows the CPU per GB.
- NIXL raw (diagnostic): NIXL alone, the ceiling for the NIXL column: the same K and V bytes, already
  contiguous in a registered buffer, written with one WRITE (one descriptor per tensor) into a registered
  buffer of a process that runs no vlkv code (``kv_receiver.serve_raw``): no header, regions, packing,
  checksums or notifications.

    python -m vlkv_lab.bench.kv_wire [--out out/bench_kv_wire] [--repeats 7] [--chunk-mib 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing as mp
import os
import socket
import statistics
import time
from pathlib import Path

import grpc
import numpy as np
import torch
from vlkv.common.handoff.assembler import KVStreamReader, all_tensor_bytes, validate_header
from vlkv.common.handoff.compact_kv import CompactKV
from vlkv.common.handoff.grpc_transport import (
    TRANSFER_KV_METHOD,
    GrpcKVSender,
    grpc_message_options,
    tune_malloc,
)
from vlkv.common.handoff.nixl_agent import NixlAgent
from vlkv.common.handoff.nixl_sender import NixlKVSender, StagingPool
from vlkv.common.handoff.wire import DEFAULT_CHUNK_BYTES, compact_header, encode_compact_kv, encode_stream
from vlkv.v1 import worker_pb2

from vlkv_lab.bench import kv_receiver

LAYOUT = (32, 8, 128, torch.float16)  # L, H_kv, D, dtype
PROMPT = 2048
FINGERPRINT = "bench-7b-shape"
GRPC_FRAMING = 5  # gRPC's length prefix per message (HTTP/2 frame headers not counted)
KINDS = ("grpc", "tcp", "tcp_fmt", "grpc_raw", "nixl", "nixl_raw")


def make_cache(budget: float, seed: int = 0) -> CompactKV:
    """Per-layer budgets falling linearly from 1.5x to 0.5x of ``budget`` (capped at the prompt)."""
    layers, heads, dim, dtype = LAYOUT
    scale = [1.5 - i / (layers - 1) for i in range(layers)] if budget < 1 else [1.0] * layers
    lengths = [min(PROMPT, math.ceil(budget * s * PROMPT)) for s in scale]
    g = torch.Generator().manual_seed(seed)
    keys = [torch.randn(heads, k, dim, generator=g).to(dtype) for k in lengths]
    values = [torch.randn(heads, k, dim, generator=g).to(dtype) for k in lengths]
    return CompactKV(keys, values, prompt_length=PROMPT, first_token=1)


async def _drain(requests, context) -> worker_pb2.TransferAck:
    """``TransferKV`` that only counts the payload bytes of the raw messages (the gRPC raw diagnostic)."""
    n = 0
    async for raw in requests:
        n += len(raw)
    return worker_pb2.TransferAck(bytes_received=n)


def _grpc_raw_server(chunk_bytes: int, port_q: mp.Queue, stop: mp.Event) -> None:
    tune_malloc()

    async def main() -> None:
        server = grpc.aio.server(options=grpc_message_options(chunk_bytes))
        service, name = TRANSFER_KV_METHOD.strip("/").split("/")
        handler = grpc.stream_unary_rpc_method_handler(
            _drain, response_serializer=worker_pb2.TransferAck.SerializeToString
        )
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(service, {name: handler})])
        port_q.put(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        while not stop.is_set():
            await asyncio.sleep(0.05)
        await server.stop(1)

    asyncio.run(main())


def _recv_exact(conn: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = conn.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("peer closed")
        got += n


class _HostCopy:
    """A checked header's tensors as host buffers, each payload copied in (the least a receiver does)."""

    def __init__(self, header) -> None:
        validate_header(header, FINGERPRINT, LAYOUT)
        self.bufs = [[bytearray(n) for n in sizes] for sizes in all_tensor_bytes(header)]

    def write(self, layer: int, tensor: int, offset: int, payload) -> None:
        self.bufs[layer][tensor][offset : offset + len(payload)] = payload

    def release(self) -> None:
        self.bufs = []


def _tcp_server(port_q: mp.Queue) -> None:
    """Per connection: 8-byte length (0 = quit), 1-byte mode: 0 drains the bytes, 1 assembles messages."""
    tune_malloc()
    with socket.create_server(("127.0.0.1", 0)) as srv:
        port_q.put(srv.getsockname()[1])
        buf = memoryview(bytearray(8 << 20))
        while True:
            conn, _ = srv.accept()
            with conn:
                _recv_exact(conn, buf[:9])
                want, framed = int.from_bytes(buf[:8], "little"), buf[8]
                if want == 0:
                    return
                if not framed:
                    for off in range(0, want, len(buf)):
                        _recv_exact(conn, buf[: min(len(buf), want - off)])
                else:
                    asm = KVStreamReader(_HostCopy)
                    while True:  # 4-byte length prefix per message; 0 ends the stream
                        _recv_exact(conn, buf[:4])
                        n = int.from_bytes(buf[:4], "little")
                        if n == 0:
                            break
                        _recv_exact(conn, buf[:n])
                        asm.feed_wire(buf[:n])
                    asm.finish()
                conn.sendall(b"k")


async def _connect(port: int, chunk_bytes: int) -> tuple[grpc.aio.Channel, GrpcKVSender]:
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=grpc_message_options(chunk_bytes))
    return channel, GrpcKVSender(channel, chunk_bytes=chunk_bytes, timeout_s=120)


async def _grpc_raw_once(sender: GrpcKVSender, blobs: list[bytes]) -> float:
    start = time.perf_counter()
    ack = await sender.send_chunks(blobs)
    elapsed = time.perf_counter() - start
    assert ack.bytes_received == sum(len(b) for b in blobs), ack
    return elapsed


async def _grpc_once(sender: GrpcKVSender, ckv: CompactKV, rid: str = "bench") -> float:
    header = compact_header(ckv, request_id=rid, fingerprint=kv_receiver.FINGERPRINT)
    start = time.perf_counter()
    ack = await sender.send(header, zip(ckv.keys, ckv.values, strict=True))
    elapsed = time.perf_counter() - start
    assert ack.bytes_received == ckv.nbytes, ack
    return elapsed


async def _nixl_once(sender: NixlKVSender, ckv: CompactKV, rid: str) -> float:
    header = compact_header(ckv, request_id=rid, fingerprint=kv_receiver.FINGERPRINT)
    start = time.perf_counter()
    ack = await sender.send(header, ckv)
    elapsed = time.perf_counter() - start
    assert ack.bytes_received == ckv.nbytes, ack
    return elapsed


async def _nixl_raw_once(agent: NixlAgent, peer: str, src: torch.Tensor, dst: int, ckv: CompactKV) -> float:
    """NIXL raw: the cache's K and V bytes, already contiguous in a registered buffer (``src``), written
    with one WRITE of one descriptor per tensor into the raw receiver's buffer at ``dst``; no vlkv work."""
    sizes = [t.numel() * t.element_size() for pair in zip(ckv.keys, ckv.values, strict=True) for t in pair]
    local, remote, off = [], [], 0
    for n in sizes:
        local.append((src.data_ptr() + off, n, 0))
        remote.append((dst + off, n, 0))
        off += n
    start = time.perf_counter()
    handle = agent.post(peer, np.array(local, dtype=np.uint64), np.array(remote, dtype=np.uint64), "DRAM")
    await agent.wait([handle], time.monotonic() + 120)
    return time.perf_counter() - start


def _tcp_once(port: int, ckv: CompactKV, blobs: list[bytes], chunk_bytes: int, framed: bool) -> float:
    with socket.create_connection(("127.0.0.1", port)) as s:
        start = time.perf_counter()
        s.sendall(sum(len(b) for b in blobs).to_bytes(8, "little") + bytes([framed]))
        if framed:
            header = next(encode_compact_kv(ckv, request_id="bench", fingerprint=FINGERPRINT))
            for b in encode_stream(header, zip(ckv.keys, ckv.values, strict=True), chunk_bytes, wire=True):
                s.sendmsg([len(b).to_bytes(4, "little"), b])
            s.sendall(bytes(4))
        else:
            for b in blobs:
                s.sendall(b)
        assert s.recv(1) == b"k"
        return time.perf_counter() - start


def _cpu_seconds(pid: int) -> tuple[float, float]:
    """User+system CPU time of this process (the sender) and of ``pid`` (a receiver; Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return time.process_time(), (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _measure(fn, pid: int) -> tuple[float, float, float]:
    """(wall seconds, sender CPU seconds, receiver CPU seconds) of one transfer."""
    send, recv = _cpu_seconds(pid)
    wall = fn()
    send2, recv2 = _cpu_seconds(pid)
    return wall, send2 - send, recv2 - recv


def run(repeats: int, chunk_bytes: int) -> list[dict]:
    tune_malloc()
    ctx = mp.get_context("spawn")
    port_q, stop = ctx.Queue(), ctx.Event()
    # gRPC (and NIXL, in its own process): the decode worker's own receivers over a real KV pool
    servers = [
        ctx.Process(target=kv_receiver.serve, args=([LAYOUT], port_q, stop, 320, None, False), daemon=True)
    ]
    servers[0].start()
    ports = [port_q.get(timeout=120)[0][0]]
    servers += [
        ctx.Process(target=_tcp_server, args=(port_q,), daemon=True),
        ctx.Process(target=_grpc_raw_server, args=(chunk_bytes, port_q, stop), daemon=True),
    ]
    for p in servers[1:]:
        p.start()
        ports.append(port_q.get(timeout=60))
    servers.append(ctx.Process(target=kv_receiver.serve, args=([LAYOUT], port_q, stop, 320), daemon=True))
    servers[-1].start()
    ports.append(port_q.get(timeout=120)[0][0])
    full = make_cache(1.0)
    servers.append(ctx.Process(target=kv_receiver.serve_raw, args=(full.nbytes, port_q, stop), daemon=True))
    servers[-1].start()
    raw_name, raw_meta, raw_dst = port_q.get(timeout=120)
    rows = []
    loop = asyncio.new_event_loop()  # one long-lived channel, as a prefill worker keeps per decode worker
    channel, sender = loop.run_until_complete(_connect(ports[0], chunk_bytes))
    raw_channel, raw_sender = loop.run_until_complete(_connect(ports[2], chunk_bytes))
    nixl_channel, _ = loop.run_until_complete(_connect(ports[3], chunk_bytes))
    agent = NixlAgent("prefill")
    nixl_address = f"127.0.0.1:{ports[3]}"
    nixl_sender = NixlKVSender(nixl_channel, nixl_address, agent, StagingPool(agent), timeout_s=120)
    raw_peer = agent.peer("raw-receiver", raw_name, raw_meta)
    raw_src = torch.empty(full.nbytes, dtype=torch.uint8)  # each cache's K, V bytes, copied in untimed
    agent.register([raw_src])
    sent = iter(range(1 << 30))  # request ids: each hand-off is a new request
    try:
        loop.run_until_complete(_grpc_once(sender, make_cache(0.05)))  # connect and warm up
        loop.run_until_complete(_grpc_raw_once(raw_sender, [b"warm-up"]))
        loop.run_until_complete(_nixl_once(nixl_sender, make_cache(1.0), "warm-up"))  # staging registered
        for budget in (0.1, 1.0):
            ckv = make_cache(budget)
            pairs = zip(ckv.keys, ckv.values, strict=True)
            flat = torch.cat([t.reshape(-1).view(torch.uint8) for pair in pairs for t in pair])
            raw_src[: flat.numel()].copy_(flat)
            stream = encode_compact_kv(
                ckv, request_id="bench", fingerprint=FINGERPRINT, chunk_bytes=chunk_bytes
            )
            blobs = [c.SerializeToString() for c in stream]
            secs: dict[str, list[float]] = {k: [] for k in KINDS}
            cpu: dict[str, list[tuple[float, float]]] = {k: [] for k in KINDS}
            pids = {
                "grpc": servers[0].pid,
                "tcp": servers[1].pid,
                "tcp_fmt": servers[1].pid,
                "grpc_raw": servers[2].pid,
                "nixl": servers[3].pid,
                "nixl_raw": servers[4].pid,
            }
            runs = {
                "grpc": lambda c=ckv: loop.run_until_complete(_grpc_once(sender, c)),
                "tcp": lambda c=ckv, b=blobs: _tcp_once(ports[1], c, b, chunk_bytes, framed=False),
                "tcp_fmt": lambda c=ckv, b=blobs: _tcp_once(ports[1], c, b, chunk_bytes, framed=True),
                "grpc_raw": lambda b=blobs: loop.run_until_complete(_grpc_raw_once(raw_sender, b)),
                "nixl": lambda c=ckv: loop.run_until_complete(_nixl_once(nixl_sender, c, f"r{next(sent)}")),
                "nixl_raw": lambda c=ckv: loop.run_until_complete(
                    _nixl_raw_once(agent, raw_peer, raw_src, raw_dst, c)
                ),
            }
            for _ in range(repeats):
                for kind, fn in runs.items():
                    wall, send, recv = _measure(fn, pids[kind])
                    secs[kind].append(wall)
                    cpu[kind].append((send, recv))
            wire = sum(len(b) + GRPC_FRAMING for b in blobs)
            row = dict(budget=budget, ratio=ckv.compression_ratio, payload=ckv.nbytes, wire=wire)
            row.update(messages=len(blobs), seconds=secs)
            row.update({f"{k}_gbps": wire / statistics.median(v) / 1e9 for k, v in secs.items()})
            gb = wire / 1e9
            for k, v in cpu.items():  # totals over the repeats: /proc counts whole 10 ms clock ticks
                send, recv = sum(a for a, _ in v) / len(v), sum(b for _, b in v) / len(v)
                row[f"{k}_cpu_s_per_gb"] = (send + recv) / gb
                row[f"{k}_send_cpu_s_per_gb"] = send / gb
                row[f"{k}_recv_cpu_s_per_gb"] = recv / gb
            row["grpc_vs_tcp"] = statistics.median(
                g / t for g, t in zip(secs["tcp"], secs["grpc"], strict=True)
            )
            row["grpc_raw_vs_tcp"] = statistics.median(
                g / t for g, t in zip(secs["tcp"], secs["grpc_raw"], strict=True)
            )
            row["grpc_vs_tcp_fmt"] = statistics.median(
                f / g for g, f in zip(secs["grpc"], secs["tcp_fmt"], strict=True)
            )
            row["nixl_vs_tcp"] = statistics.median(
                g / t for g, t in zip(secs["tcp"], secs["nixl"], strict=True)
            )
            row["nixl_raw_vs_tcp"] = statistics.median(
                g / t for g, t in zip(secs["tcp"], secs["nixl_raw"], strict=True)
            )
            rows.append(row)
    finally:
        loop.run_until_complete(nixl_channel.close())
        loop.run_until_complete(channel.close())
        loop.run_until_complete(raw_channel.close())
        loop.close()
        stop.set()
        with socket.create_connection(("127.0.0.1", ports[1])) as s:
            s.sendall(bytes(9))
        for p in servers:
            p.join(10)
    for r in rows:
        r["wire_vs_full"] = r["wire"] / rows[-1]["wire"]
    return rows


def _load() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def report(rows: list[dict], out: Path, chunk_bytes: int, repeats: int, load: tuple[str, str]) -> None:
    print(
        f"layout L=32 H_kv=8 D=128 fp16, m={PROMPT}, chunk {chunk_bytes >> 10} KiB, median of {repeats}; "
        f"load avg (1/5/15 min) before {load[0]}, after {load[1]}, {os.cpu_count()} CPUs"
    )
    print(
        "budget  k/(L*m)  payload MB  +metadata B  wire/full  msgs | GB/s: gRPC   TCP  TCP+fmt  raw  NIXL  "
        "NIXLraw | gRPC/TCP  raw/TCP  gRPC/TCP+fmt  NIXL/TCP  NIXLraw/TCP | CPU s/GB: gRPC   TCP  TCP+fmt  raw  "
        "NIXL  NIXLraw"
    )
    for r in rows:
        print(
            f"{r['budget']:>6.0%}  {r['ratio']:>7.4f}  {r['payload'] / 1e6:>10.2f}  {r['wire'] - r['payload']:>11}  "
            f"{r['wire_vs_full']:>9.2%}  {r['messages']:>4} |      {r['grpc_gbps']:>4.2f}  {r['tcp_gbps']:>4.2f}  "
            f"{r['tcp_fmt_gbps']:>7.2f} {r['grpc_raw_gbps']:>4.2f} {r['nixl_gbps']:>5.2f} {r['nixl_raw_gbps']:>8.2f} | "
            f"{r['grpc_vs_tcp']:>8.0%}  {r['grpc_raw_vs_tcp']:>7.0%}  {r['grpc_vs_tcp_fmt']:>12.0%}  "
            f"{r['nixl_vs_tcp']:>8.0%}  {r['nixl_raw_vs_tcp']:>11.0%} |"
            f"           {r['grpc_cpu_s_per_gb']:>4.2f}  {r['tcp_cpu_s_per_gb']:>4.2f}  "
            f"{r['tcp_fmt_cpu_s_per_gb']:>7.2f} {r['grpc_raw_cpu_s_per_gb']:>4.2f} {r['nixl_cpu_s_per_gb']:>5.2f} "
            f"{r['nixl_raw_cpu_s_per_gb']:>8.2f}"
        )
    for r in rows:
        split = ", ".join(
            f"{name} {r[f'{k}_send_cpu_s_per_gb']:.2f}/{r[f'{k}_recv_cpu_s_per_gb']:.2f}"
            for k, name in (
                ("grpc", "gRPC"),
                ("tcp", "TCP"),
                ("tcp_fmt", "TCP+fmt"),
                ("grpc_raw", "gRPC raw"),
                ("nixl", "NIXL"),
                ("nixl_raw", "NIXL raw"),
            )
        )
        print(f"{r['budget']:>6.0%}  CPU s/GB send/recv: {split}")
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(chunk_bytes=chunk_bytes, repeats=repeats, load_before=load[0], load_after=load[1])
    (out / "results.json").write_text(json.dumps(dict(meta, rows=rows), indent=2))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    labels = [f"{r['budget']:.0%}" for r in rows]
    ax1.bar(labels, [r["wire"] / 1e6 for r in rows])
    ax1.set(title="bytes on the wire (MB, incl. metadata)", xlabel="budget")
    names = {
        "grpc": "gRPC (into the pool)",
        "tcp": "plain TCP",
        "tcp_fmt": "TCP + same format work",
        "grpc_raw": "gRPC raw (grpcio alone)",
        "nixl": "NIXL (one-sided writes into the pool)",
        "nixl_raw": "NIXL raw (NIXL alone)",
    }
    for i, (kind, name) in enumerate(names.items()):
        ax2.bar(
            [x + (i - 2.5) * 0.14 for x in range(len(rows))],
            [r[f"{kind}_gbps"] for r in rows],
            0.14,
            label=name,
        )
    ax2.set(title="loopback throughput (GB/s)", xticks=range(len(rows)), xticklabels=labels, xlabel="budget")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "bench_kv_wire.png", dpi=120)
    print(f"saved {out / 'bench_kv_wire.png'} and {out / 'results.json'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("out/bench_kv_wire"))
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--chunk-mib", type=float, default=DEFAULT_CHUNK_BYTES / (1 << 20))
    args = ap.parse_args()
    chunk_bytes = int(args.chunk_mib * (1 << 20))
    before = _load()
    rows = run(args.repeats, chunk_bytes)
    report(rows, args.out, chunk_bytes, args.repeats, (before, _load()))


if __name__ == "__main__":
    main()
