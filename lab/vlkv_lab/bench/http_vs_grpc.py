"""TTFT and throughput through the OpenAI-compatible HTTP front vs the gRPC API, on the same load.

Starts one prefill worker, one decode worker, the gateway and its HTTP front in this process (the servers
of ``deploy/servers.py`` on a background event loop), then runs the load generator (``lab/vlkv_lab/loadgen.py``,
in a child process so the client does not share this process's CPU) with the same synthetic requests
through each front in turn, after a warm-up, and prints one table.

    python -m vlkv_lab.bench.http_vs_grpc --concurrency 4 -n 48 --max-new-tokens 32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from vlkv.common.config import DEFAULT_MODEL_DIR, ModelConfig, PoolConfig, ServerConfig
from vlkv.common.model.loading import load_model, load_processor
from vlkv.deploy.servers import start_decode_worker, start_gateway, start_http_front, start_prefill_worker


class _Servers:
    """The three servers and the HTTP front on a background event loop."""

    def __init__(self, cfg: ServerConfig) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        model, processor = load_model(cfg.model), load_processor(cfg.model.path)
        self.prefill = self._run(start_prefill_worker(cfg, model=model, processor=processor))
        self.decode = self._run(start_decode_worker(cfg, model=model, tokenizer=processor.tokenizer))
        self.gateway = self._run(
            start_gateway(cfg, [self.prefill.address], [self.decode.address], processor=processor)
        )
        self.http = self._run(start_http_front(self.gateway, 0, cfg))

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(300)

    def close(self) -> None:
        for server in (self.http, self.gateway, self.prefill, self.decode):
            self._run(server.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)


def _load(servers: _Servers, front: str, args, n: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "load.json"
        cmd = [sys.executable, "-m", "vlkv_lab.loadgen", "--address", servers.gateway.address, "--quiet"]
        cmd += ["--concurrency", str(args.concurrency), "-n", str(n), "--json", str(out)]
        cmd += [
            "--max-new-tokens",
            str(args.max_new_tokens),
            "--policy",
            args.policy,
            "--seed",
            str(args.seed),
        ]
        if front == "http":
            cmd += ["--http", servers.http.url]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())["summary"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m vlkv_lab.bench.http_vs_grpc", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--model", default=str(DEFAULT_MODEL_DIR))
    p.add_argument("--concurrency", type=int, default=4, help="closed-loop streams in flight")
    p.add_argument("-n", type=int, default=48, help="requests per front")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--policy", default="vlcache")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=1, help="alternate the fronts this many times")
    args = p.parse_args(argv)
    servers = _Servers(ServerConfig(model=ModelConfig(path=args.model), pool=PoolConfig(pool_bytes=64 << 20)))
    rows: dict[str, list[dict]] = {"grpc": [], "http": []}
    try:
        for front in rows:  # warm-up: model, processor, connections
            _load(servers, front, args, args.concurrency)
        for _ in range(args.rounds):
            for front in rows:
                rows[front].append(_load(servers, front, args, args.n))
    finally:
        servers.close()
    print(
        "| front | requests ok | TTFT p50 (ms) | TTFT p99 (ms) | tokens/s | decode tokens/s | e2e p50 (s) |\n"
        "| --- | --- | --- | --- | --- | --- | --- |"
    )
    for front, runs in rows.items():
        for s in runs:
            print(
                f"| {front} | {s['ok']}/{s['requests']} | {s['ttft_p50_s'] * 1000:.1f} | {s['ttft_p99_s'] * 1000:.1f} | "
                f"{s['throughput_tok_s']:.1f} | {s['decode_tok_s']:.1f} | {s['e2e_p50_s']:.3f} |"
            )
    print(
        f"\n{args.n} synthetic requests (1 image + question each, {args.max_new_tokens} new tokens, policy "
        f"{args.policy}) per front, closed loop at concurrency {args.concurrency}, one prefill + one decode "
        f"worker in one process; model {Path(args.model).name}."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
