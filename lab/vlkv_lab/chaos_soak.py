"""Chaos soak: ``vlkv bench soak --chaos`` (``python -m vlkv_lab.soak --chaos``).

A local cluster (Ray-placed workers, two prefill and two decode, the autoscaler holding each pool at two)
serves ``n`` synthetic streaming requests closed-loop at ``concurrency``: half through the gRPC front, half
through the OpenAI-compatible HTTP front (the official ``openai`` client). While they run, real signals hit
the worker processes: a prefill worker is SIGKILLed once (after 15% of the requests), a decode worker once
(35%), and a third worker (``--stop-kind``, the other decode worker by default) is SIGSTOPped for
``--stop-s`` seconds (55%), then SIGCONTed. The autoscaler replaces what dies.

It checks, and prints in tables: every request ended (none still open, none cancelled by the generator);
each ended OK with a finish reason or with a documented retryable status (UNAVAILABLE; 503 over HTTP),
and one that had streamed tokens ended with that status rather than silently; at least ``--min-ok`` of the
requests were OK; both pools are back to their size; every surviving worker is idle with its whole KV pool
free (no leaked sequence). Exits non-zero when any check fails.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections import Counter
from dataclasses import dataclass, field

from vlkv.common.config import ModelConfig, PoolConfig, ServerConfig, TransferConfig
from vlkv.common.grpc_server import make_channel
from vlkv.deploy.autoscaler import PoolSpec, Replica
from vlkv.deploy.local import LocalCluster
from vlkv.v1 import worker_pb2, worker_pb2_grpc

from vlkv_lab.loadgen import RequestRecord, percentile, run_load_async, synthetic_workload

RETRYABLE = {"UNAVAILABLE"}  # the documented retryable status (HTTP 503 arrives as code "unavailable")


@dataclass
class Fault:
    at_s: float
    action: str  # SIGKILL, SIGSTOP
    kind: str
    address: str
    pid: int
    outcome: str = ""


@dataclass
class Chaos:
    cluster: LocalCluster
    n: int
    stop_kind: str = "decode"
    stop_s: float = 20.0
    t0: float = field(default_factory=time.monotonic)
    faults: list[Fault] = field(default_factory=list)
    hit: set = field(default_factory=set)

    def done(self) -> int:
        gw = self.cluster.gateway.servicer
        return gw.requests_total - gw.in_flight

    async def _after(self, share: float) -> None:
        while self.done() < share * self.n:
            await asyncio.sleep(0.2)

    def _victim(self, kind: str) -> Replica:
        serving = [r for r in self.cluster.autoscaler.replicas if r.kind == kind and r.state == "serving"]
        fresh = [r for r in serving if r.address not in self.hit]
        return min(fresh or serving, key=lambda r: r.started_at)

    async def _signal(self, kind: str, sig: signal.Signals) -> Fault:
        victim = self._victim(kind)
        pid = await victim.actor.__ray_call__.remote(lambda actor: os.getpid())
        os.kill(pid, sig)
        self.hit.add(victim.address)
        fault = Fault(time.monotonic() - self.t0, sig.name, kind, victim.address, pid)
        self.faults.append(fault)
        print(
            f"chaos: {sig.name} {kind} worker {victim.address} (pid {pid}) at {fault.at_s:.1f} s", flush=True
        )
        return fault

    async def _replacement(self, fault: Fault, timeout_s: float = 300.0) -> None:
        """Wait until the autoscaler has put up a replacement for ``fault``'s worker (or say it did not)."""
        since = time.time() - (time.monotonic() - self.t0 - fault.at_s)
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            events = self.cluster.autoscaler.events
            removed = [e for e in events if e.address == fault.address and e.action == "removed"]
            up = [e for e in events if e.kind == fault.kind and e.action == "up" and e.unix_time >= since]
            if removed and up:
                fault.outcome += f"removed after {removed[0].unix_time - since:.1f} s, "
                fault.outcome += f"replacement serving after {up[0].unix_time - since:.1f} s"
                return
            await asyncio.sleep(0.5)
        fault.outcome += f"not replaced within {timeout_s:g} s"

    async def run(self) -> None:
        """The faults at their shares of the requests; each replacement is awaited beside the next fault."""
        watch = []
        await self._after(0.15)
        watch.append(asyncio.ensure_future(self._replacement(await self._signal("prefill", signal.SIGKILL))))
        await self._after(0.35)
        watch.append(asyncio.ensure_future(self._replacement(await self._signal("decode", signal.SIGKILL))))
        await self._after(0.55)
        end = time.monotonic() + 120  # the third fault hits a full pool (else it is an outage, not a fault)
        while self.cluster.replica_count(self.stop_kind) < 2 and time.monotonic() < end:
            await asyncio.sleep(0.5)
        stopped = await self._signal(self.stop_kind, signal.SIGSTOP)
        await asyncio.sleep(self.stop_s)
        try:
            os.kill(stopped.pid, signal.SIGCONT)
            stopped.outcome = f"SIGCONT after {self.stop_s:g} s; "
        except ProcessLookupError:
            stopped.outcome = f"gone before SIGCONT at {self.stop_s:g} s; "
        events = self.cluster.autoscaler.events
        if any(e.address == stopped.address and e.action == "removed" for e in events):
            watch.append(asyncio.ensure_future(self._replacement(stopped)))
        else:
            stopped.outcome += "resumed serving"
        await asyncio.gather(*watch)


