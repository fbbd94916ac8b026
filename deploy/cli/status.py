"""``vlkv status``: a running cluster's workers, their load, KV pool occupancy, caches, verifier outcomes and
scaling events, from the gateway's admin API."""

from __future__ import annotations

import sys

from vlkv.deploy.cli.flags import add_client_flags
from vlkv.deploy.cli.verify_flags import format_verifier


def add_parser(sub) -> None:
    p = sub.add_parser("status", help="workers, their load, KV pool occupancy and requests in flight")
    p.add_argument("--address", default="127.0.0.1:50051")
    add_client_flags(p)
    p.add_argument("--events", type=int, default=20, help="scaling events to show")
    p.set_defaults(func=cmd_status)


def cmd_status(args) -> int:
    import time

    import grpc
    from vlkv.deploy.client import open_channel
    from vlkv.v1 import admin_pb2, admin_pb2_grpc

    with open_channel(args.address, token=args.token, ca=args.tls_ca) as channel:
        try:
            st = admin_pb2_grpc.AdminStub(channel).GetStatus(admin_pb2.StatusRequest(), timeout=10)
        except grpc.RpcError as exc:
            print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    print(
        f"requests in flight: {st.requests_in_flight}   served since start: {st.requests_total}   "
        f"waiting for KV room: {st.admission_queue}"
    )
    print(
        f"{'kind':8} {'address':22} {'state':12} {'in-flight':>9} {'running':>8} {'waiting':>8} {'KV pool (blocks, bytes)':>16} "
        f"{'preempted':>10}"
    )
    caches, prefixes = [], []
    for w in st.workers:
        if w.kind == "prefill" and w.HasField("image_cache"):
            caches.append((w.address, w.image_cache))
        if w.kind == "prefill" and w.HasField("prefix_cache") and w.prefix_cache.capacity_bytes:
            prefixes.append((w.address, w.prefix_cache))
        pool = swapped = ""
        if w.kind == "decode" and w.total_blocks:
            used = w.total_blocks - w.free_blocks
            pool = f"{used}/{w.total_blocks} ({used / w.total_blocks:.0%})"
            if w.block_bytes:  # the pool's bytes in its kv dtype
                pool += f" {w.kv_dtype} {used * w.block_bytes / (1 << 20):.0f}/{w.total_blocks * w.block_bytes / (1 << 20):.0f}MiB"
            swapped = f"{w.swapped} now/{w.preemptions}"
        print(
            f"{w.kind:8} {w.address:22} {w.state:12} {w.in_flight:>9} {w.running:>8} {w.waiting:>8} {pool:>16} "
            f"{swapped:>10}"
        )
    for w in st.workers:
        if w.kind == "prefill":
            print(
                f"compression profile {w.address}: {w.compression_profile or 'none (the policies defaults)'}"
            )
    for w in st.workers:
        if w.kind == "decode" and w.retained:
            print(
                f"kept turns {w.address}: {w.retained} caches in {w.retained_blocks} idle blocks "
                "(given back whenever a request needs them)"
            )
    for w in st.workers:
        if w.kind == "prefill" and w.HasField("verifier") and w.verifier.verified:
            print(f"verification {w.address}: {format_verifier(w.verifier)}")
        if w.kind == "prefill" and w.kv_bytes_window_saved:
            print(
                f"sliding windows {w.address}: {w.kv_bytes_window_saved / (1 << 20):.1f} MiB of full cache not kept"
            )
    for address, c in caches:
        looked = c.hits + c.misses
        print(
            f"image cache {address}: {c.entries} images, {c.bytes_held / (1 << 20):.1f}/"
            f"{c.capacity_bytes / (1 << 20):.0f} MiB, hits {c.hits}/{looked}"
            f"{f' ({c.hits / looked:.0%})' if looked else ''}, evictions {c.evictions}"
        )
    for address, c in prefixes:
        print(
            f"prefix cache {address}: {c.blocks} blocks, {c.bytes_held / (1 << 20):.1f}/"
            f"{c.capacity_bytes / (1 << 20):.0f} MiB, hits {c.hits}/{c.lookups} prompts, "
            f"{c.hit_tokens}/{c.lookup_tokens} tokens, evictions {c.evictions}"
        )
    for e in st.events[-args.events :]:
        stamp = time.strftime("%H:%M:%S", time.localtime(e.unix_time))
        print(f"{stamp} {e.kind} {e.action}: {e.replicas} serving ({e.reason})")
    return 0
