"""``vlkv bench all``: vlkv against a full-cache vlkv and a plain Hugging Face server, in one report.

Three systems on the same model and the same KV memory budget, each started as its own server process
and driven through the public gRPC API by the load generator (``loadgen.py``):

- (a) vlkv (Ray-placed prefill and decode workers, gateway) with requests asking for ``vlcache`` at 10%;
- (b) the same vlkv deployment with requests asking for ``full`` (compression off, full caches handed off);
- (c) the Hugging Face ``generate()`` baseline (``hf_baseline.py``): batched, full cache, colocated.

(a) and (b) share one deployment (compression is a per-request parameter): they run one after the other.
The report (``report.md`` with PNG plots, ``results.json``) has: the largest concurrency each system
holds in the KV budget (for vlkv counted exactly at the decode worker's admission), decode throughput at
that concurrency, throughput against latency over a sweep of closed-loop concurrency (the paper's Figure
6), end-to-end latency for 100 output tokens by batch size and prompt length (the paper's Table 2), TTFT
with the KV hand-off included, and a fidelity table (``vlkv_lab.eval.evaluation`` on the held-out split,
and NVIDIA kvpress's presses where they run; see ``kvpress.py``).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import math
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from vlkv.common.config import DEFAULT_MODEL_DIR
from vlkv.common.grpc_server import make_channel, make_sync_channel
from vlkv.common.security import SecurityConfig, draw_internal_token
from vlkv.deploy.progress import Progress, progress
from vlkv.v1 import admin_pb2, admin_pb2_grpc, generate_pb2, worker_pb2, worker_pb2_grpc

from vlkv_lab.loadgen import LoadResult, format_summary, run_load, synthetic_workload

SYSTEMS = {
    "a": "(a) vlkv, vlcache 10%",
    "b": "(b) vlkv, full cache",
    "c": "(c) HF generate(), full cache",
}
PUBLIC_PROBE_TIMEOUT_S = 3.0  # a public Generate sent while the pool is full: queued, so it times out
COLORS = {"a": "tab:green", "b": "tab:blue", "c": "tab:red"}


@dataclass
class Plan:
    """What one run measures; ``--quick`` shrinks every count."""

    quick: bool
    kv_mb: float = 24.0
    long_tokens: int = 2048
    images_long: int = 3  # 3 x 576 vision tokens + text filler = the 2K-token prompts
    max_new_tokens: int = 100
    budget: float = 0.1
    table2_batches: tuple[int, ...] = (1, 4, 16)
    sweep_extra: tuple[int, ...] = (1, 4)  # plus each system's capacity (and vlkv (a) at (b)'s capacity)
    requests_per_level: float = 1.5  # closed-loop requests sent per stream at each sweep level
    eval_n: int = 32
    eval_budgets: tuple[float, ...] = (0.1,)
    eval_policies: tuple[str, ...] = ("vlcache", "snapkv", "pyramidkv", "h2o", "streamingllm")
    probe_short: bool = False
    kv_transport: str = "auto"  # the vlkv systems' KV hand-off (`vlkv serve --kv-transport`)

    @classmethod
    def make(cls, quick: bool) -> Plan:
        if quick:
            return cls(quick=True)
        return cls(
            quick=False,
            table2_batches=(1, 2, 4, 8, 16, 32),
            sweep_extra=(1, 2, 4, 8, 16),
            requests_per_level=3.0,
            eval_n=200,
            eval_budgets=(0.05, 0.1, 0.2),
            eval_policies=("vlcache", "snapkv", "pyramidkv", "h2o", "zipcache", "streamingllm", "random"),
            probe_short=True,
        )


# ---------------------------------------------------------------------------------------------------------
# Environment, models.


def machine_info() -> dict:
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = ""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem = f"{int(line.split()[1]) / (1 << 20):.1f} GiB"
    except OSError:
        pass
    versions = {"python": platform.python_version()}
    for mod in ("torch", "transformers", "grpc", "ray", "numpy"):
        try:
            versions[mod] = __import__(mod).__version__
        except Exception as exc:  # a missing optional package is reported, not fatal
            versions[mod] = f"unavailable ({exc.__class__.__name__})"
    return {
        "cpu": cpu or "unknown",
        "cores": os.cpu_count(),
        "memory": mem,
        "os": platform.platform(),
        "versions": versions,
        "load_avg_start": os.getloadavg(),
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def _random_default_arch(path: Path) -> None:
    """A random-weight model with the default model's architecture (used only if it is not there)."""
    import torch
    from transformers import LlavaForConditionalGeneration
    from vlkv.deploy.synthetic_task import IMAGE_SIZE, PATCH_SIZE, SYSTEM_PROMPT, VOCAB

    from vlkv_lab.task.tiny_llava import build_tiny
    from vlkv_lab.task.train_default_model import DEFAULTS as D

    _, proc, cfg = build_tiny(
        VOCAB,
        kind="llava",
        image_size=IMAGE_SIZE,
        patch_size=PATCH_SIZE,
        num_heads=D["heads"],
        num_kv_heads=D["kv_heads"],
        hidden=D["hidden"],
        layers=D["layers"],
        vision_hidden=D["vision_hidden"],
        vision_layers=D["vision_layers"],
        max_position_embeddings=2048,
        system_prompt=SYSTEM_PROMPT,
    )
    torch.manual_seed(0)
    LlavaForConditionalGeneration(cfg).eval().save_pretrained(path)
    proc.save_pretrained(path)