async def _idle(replica: Replica, security, timeout_s: float) -> tuple[bool, str]:
    """Poll a surviving worker until it is idle with every KV block free; (idle, its last load)."""
    stub_cls = (
        worker_pb2_grpc.DecodeWorkerStub if replica.kind == "decode" else worker_pb2_grpc.PrefillWorkerStub
    )
    end = time.monotonic() + timeout_s
    async with make_channel(replica.address, security, 1 << 20) as ch:
        while True:
            load = await stub_cls(ch).GetLoad(worker_pb2.LoadRequest(), timeout=10)
            busy = load.running + load.waiting + load.swapped
            full = replica.kind == "prefill" or load.free_blocks == load.total_blocks
            text = f"running {load.running}, waiting {load.waiting}, swapped {load.swapped}"
            if replica.kind == "decode":
                text += f", free blocks {load.free_blocks}/{load.total_blocks}"
            if (busy == 0 and full) or time.monotonic() > end:
                return busy == 0 and full, text
            await asyncio.sleep(0.5)


def _front_row(name: str, records: list[RequestRecord]) -> tuple[list, list[str]]:
    """A table row for one front's records, and the violations among them."""
    statuses = Counter(r.status for r in records)
    ok = [r for r in records if r.ok]
    no_finish = [r for r in ok if not r.finish_reason]
    partial = [r for r in records if not r.ok and r.tokens > 0]
    other = {s: c for s, c in statuses.items() if s != "OK" and s not in RETRYABLE}
    e2e = [r.e2e for r in ok]
    row = [
        name, len(records), len(ok), f"{100 * len(ok) / max(len(records), 1):.1f}%",
        sum(statuses[s] for s in RETRYABLE), len(partial), len(no_finish),
        ", ".join(f"{s} {c}" for s, c in other.items()) or "none",
        f"{percentile(e2e, 50):.2f} / {percentile(e2e, 99):.2f}",
    ]  # fmt: skip
    bad = [f"{name}: OK without a finish reason: {len(no_finish)}"] if no_finish else []
    bad += [f"{name}: non-retryable or open: {other}"] if other else []
    return row, bad


def _table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])


