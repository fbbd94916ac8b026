"""Bounded soak: ``python -m vlkv_lab.soak [-n 1000] [--concurrency 64] [--chaos]`` (``vlkv bench soak``).

Starts a local cluster (Ray-placed workers) on the default model, sends ``n`` synthetic requests closed-loop
at the given concurrency through the public API, prints latency percentiles and errors, and checks that
every decode worker's KV pool is back to its starting free-block count. Exits non-zero on any error or
leaked block. ``--chaos``: the same load through both fronts while workers are killed and stopped
(``lab/vlkv_lab/chaos_soak.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from vlkv.common.config import DEFAULT_MODEL_DIR, ModelConfig, PoolConfig, ServerConfig
from vlkv.common.grpc_server import make_channel
from vlkv.deploy.autoscaler import PoolSpec
from vlkv.deploy.local import LocalCluster
from vlkv.v1 import worker_pb2, worker_pb2_grpc

from vlkv_lab import chaos_soak
from vlkv_lab.loadgen import format_summary, run_load_async, synthetic_workload


async def _pools(addresses: list[str], security) -> dict[str, tuple[int, int]]:
    out = {}
    for a in addresses:
        async with make_channel(a, security, 1 << 20) as ch:
            load = await worker_pb2_grpc.DecodeWorkerStub(ch).GetLoad(worker_pb2.LoadRequest(), timeout=10)
        out[a] = (load.free_blocks, load.total_blocks)
    return out


async def soak(args) -> int:
    cfg = ServerConfig(model=ModelConfig(path=args.model), pool=PoolConfig(pool_bytes=args.pool_mb << 20))
    cluster = LocalCluster(cfg, prefill=PoolSpec(cpus=0.5), decode=PoolSpec(cpus=0.5))
    await cluster.start()
    try:
        decode = [r.address for r in cluster.autoscaler.replicas if r.kind == "decode"]
        before = await _pools(decode, cfg.security)
        requests = synthetic_workload(
            args.n, seed=args.seed, max_new_tokens=args.max_new_tokens, policy=args.policy, budget=args.budget
        )
        result = await run_load_async(
            cluster.address, requests, concurrency=args.concurrency, max_requests=args.n, label="soak"
        )
        await asyncio.sleep(1.0)
        after = await _pools(decode, cfg.security)
    finally:
        await cluster.stop()
    summary = result.summary()
    print(format_summary(summary))
    print(f"pools before {before}\npools after  {after}")
    leaked = {a: before[a][0] - after[a][0] for a in before if before[a][0] != after[a][0]}
    errors = summary["errors"]
    print(f"errors: {errors or 'none'}; leaked blocks: {leaked or 'none'}")
    return 1 if errors or leaked or summary["ok"] != args.n else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("-n", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--model", default=str(DEFAULT_MODEL_DIR))
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--policy", default="vlcache")
    p.add_argument("--budget", type=float, default=0.1)
    p.add_argument("--pool-mb", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chaos", action="store_true", help="kill and stop workers during the load")
    chaos_soak.add_args(p)
    args = p.parse_args(argv)
    return asyncio.run(chaos_soak.chaos_soak(args) if args.chaos else soak(args))


if __name__ == "__main__":
    sys.exit(main())
