"""``vlkv serve``: a local cluster (gateway, prefill and decode workers on Ray) until Ctrl-C."""

from __future__ import annotations

import asyncio
import signal

from vlkv.deploy.cli.cluster import check_profile, with_cluster
from vlkv.deploy.cli.flags import add_server_flags


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="start a local cluster: gateway + prefill + decode workers on Ray")
    add_server_flags(p)
    p.add_argument("--port", type=int, default=50051, help="public gRPC port of the gateway")
    p.add_argument(
        "--http-port", type=int, default=None, help="also serve the OpenAI-compatible HTTP API on this port"
    )
    p.add_argument(
        "--http-allow-image-host",
        action="append",
        default=[],
        metavar="HOST",
        help="HTTP API: fetch http(s) image URLs on this host (repeatable; default: data: URLs only)",
    )
    p.set_defaults(func=cmd_serve)


def cmd_serve(args) -> int:
    check_profile(args)

    async def body(cluster) -> int:
        if cluster.http is not None:
            print(f"OpenAI-compatible HTTP API on {cluster.http.url}", flush=True)
        print(f"vlkv gateway listening on {cluster.address} (Ctrl-C to stop)", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        return 0

    return asyncio.run(with_cluster(args, body))