async def chaos_soak(args) -> int:
    cfg = ServerConfig(
        model=ModelConfig(path=args.model),
        pool=PoolConfig(pool_bytes=args.pool_mb << 20, cache_wait_ms=int(args.cache_wait_s * 1000)),
        transfer=TransferConfig(deadline_s=args.deadline_s),
        keepalive_s=args.keepalive_s,
    )
    spec = dict(min_replicas=2, max_replicas=2, cpus=0.25)
    cluster = LocalCluster(cfg, prefill=PoolSpec(**spec), decode=PoolSpec(**spec), http_port=0)
    await cluster.start()
    print(f"cluster up: gRPC {cluster.address}, HTTP {cluster.http.url}", flush=True)
    chaos = Chaos(cluster, args.n, args.stop_kind, args.stop_s)
    try:
        requests = synthetic_workload(
            args.n, seed=args.seed, max_new_tokens=args.max_new_tokens, policy=args.policy, budget=args.budget
        )
        half = args.concurrency // 2
        load = dict(timeout_s=args.timeout_s, drain_s=args.timeout_s)
        chaos_task = asyncio.ensure_future(chaos.run())
        grpc_run, http_run = await asyncio.gather(
            run_load_async(cluster.address, requests[0::2], concurrency=half, label="grpc", **load),
            run_load_async(
                "", requests[1::2], concurrency=args.concurrency - half, http=cluster.http.url, label="http",
                **load,
            ),
        )  # fmt: skip
        wall = max(grpc_run.wall_s, http_run.wall_s)
        if not chaos_task.done():
            print("the load ended before the chaos did; waiting for it", flush=True)
        await chaos_task
        open_after = cluster.gateway.servicer.in_flight
        survivors = [r for r in cluster.autoscaler.replicas if r.state == "serving"]
        checked = [(r, *await _idle(r, cfg.security, args.cache_wait_s + 30)) for r in survivors]
        sizes = {k: cluster.replica_count(k) for k in ("prefill", "decode")}
    finally:
        await cluster.stop()

    rows, bad = [], []
    for name, records in (("gRPC", grpc_run.records), ("HTTP", http_run.records), (
        "both", grpc_run.records + http_run.records)):  # fmt: skip
        row, violations = _front_row(name, records)
        rows.append(row)
        bad += violations if name != "both" else []
    every = grpc_run.records + http_run.records
    ok_share = sum(r.ok for r in every) / max(len(every), 1)
    header = ["front", "requests", "OK", "OK %", "UNAVAILABLE / 503", "of them after tokens",
              "OK without finish", "other statuses", "e2e p50 / p99 s"]  # fmt: skip
    print(f"\n{args.n} requests at concurrency {args.concurrency}, {wall:.0f} s\n")
    print(_table(header, rows))
    print("\n" + _table(["at s", "signal", "kind", "worker", "outcome"],
                        [[f"{f.at_s:.1f}", f.action, f.kind, f.address, f.outcome] for f in chaos.faults]))  # fmt: skip
    print("\n" + _table(["surviving worker", "kind", "idle, pool full", "load"],
                        [[r.address, r.kind, ok, text] for r, ok, text in checked]))  # fmt: skip
    print(f"\npools: {sizes} (want 2 and 2); requests open after the run: {open_after}")
    if ok_share < args.min_ok:
        bad.append(f"OK share {100 * ok_share:.1f}% < {100 * args.min_ok:.0f}%")
    if len(every) != args.n or open_after:
        bad.append(f"{len(every)} of {args.n} requests recorded, {open_after} still open")
    if sizes != {"prefill": 2, "decode": 2}:
        bad.append(f"pools not back to size: {sizes}")
    bad += [f"worker {r.address} not idle: {text}" for r, ok, text in checked if not ok]
    print("checks: " + ("all passed" if not bad else "FAILED: " + "; ".join(bad)))
    return 1 if bad else 0


def add_args(p) -> None:
    p.add_argument(
        "--stop-kind", default="decode", choices=["decode", "prefill"], help="the SIGSTOPped worker"
    )
    p.add_argument("--stop-s", type=float, default=20.0, help="how long the third worker stays stopped")
    p.add_argument("--min-ok", type=float, default=0.97, help="least share of requests that must be OK")
    p.add_argument("--keepalive-s", type=float, default=15.0, help="ServerConfig.keepalive_s of the cluster")
    p.add_argument("--deadline-s", type=float, default=60.0, help="TransferConfig.deadline_s of the cluster")
    p.add_argument("--cache-wait-s", type=float, default=60.0, help="PoolConfig.cache_wait_ms / 1000")
    p.add_argument("--timeout-s", type=float, default=600.0, help="each request's deadline (client side)")