def speed_model(src: Path, dst: Path, context: int) -> Path:
    """A copy of ``src`` for the speed runs: context raised to ``context`` and no end-of-sequence token.

    Every request then decodes exactly ``max_new_tokens`` (the paper's fixed 100 output tokens) in all three
    systems, and 2K-token prompts fit. The weights are unchanged; answers past the trained length are
    meaningless, which does not matter for speed (fidelity is measured on the original model).
    """
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    cfg_path = dst / "config.json"
    cfg = json.loads(cfg_path.read_text())
    text = cfg.setdefault("text_config", {})
    text["max_position_embeddings"] = max(int(text.get("max_position_embeddings", 0)), context)
    cfg_path.write_text(json.dumps(cfg, indent=2))
    gen_path = dst / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.exists() else {}
    gen["eos_token_id"] = []
    gen_path.write_text(json.dumps(gen, indent=2))
    return dst


# ---------------------------------------------------------------------------------------------------------
# Servers as subprocesses.


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """Runs a server command, waits for its "listening on ADDRESS" line, stops it with SIGINT."""

    def __init__(self, name: str, cmd: list[str], log_path: Path, ready_s: float = 600.0) -> None:
        self.name = name
        self.cmd = cmd
        self.log_path = log_path
        self.ready_s = ready_s
        self.proc: subprocess.Popen | None = None
        self.address = ""
        self.start_s = 0.0

    def __enter__(self) -> ServerProcess:
        t0 = time.perf_counter()
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in __exit__
        self.proc = subprocess.Popen(
            self.cmd, stdout=subprocess.PIPE, stderr=self._log, text=True, start_new_session=True
        )
        found = threading.Event()

        def read() -> None:
            for line in self.proc.stdout:
                self._log.write(line)
                self._log.flush()
                if "listening on" in line and not found.is_set():
                    self.address = line.rsplit("listening on", 1)[1].split()[0]
                    found.set()

        threading.Thread(target=read, daemon=True).start()
        while not found.wait(0.5):
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; see {self.log_path}")
            if time.perf_counter() - t0 > self.ready_s:
                self.__exit__(None, None, None)
                raise TimeoutError(f"{self.name} not ready after {self.ready_s:.0f} s; see {self.log_path}")
        self.start_s = time.perf_counter() - t0
        print(f"[bench] {self.name} ready on {self.address} after {self.start_s:.0f} s", file=sys.stderr)
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
        self._log.close()


def vlkv_command(model: Path, port: int, kv_mb: float, kv_transport: str = "auto") -> list[str]:
    return [
        sys.executable,
        "-m",
        "vlkv.deploy.cli",
        "serve",
        "--internal-token",
        BENCH_SECURITY.internal_token,
        "--model",
        str(model),
        "--port",
        str(port),
        "--pool-mb",
        str(kv_mb),
        "--max-batch",
        "1024",
        "--threads",
        "1",
        "--kv-transport",
        kv_transport,
        # the capacity probe parks caches no Decode call claims yet, on purpose: no per-sender cap, and a
        # lease longer than the probe
        "--max-unclaimed",
        "1000000",
        "--unclaimed-lease-s",
        "600",
    ]


