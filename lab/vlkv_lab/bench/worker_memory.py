"""Do the workers give memory back after large inputs? (issue 33) Prints a table of resident memory.

    python -m vlkv_lab.bench.worker_memory [--model DIR] [--inputs 10] [--prefill-mb 60] [--transfer-mb 48]
        [--settle-s 5] [--runs 1]

Starts a prefill worker and a decode worker, each in its own process (real gRPC on loopback, the internal
token drawn here), warms each up with a good request, then sends each ``--inputs`` large inputs it refuses:
the prefill worker a Prefill whose ``pixel_values`` hold ``--prefill-mb`` MB of images under one vision span
(44 images of the default model for 60 MB), the decode worker a TransferKV stream whose first data chunk holds
``--transfer-mb`` MB. It prints each worker's RSS at the start (after the warm-up), the highest while the
inputs came (sampled after each, and the kernel's high-water mark ``VmHWM``), and the lowest over the ``--settle-s`` seconds after the last (``settled``), what it kept
(after - start) split into anonymous memory (what the worker allocated: heap, arenas) and file-backed pages
(libraries and files mapped), plus the codes the inputs ended with; with ``--runs N``, N runs on fresh
workers and the min / median / max of each kept figure. Runs on
older vlkv too (without an internal token where that version refuses one), for before/after figures.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import statistics
import time
from dataclasses import dataclass, field

import grpc
import torch
from vlkv.common.config import (
    DEFAULT_MODEL_DIR,
    ConfigError,
    ModelConfig,
    PoolConfig,
    SecurityConfig,
    ServerConfig,
)
from vlkv.common.handoff.wire import encode_header
from vlkv.common.model.loading import load_processor
from vlkv.common.model.spec import ModelSpec
from vlkv.common.request import prepare_request, tensor_to_proto, to_prefill_proto
from vlkv.deploy.client import build_request
from vlkv.v1 import generate_pb2, kv_pb2, worker_pb2, worker_pb2_grpc

CTX = mp.get_context("spawn")
MAX_MESSAGE = 64 << 20


def security(token: str) -> SecurityConfig:
    """The internal token, on a version of vlkv that takes one without TLS (none on older ones)."""
    try:
        return SecurityConfig(internal_token=token)
    except ConfigError:
        return SecurityConfig()


def _serve(kind: str, model: str, token: str, queue, stop) -> None:
    from vlkv.deploy import servers

    async def main() -> None:
        cfg = ServerConfig(
            model=ModelConfig(path=model),
            security=security(token),
            pool=PoolConfig(pool_bytes=32 << 20),
            grace_s=0.5,
        )
        start = servers.start_prefill_worker if kind == "prefill" else servers.start_decode_worker
        running = await start(cfg)
        queue.put(running.address)
        while not stop.is_set():
            await asyncio.sleep(0.1)
        await running.stop()

    asyncio.run(main())


@dataclass(frozen=True)
class Memory:
    """A process's resident memory (``/proc/<pid>/status``): all of it, its anonymous part (heap, arenas,
    stacks: what the process allocated) and its file-backed part (pages of the libraries and files it
    mapped, which the kernel can drop and read again), and the highest resident memory it ever had
    (``VmHWM``)."""

    rss: int = 0
    anon: int = 0
    file: int = 0
    hwm: int = 0


def memory(pid: int) -> Memory:
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
                fields[key] = int(value.split()[0]) * 1024
    return Memory(fields["VmRSS"], fields.get("RssAnon", 0), fields.get("RssFile", 0), fields.get("VmHWM", 0))


def rss_bytes(pid: int) -> int:
    return memory(pid).rss


@dataclass
class Figures:
    worker: str
    start: Memory = Memory()
    peak: int = 0
    after: Memory = Memory()
    codes: dict = field(default_factory=dict)

    @property
    def kept(self) -> int:
        """Resident memory kept (after - start)."""
        return self.after.rss - self.start.rss

    @property
    def kept_anon(self) -> int:
        """Anonymous resident memory kept: what the worker allocated and still holds."""
        return self.after.anon - self.start.anon

    @property
    def kept_file(self) -> int:
        """File-backed resident memory gained (library and file pages first touched)."""
        return self.after.file - self.start.file


class Workers:
    """A prefill and a decode worker in their own processes, and channels to them."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.token = "bench-" + str(time.monotonic_ns())
        self.stop = CTX.Event()
        self.procs, self.addresses = {}, {}
        for kind in ("decode", "prefill"):
            q = CTX.Queue()
            p = CTX.Process(target=_serve, args=(kind, model, self.token, q, self.stop), daemon=True)
            p.start()
            self.procs[kind] = p
            self.addresses[kind] = q.get(timeout=300)
        creds = security(self.token).channel_credentials()
        opts = [
            ("grpc.max_send_message_length", MAX_MESSAGE),
            ("grpc.max_receive_message_length", MAX_MESSAGE),
        ]
        self.channels = {
            k: grpc.insecure_channel(a, opts) if creds is None else grpc.secure_channel(a, creds, opts)
            for k, a in self.addresses.items()
        }
        self.prefill = worker_pb2_grpc.PrefillWorkerStub(self.channels["prefill"])
        self.decode = worker_pb2_grpc.DecodeWorkerStub(self.channels["decode"])
        self.transfer = self.channels["decode"].stream_unary(
            "/vlkv.v1.DecodeWorker/TransferKV",
            request_serializer=kv_pb2.KVChunk.SerializeToString,
            response_deserializer=worker_pb2.TransferAck.FromString,
        )

    def close(self) -> None:
        for ch in self.channels.values():
            ch.close()
        self.stop.set()
        for p in self.procs.values():
            p.join(30)
            if p.is_alive():
                p.kill()

    def rss(self, kind: str) -> int:
        return rss_bytes(self.procs[kind].pid)

    def memory(self, kind: str) -> Memory:
        return memory(self.procs[kind].pid)


