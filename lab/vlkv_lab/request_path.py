"""Which vlkv source files one request runs through, from the gateway's handler to the streamed tokens.

Starts a gateway, a prefill worker and a decode worker in this process (real gRPC over localhost, the
embedded default model), sends one warm-up request, then records every Python function entered (in any
thread) while a second ``Generate`` streams its tokens, and prints the hand-written vlkv files they belong
to (generated protobuf modules listed apart). ``python -m vlkv_lab.request_path [--policy P --budget B]``
"""

from __future__ import annotations

import argparse
import asyncio
import io
import os
import sys
import threading
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repo (lab/vlkv_lab/request_path.py)


class _Recorder:
    def __init__(self) -> None:
        self.on = False
        self.seen: dict[str, set[str]] = defaultdict(set)

    def __call__(self, frame, event, arg):
        if self.on and event == "call":
            path = frame.f_code.co_filename
            if path.startswith(str(ROOT)) and "/.venv/" not in path and "/tests/" not in path:
                self.seen[os.path.relpath(path, ROOT)].add(frame.f_code.co_name)


def _png() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (64, 64), (200, 30, 30)).save(buf, "PNG")
    return buf.getvalue()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", default="vlcache")
    ap.add_argument("--budget", type=float, default=0.5)
    args = ap.parse_args(argv)
    rec = _Recorder()
    sys.setprofile(rec)
    threading.setprofile(rec)  # the servers' event loop and executor threads start after this

    import grpc
    from vlkv.common.config import ServerConfig
    from vlkv.deploy.client import build_request
    from vlkv.deploy.servers import start_decode_worker, start_gateway, start_prefill_worker
    from vlkv.v1 import generate_pb2_grpc

    cfg = ServerConfig()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def run(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(300)

    prefill = run(start_prefill_worker(cfg))
    decode = run(start_decode_worker(cfg))
    gateway = run(start_gateway(cfg, [prefill.address], [decode.address]))
    req = build_request(
        images=[_png()],
        question="what colour is the square ?",
        max_new_tokens=8,
        policy=args.policy,
        budget=args.budget,
    )
    with grpc.insecure_channel(gateway.address) as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)
        list(stub.Generate(req))  # warm-up: lazy imports and first-call set-up stay out of the count
        rec.on = True
        list(stub.Generate(req))
        rec.on = False
    for r in (gateway, prefill, decode):
        run(r.stop())
    loop.call_soon_threadsafe(loop.stop)
    sys.setprofile(None)
    threading.setprofile(None)
    hand = sorted(f for f in rec.seen if "_pb2" not in f and not f.endswith("request_path.py"))
    generated = sorted(f for f in rec.seen if "_pb2" in f)
    for f in hand:
        print(f"{f:45s} {', '.join(sorted(rec.seen[f]))[:100]}")
    print(f"\nhand-written source files on the request path: {len(hand)}")
    print(f"generated protobuf modules entered: {len(generated)} ({', '.join(generated) or '-'})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