def hf_command(model: Path, port: int, kv_mb: float, stats: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "vlkv_lab.bench.hf_baseline",
        "--model",
        str(model),
        "--port",
        str(port),
        "--kv-budget-mb",
        str(kv_mb),
        "--threads",
        "1",
        "--collect-ms",
        "20",
        "--stats-file",
        str(stats),
    ]


# ---------------------------------------------------------------------------------------------------------
# Workloads.


@dataclass
class Workloads:
    """Request lists by (prompt kind, system); long prompts are calibrated to ``long_tokens``."""

    short: dict[str, list]
    long: dict[str, list]
    filler_words: int
    processor: object = None
    spec: object = None  # ModelSpec of the served checkpoint

    def get(self, kind: str, system: str) -> list:
        return (self.short if kind == "short" else self.long)[system]


def _prompt_tokens(processor, image_token_id: int, req) -> int:
    from vlkv.common.config import Limits
    from vlkv.common.model.inputs import decode_images, prepare_inputs
    from vlkv.common.request import render_prompt

    images = decode_images(list(req.images), Limits())
    return prepare_inputs(processor, images, render_prompt(req, processor), image_token_id).modality.m


def make_workloads(model: Path, plan: Plan, n: int = 64) -> Workloads:
    import torch
    from vlkv.common.model.loading import load_processor
    from vlkv.common.model.spec import ModelSpec

    processor = load_processor(str(model))
    spec = ModelSpec.from_checkpoint(str(model), torch.float32, processor.tokenizer)
    image_token_id = spec.image_token_id
    base = synthetic_workload(1, seed=7, images_per_prompt=plan.images_long)[0]
    filler = max(0, plan.long_tokens - _prompt_tokens(processor, image_token_id, base))
    for _ in range(3):  # the filler is word-level text: adjust until the prompt has long_tokens tokens
        probe = synthetic_workload(1, seed=7, images_per_prompt=plan.images_long, filler_words=filler)[0]
        gap = plan.long_tokens - _prompt_tokens(processor, image_token_id, probe)
        if gap == 0:
            break
        filler = max(0, filler + gap)
    policy = {"a": ("vlcache", plan.budget), "b": ("full", 1.0), "c": ("full", 1.0)}
    short, long = {}, {}
    for s, (pol, budget) in policy.items():
        kw = dict(max_new_tokens=plan.max_new_tokens, policy=pol, budget=budget)
        short[s] = synthetic_workload(n, seed=11, **kw)
        long[s] = synthetic_workload(
            n, seed=13, images_per_prompt=plan.images_long, filler_words=filler, **kw
        )
    return Workloads(short, long, filler, processor, spec)


# ---------------------------------------------------------------------------------------------------------
# Measurements.


def wave(address: str, reqs: list, batch: int, label: str, timeout_s: float = 600.0) -> dict:
    """``batch`` requests sent at once (closed loop, one request per stream): e2e time of the batch."""
    res = run_load(address, reqs, concurrency=batch, max_requests=batch, timeout_s=timeout_s, label=label)
    out = res.summary()
    out["batch_e2e_s"] = max((r.e2e for r in res.records), default=math.nan)
    out["decode_phase_tok_s"] = decode_phase_throughput(res)
    out["kv_bytes_kept_mean"] = _mean([r.kv_bytes_kept for r in res.ok])
    out["kv_bytes_full_mean"] = _mean([r.kv_bytes_full for r in res.ok])
    out["server_ttft_ms_p50"] = _p50([r.server_ttft_ms for r in res.ok])
    print(f"[bench] {label}: {format_summary(out)}", file=sys.stderr)
    return out


def _mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else math.nan


def _p50(xs) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else math.nan


def decode_phase_throughput(res: LoadResult) -> float:
    """Tokens after each request's first, over the span from the earliest first token to the last token."""
    ok = [r for r in res.ok if r.ttft is not None and r.tokens > 1]
    if not ok:
        return math.nan
    begin = min(r.start + r.ttft for r in ok)
    end = max(r.start + r.e2e for r in ok)
    return sum(r.tokens - 1 for r in ok) / max(end - begin, 1e-9)