def _good_prefill(processor, spec, decode: str, rid: str) -> worker_pb2.PrefillRequest:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (64, 48), (200, 30, 30)).save(buf, format="PNG")
    pb = build_request(images=[buf.getvalue()], question="what colour is the square ?", max_new_tokens=2)
    from vlkv.common.config import Limits

    req = prepare_request(pb, processor, spec, Limits(), default_seed=1)
    req.request_id = rid
    return to_prefill_proto(req, decode)


def settled(sample, settle_s: float, every_s: float = 0.25) -> Memory:
    """The sample with the lowest resident memory over ``settle_s`` seconds of quiet after the inputs: the
    worker's heap trimmer gives memory back once the burst has settled (a check a second,
    ``common/heap.py``), so one sample at a fixed moment races it; the lowest over the window is what the
    idle worker came back to."""
    low = sample()
    end = time.monotonic() + settle_s
    while time.monotonic() < end:
        time.sleep(every_s)
        low = min(low, sample(), key=lambda m: m.rss)
    return low


def large_prefill(good: worker_pb2.PrefillRequest, megabytes: float) -> worker_pb2.PrefillRequest:
    """``good`` with pixel values for as many images as fill ``megabytes`` MB, under its one vision span."""
    pb = worker_pb2.PrefillRequest()
    pb.CopyFrom(good)
    pixels = next(t for t in pb.model_inputs if t.name == "pixel_values")
    one = len(pixels.data) // pixels.shape[0]
    n = max(2, int(megabytes * 1e6) // one)
    x = torch.randn(n, *list(pixels.shape)[1:])
    pixels.CopyFrom(tensor_to_proto("pixel_values", x))
    return pb


def large_transfer(
    load: worker_pb2.WorkerLoad, spec: ModelSpec, rid: str, megabytes: float
) -> list[kv_pb2.KVChunk]:
    """A header for a small cache, then one data chunk of ``megabytes`` MB (far past its layer's size)."""
    header = encode_header(
        request_id=rid,
        fingerprint=load.model_fingerprint,
        dtype=spec.dtype,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        layer_lengths=[4] * spec.num_layers,
        prompt_length=4,
        first_token_id=1,
        sampling=generate_pb2.SamplingParams(max_new_tokens=1, temperature=0.0, top_p=1.0, seed=1),
        eos_token_ids=list(spec.eos_token_ids),
        prompt_tokens=4,
    )
    data = kv_pb2.KVChunk(data=kv_pb2.KVData(layer=0, tensor=0, offset=0, data=b"\1" * int(megabytes * 1e6)))
    return [header, data]


def _code(call) -> str:
    try:
        call()
        return "OK"
    except grpc.RpcError as exc:
        return exc.code().name


def measure(
    model: str, inputs: int = 10, prefill_mb: float = 60, transfer_mb: float = 48, settle_s: float = 5.0
):
    """RSS figures of both workers around ``inputs`` large inputs each: ``[Figures(prefill), Figures(decode)]``."""
    processor = load_processor(model)
    spec = ModelSpec.from_checkpoint(model, torch.float32, processor.tokenizer)
    w = Workers(model)
    try:
        decode = w.addresses["decode"]
        for i in range(2):  # warm-up: a whole good request through both workers
            w.prefill.Prefill(_good_prefill(processor, spec, decode, f"warm-{i}"), timeout=300)
            for _ in w.decode.Decode(
                worker_pb2.DecodeRequest(request_id=f"warm-{i}", wait_ms=60_000), timeout=300
            ):
                pass
        time.sleep(settle_s)
        load = w.decode.GetLoad(worker_pb2.LoadRequest(), timeout=30)
        big = large_prefill(_good_prefill(processor, spec, decode, "big"), prefill_mb)
        sends = {
            "prefill": lambda i: w.prefill.Prefill(big, timeout=300),
            "decode": lambda i: w.transfer(
                iter(large_transfer(load, spec, f"big-{i}", transfer_mb)), timeout=300
            ),
        }
        out = []
        for kind, send in sends.items():
            f = Figures(kind, start=w.memory(kind))
            f.peak = f.start.rss
            for i in range(inputs):
                code = _code(lambda: send(i))  # noqa: B023 - called at once
                f.codes[code] = f.codes.get(code, 0) + 1
                f.peak = max(f.peak, w.rss(kind))
            # the kernel's high-water mark: a worker that gives memory back at once (a free over the trim
            # threshold) is past its peak when the call returns
            f.peak = max(f.peak, w.memory(kind).hwm)
            f.after = settled(lambda: w.memory(kind), settle_s)  # noqa: B023 - called at once
            out.append(f)
        return out
    finally:
        w.close()


def table(figures: list[Figures], inputs: int) -> str:
    mb = 1 << 20
    lines = [
        f"| worker | RSS start (MiB) | peak (MiB) | after {inputs} inputs (MiB) | kept (MiB) | anonymous kept (MiB)"
        " | file-backed kept (MiB) | codes |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for f in figures:
        codes = ", ".join(f"{k} x{v}" for k, v in sorted(f.codes.items()))
        lines.append(
            f"| {f.worker} | {f.start.rss / mb:.0f} | {f.peak / mb:.0f} | {f.after.rss / mb:.0f} | {f.kept / mb:+.0f}"
            f" | {f.kept_anon / mb:+.0f} | {f.kept_file / mb:+.0f} | {codes} |"
        )
    return "\n".join(lines)


def summary(runs: list[list[Figures]]) -> str:
    """min / median / max of each worker's kept figures over ``runs`` (each one ``measure``'s answer)."""
    mb = 1 << 20
    lines = [
        f"| worker (n={len(runs)} runs) | kept, min / median / max (MiB) | anonymous kept | file-backed kept |",
        "|---|---:|---:|---:|",
    ]
    for i, worker in enumerate(f.worker for f in runs[0]):

        def spread(attr: str) -> str:
            xs = sorted(getattr(run[i], attr) / mb for run in runs)  # noqa: B023 - called at once
            return f"{xs[0]:+.0f} / {statistics.median(xs):+.0f} / {xs[-1]:+.0f}"

        lines.append(f"| {worker} | {spread('kept')} | {spread('kept_anon')} | {spread('kept_file')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(DEFAULT_MODEL_DIR))
    p.add_argument("--inputs", type=int, default=10)
    p.add_argument("--prefill-mb", type=float, default=60)
    p.add_argument("--transfer-mb", type=float, default=48)
    p.add_argument("--settle-s", type=float, default=5.0)
    p.add_argument("--runs", type=int, default=1, help="fresh workers each run; a summary table after")
    args = p.parse_args(argv)
    runs = []
    for r in range(args.runs):
        runs.append(measure(args.model, args.inputs, args.prefill_mb, args.transfer_mb, args.settle_s))
        print(f"run {r + 1}/{args.runs}\n{table(runs[-1], args.inputs)}", flush=True)
    if args.runs > 1:
        print(summary(runs))


if __name__ == "__main__":
    main()