def sweep(address: str, reqs: list, levels: list[int], per_level: float, label: str) -> list[dict]:
    out = []
    for c in levels:
        n = max(4, int(math.ceil(per_level * c)))
        res = run_load(address, reqs, concurrency=c, max_requests=n, timeout_s=600, label=f"{label} c={c}")
        s = res.summary()
        s["decode_phase_tok_s"] = decode_phase_throughput(res)
        print(f"[bench] {label} c={c}: {format_summary(s)}", file=sys.stderr)
        out.append(s)
    return out


def cluster_workers(address: str) -> tuple[list[str], list[str]]:
    with grpc.insecure_channel(address) as ch:
        st = admin_pb2_grpc.AdminStub(ch).GetStatus(admin_pb2.StatusRequest(), timeout=30)
    prefill = [w.address for w in st.workers if w.kind == "prefill"]
    decode = [w.address for w in st.workers if w.kind == "decode"]
    return prefill, decode


# The internal token the benchmark's `vlkv serve` runs with (it queries the worker ports directly).
BENCH_SECURITY = SecurityConfig(internal_token=draw_internal_token())


def decode_load(address: str) -> worker_pb2.WorkerLoad:
    with make_sync_channel(address, BENCH_SECURITY) as ch:
        return worker_pb2_grpc.DecodeWorkerStub(ch).GetLoad(worker_pb2.LoadRequest(), timeout=30)


def probe_capacity(gateway: str, reqs: list, wl: Workloads, label: str, limit: int = 2000) -> dict:
    """Hand compact caches to the decode worker until its admission refuses one; then decode them all.

    Each cache goes the way a real request's does (prefill worker -> policy -> ``TransferKV`` to the decode
    worker, which admits it by its default policy: the blocks of its own tokens, leaving 1% of the pool
    free), but no ``Decode`` stream
    claims it yet, so it stays resident (within its lease). The count of caches admitted before the first
    RESOURCE_EXHAUSTED is the number of such sequences the KV pool holds at once. A public ``Generate`` is
    then sent to check that the gateway refuses it too; finally one ``Decode`` stream per held cache is
    opened at once, so all of them decode together as one continuous batch (decode-phase throughput).
    """
    from vlkv.common.config import Limits
    from vlkv.common.request import prepare_request, to_prefill_proto
    from vlkv.decode_worker.block_manager import blocks_needed

    prefill, decode = cluster_workers(gateway)
    load0 = decode_load(decode[0])
    held, usage = [], []
    refusal = ""
    t0 = time.perf_counter()
    with (
        make_sync_channel(prefill[0], BENCH_SECURITY) as ch,
        Progress(None, f"[bench] capacity {label}", "caches admitted") as bar,
    ):
        stub = worker_pb2_grpc.PrefillWorkerStub(ch)
        for i in range(limit):
            req = reqs[i % len(reqs)]
            rid = f"probe-{label}-{i}-{time.monotonic_ns()}"
            prepared = prepare_request(req, wl.processor, wl.spec, Limits(), default_seed=i)
            prepared.request_id = rid
            preq = to_prefill_proto(prepared, decode[0])
            try:
                reply = stub.Prefill(preq, timeout=120)
            except grpc.RpcError as exc:
                refusal = f"{exc.code().name}: {exc.details()}"
                break
            held.append(rid)
            usage.append(reply)
            bar.update()
    fill_s = time.perf_counter() - t0
    load_full = decode_load(decode[0])
    public = ""
    try:
        from vlkv.deploy.client import connect, generate

        channel, gstub = connect(gateway)
        try:
            generate(gstub, reqs[0], timeout=PUBLIC_PROBE_TIMEOUT_S)  # it waits in the admission queue
            public = "OK (not refused)"
        finally:
            channel.close()
    except grpc.RpcError as exc:
        public = exc.code().name
    # all held caches decode together
    tokens_at: list[float] = []

    running: list[int] = []  # the decode worker's running batch, sampled while the held caches decode

    async def run_decode() -> None:
        async with make_channel(decode[0], BENCH_SECURITY, 64 << 20) as ch:
            dstub = worker_pb2_grpc.DecodeWorkerStub(ch)

            async def one(rid: str) -> None:
                async for resp in dstub.Decode(worker_pb2.DecodeRequest(request_id=rid, wait_ms=60000)):
                    if resp.HasField("token"):
                        tokens_at.extend([time.perf_counter()] * len(resp.token.token_ids))

            async def sample() -> None:
                while True:
                    load = await dstub.GetLoad(worker_pb2.LoadRequest(), timeout=10)
                    running.append(load.running)
                    await asyncio.sleep(0.05)

            sampler = asyncio.ensure_future(sample())
            await asyncio.gather(*(one(r) for r in held), return_exceptions=True)
            sampler.cancel()

    t1 = time.perf_counter()
    asyncio.run(run_decode())
    decode_s = time.perf_counter() - t1
    tokens_at.sort()
    # the first token of every sequence came from prefill; the decode phase is from the first streamed
    # token to the last
    decode_tok_s = (len(tokens_at) - 1) / (tokens_at[-1] - tokens_at[0]) if len(tokens_at) > 1 else math.nan
    time.sleep(0.5)
    load_after = decode_load(decode[0])
    per_seq_blocks = [
        blocks_needed(list(u.layer_budgets), reqs[0].sampling.max_new_tokens, load0.block_size) for u in usage
    ]
    out = {
        "admitted": len(held),
        "refusal": refusal,
        "public_generate_when_full": public,
        "fill_s": fill_s,
        "total_blocks": load0.total_blocks,
        "free_blocks_when_full": load_full.free_blocks,
        "free_blocks_after_decode": load_after.free_blocks,
        "block_size": load0.block_size,
        "blocks_per_sequence_mean": _mean(per_seq_blocks),
        "prompt_tokens_mean": _mean([u.prompt_tokens for u in usage]),
        "kv_bytes_kept_mean": _mean([u.kv_bytes_kept for u in usage]),
        "kv_bytes_full_mean": _mean([u.kv_bytes_full for u in usage]),
        "compression_ratio_mean": _mean([u.compression_ratio for u in usage]),
        "transfer_ms_mean": _mean([u.transfer_ms for u in usage]),
        "prefill_ms_mean": _mean([u.prefill_ms for u in usage]),
        "decode_tokens": len(tokens_at),
        "decode_s": decode_s,
        "decode_tok_s": decode_tok_s,
        "preemptions": load_after.preemptions - load0.preemptions,
        "decoding_mean": _mean([n for n in running if n]),  # sequences in the running batch, on average
    }
    print(
        f"[bench] {label}: {len(held)} sequences admitted ({refusal[:80]}), public Generate when full: "
        f"{public}, decode phase {decode_tok_s:.0f} tok/s",
        file=sys.stderr,
    )
    return out


def hf_capacity(model: Path, kv_mb: float, prompt_tokens: float, max_new: int) -> int:
    import torch
    from vlkv.common.model.spec import ModelSpec

    spec = ModelSpec.from_checkpoint(str(model), torch.float32)  # fp32 K and V
    per_token = spec.bytes_per_token_layer * spec.num_layers
    return int(kv_mb * (1 << 20) // ((prompt_tokens + max_new) * per_token))


# ---------------------------------------------------------------------------------------------------------
# The run.


@dataclass
class Results:
    plan: Plan
    machine: dict
    command: str
    notes: list[str] = field(default_factory=list)
    models: dict = field(default_factory=dict)
    workload: dict = field(default_factory=dict)
    capacity: dict = field(default_factory=dict)
    decode: dict = field(default_factory=dict)
    sweeps: dict = field(default_factory=dict)
    table2: dict = field(default_factory=dict)
    fidelity: dict = field(default_factory=dict)
    kvpress: dict = field(default_factory=dict)
    timings: dict = field(default_factory=dict)


def _run_vlkv(res: Results, wl: Workloads, speed: Path, out: Path, plan: Plan) -> None:
    t0 = time.perf_counter()
    port = free_port()
    with ServerProcess(
        "vlkv serve",
        vlkv_command(speed, port, plan.kv_mb, plan.kv_transport),
        out / "logs" / "vlkv_serve.log",
    ) as srv:
        res.timings["vlkv_start_s"] = srv.start_s
        # warm-up: first requests load lazily initialised paths
        wave(srv.address, wl.get("short", "a"), 2, "warm-up vlkv")
        wave(srv.address, wl.get("long", "b"), 1, "warm-up vlkv long")
        for s in ("a", "b"):
            kinds = ["long", "short"] if plan.probe_short else ["long"]
            for kind in kinds:
                cap = probe_capacity(srv.address, wl.get(kind, s), wl, f"capacity {s} {kind}")
                res.capacity[f"{s}/{kind}"] = cap
        cap_a = res.capacity["a/long"]["admitted"]
        cap_b = res.capacity["b/long"]["admitted"]
        for s, caps in (("a", [cap_b, cap_a]), ("b", [cap_b])):
            levels = sorted({c for c in (*plan.sweep_extra, *caps) if 0 < c <= max(caps)})
            res.sweeps[s] = sweep(
                srv.address, wl.get("long", s), levels, plan.requests_per_level, f"sweep {s}"
            )
        for s in ("a", "b"):
            for kind in ("short", "long"):
                for b in plan.table2_batches:
                    res.table2[f"{s}/{kind}/{b}"] = wave(
                        srv.address, wl.get(kind, s), b, f"table2 {s} {kind} bs={b}"
                    )
    res.timings["vlkv_s"] = time.perf_counter() - t0


def _run_hf(res: Results, wl: Workloads, speed: Path, out: Path, plan: Plan) -> None:
    t0 = time.perf_counter()
    port = free_port()
    stats_path = out / "logs" / "hf_stats.json"
    cmd = hf_command(speed, port, plan.kv_mb, stats_path)
    long_m = res.workload["long_prompt_tokens"]
    cap_c = hf_capacity(speed, plan.kv_mb, long_m, plan.max_new_tokens)
    with ServerProcess("hf baseline", cmd, out / "logs" / "hf_baseline.log") as srv:
        res.timings["hf_start_s"] = srv.start_s
        wave(srv.address, wl.get("short", "c"), 2, "warm-up hf")
        # decode phase at its capacity: one batch of cap_c sequences
        w = wave(srv.address, wl.get("long", "c"), max(cap_c, 1), "capacity c long")
        res.capacity["c/long"] = {
            "admitted": cap_c,
            "prompt_tokens_mean": w["prompt_tokens_mean"],
            "kv_bytes_full_mean": w["kv_bytes_full_mean"],
            "kv_bytes_kept_mean": w["kv_bytes_full_mean"],
            "decode_tok_s": w["decode_phase_tok_s"],
        }
        over = () if plan.quick else (2 * cap_c,)  # past its cap the baseline queues
        levels = sorted({c for c in (*plan.sweep_extra, cap_c, *over) if c > 0})
        res.sweeps["c"] = sweep(srv.address, wl.get("long", "c"), levels, plan.requests_per_level, "sweep c")
        for kind in ("short", "long"):
            for b in plan.table2_batches:
                res.table2[f"c/{kind}/{b}"] = wave(
                    srv.address, wl.get(kind, "c"), b, f"table2 c {kind} bs={b}"
                )
    try:
        stats = json.loads(stats_path.read_text())
        res.capacity["c/long"]["max_batch_seen"] = stats["max_batch_seen"]
        res.capacity["c/long"]["batches"] = stats["batches"]
    except (OSError, ValueError, KeyError):
        res.notes.append("the HF baseline wrote no batching statistics")
    res.timings["hf_s"] = time.perf_counter() - t0


def _fidelity(res: Results, model: Path, plan: Plan, kvpress_mode: str) -> None:
    import torch
    from vlkv.common.config import ModelConfig
    from vlkv.common.model.loading import load_model, load_processor
    from vlkv.deploy.synthetic_task import make_examples

    from vlkv_lab.eval.evaluation import evaluate, prepare

    t0 = time.perf_counter()
    torch.set_num_threads(2)
    mdl = load_model(ModelConfig(path=str(model)))
    proc = load_processor(str(model))
    examples = make_examples(plan.eval_n, seed=0, split="heldout")
    prepared = prepare(mdl, proc, examples, progress=False)
    rows = [
        {
            "system": "vlkv",
            "policy": "full",
            "budget": 1.0,
            **_eval_row(evaluate(mdl, proc, prepared, "full", 1.0)),
        }
    ]
    runs = [(b, p) for b in plan.eval_budgets for p in plan.eval_policies]
    for b, p in progress(runs, desc="bench fidelity", unit="run"):
        rows.append(
            {"system": "vlkv", "policy": p, "budget": b, **_eval_row(evaluate(mdl, proc, prepared, p, b))}
        )
    res.fidelity = {"n": len(prepared), "rows": rows, "prompt_tokens_mean": _mean([p.m for p in prepared])}
    res.timings["fidelity_s"] = time.perf_counter() - t0
    if kvpress_mode != "off":
        from vlkv_lab.bench.kvpress import run_kvpress

        t1 = time.perf_counter()
        res.kvpress = run_kvpress(model, mdl, proc, examples, prepared, plan.eval_budgets, kvpress_mode)
        res.timings["kvpress_s"] = time.perf_counter() - t1


def _eval_row(r) -> dict:
    return {"accuracy": r.accuracy, "ratio": r.ratio}


def run_bench(args) -> int:
    wall0 = time.perf_counter()
    plan = Plan.make(args.quick)
    if args.kv_mb:
        plan.kv_mb = args.kv_mb
    plan.kv_transport = getattr(args, "kv_transport", "auto")
    out = Path(args.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    command = "vlkv bench all" + (" --quick" if args.quick else "") + (f" --out {args.out}")
    if args.kv_mb:
        command += f" --kv-mb {args.kv_mb:g}"
    if args.model != str(DEFAULT_MODEL_DIR):
        command += f" --model {args.model}"
    if plan.kv_transport != "auto":
        command += f" --kv-transport {plan.kv_transport}"
    res = Results(plan=plan, machine=machine_info(), command=command)
    model = Path(args.model)
    if not (model / "config.json").is_file():
        model = out / "_random_default_arch"
        _random_default_arch(model)
        res.notes.append(
            f"{args.model} has no model: a RANDOM-weight model of the default architecture was used, so the "
            "accuracy figures are meaningless (speed figures are not affected)."
        )
    speed = speed_model(model, out / "_speed_model", context=plan.long_tokens + plan.max_new_tokens + 256)
    res.models = {"eval": str(model), "speed": str(speed)}
    wl = make_workloads(speed, plan)
    long_m = _prompt_tokens(wl.processor, _image_token(speed), wl.get("long", "a")[0])
    short_ms = [_prompt_tokens(wl.processor, _image_token(speed), r) for r in wl.get("short", "a")[:16]]
    res.workload = {
        "long_prompt_tokens": long_m,
        "long_images": plan.images_long,
        "tokens_per_image": json.loads((speed / "config.json").read_text()).get("image_seq_length"),
        "long_filler_words": wl.filler_words,
        "short_prompt_tokens_min": min(short_ms),
        "short_prompt_tokens_max": max(short_ms),
        "short_prompt_tokens_mean": _mean(short_ms),
    }
    print(f"[bench] workloads: {res.workload}", file=sys.stderr)
    stages = [
        ("vlkv (a, b)", lambda: _run_vlkv(res, wl, speed, out, plan)),
        ("HF baseline (c)", lambda: _run_hf(res, wl, speed, out, plan)),
        ("fidelity", lambda: _fidelity(res, model, plan, args.kvpress)),
    ]
    with Progress(len(stages), desc="bench all", unit="stage") as bar:
        for name, stage in stages:
            bar.set_postfix(name)
            stage()
            bar.update()
    res.timings["total_s"] = time.perf_counter() - wall0
    res.machine["load_avg_end"] = os.getloadavg()
    from vlkv_lab.bench.render import render

    render(res, out)
    print(f"[bench] wrote {out / 'report.md'} in {res.timings['total_s']:.0f} s", file=sys.stderr)
    return 0


def _image_token(model: Path) -> int:
    import torch
    from vlkv.common.model.spec import ModelSpec

    return ModelSpec.from_checkpoint(str(model), torch.float32).image_token_id


__all__ = ["run_bench", "Plan", "Results", "SYSTEMS", "COLORS", "generate_pb2"]
