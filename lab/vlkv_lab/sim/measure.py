"""``vlkv profile``: this machine's service times, measured on real servers, for ``vlkv simulate``.

Starts a prefill worker, a decode worker and a gateway in this process (real gRPC on localhost, the
deployment's default configuration) and drives them with the load generator's synthetic requests:

- the gateway's validation (image decoding, the processor): the same requests prepared here, timed,
  fitted as base + per vision token;
- prefill: time to first token of single requests with 1 and 2 images and with and without 60 words of
  text before them, less their hand-off and their validation, fitted as base + per text token + per vision
  token; each repeated once the image cache holds its images (the hit's share of the vision tokens' time);
- hand-off: the gateway's hand-off histogram per kind of request against the cache bytes kept (a running
  deployment's through its ``--metrics-port``);
- decode step time by batch: the median inter-token time of ``B`` concurrent streams, spread over the
  deployment's decode workers; by cached tokens: the same with prompts of 2 images and 60 words;
- the pool (blocks, block size, bytes per token per layer), the share of tokens compression keeps, a
  ``GetLoad`` round trip, and how long a decode worker takes to start (model load included);
- one box: the cores the deployment shares (``shared_cores``: this machine's, when the servers run here),
  the other sessions with work to run while the prefills were measured (``background_threads``, mean;
  ``box_load.py``), to which every measured time is brought, and the CPU a request costs off its
  critical path (``overhead_s``: the CPU time of the deployment's processes and the client per request,
  less their CPU with no request and less what the measured times account for), so the simulator can slow
  concurrent work down as this machine does (``cpu.py``).
"""

from __future__ import annotations

import asyncio
import os
import platform
import statistics
import threading
import time
import urllib.request

import grpc
import numpy as np
from prometheus_client.parser import text_string_to_metric_families
from vlkv.common.config import DEFAULT_MODEL_DIR, ModelConfig, ServerConfig
from vlkv.common.grpc_server import make_sync_channel
from vlkv.common.model.loading import load_model, load_processor
from vlkv.common.request import prepare_request
from vlkv.deploy.servers import start_decode_worker, start_gateway, start_prefill_worker
from vlkv.v1 import worker_pb2, worker_pb2_grpc

from vlkv_lab.loadgen import percentile, run_load, synthetic_workload
from vlkv_lab.sim.box_load import BoxLoad, tree_cpu_s
from vlkv_lab.sim.profile import Profile


class _Servers:
    def __init__(self, cfg: ServerConfig) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.model = load_model(cfg.model)
        self.processor = load_processor(cfg.model.path)
        t = time.perf_counter()
        self.decode = self.run(
            start_decode_worker(cfg, model=load_model(cfg.model), tokenizer=self.processor.tokenizer)
        )
        self.start_s = time.perf_counter() - t
        self.prefill = self.run(start_prefill_worker(cfg, model=self.model, processor=self.processor))
        self.prefill.servicer.allow_decode(self.decode.address)
        self.gateway = self.run(
            start_gateway(cfg, [self.prefill.address], [self.decode.address], processor=self.processor)
        )

    decode_workers = 1
    shared_cores = float(os.cpu_count() or 1)  # the servers run here

    def run(self, coro, timeout: float = 300):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    @property
    def address(self) -> str:
        return self.gateway.address

    @property
    def spec(self):
        return self.gateway.servicer.spec

    def decode_load(self) -> tuple[worker_pb2.WorkerLoad, str]:
        return self.run(self.decode.servicer.GetLoad(worker_pb2.LoadRequest(), None)), self.decode.address

    def hand_off(self) -> tuple[float, int]:
        """The gateway's hand-off histogram: (sum of seconds, count)."""
        total = count = 0.0
        for metric in self.gateway.servicer.metrics.hand_off.collect():
            for s in metric.samples:
                if s.name.endswith("_sum"):
                    total += s.value
                elif s.name.endswith("_count"):
                    count += s.value
        return total, int(count)

    def close(self) -> None:
        for r in (self.gateway, self.prefill, self.decode):
            self.run(r.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class _Remote:
    """A running deployment (``vlkv serve``) measured through its gateway: the hand-off is not separated
    from the prefill, and the start-up time is not measured (the profile's default stays)."""

    start_s = Profile.worker_start_s

    def __init__(self, address: str, cfg: ServerConfig, metrics_port: int = 0) -> None:
        from vlkv.common.model.spec import ModelSpec
        from vlkv.v1 import admin_pb2, admin_pb2_grpc

        self.address = address
        self.processor = load_processor(cfg.model.path)
        self.spec = ModelSpec.from_checkpoint(cfg.model.path, cfg.model.torch_dtype, self.processor.tokenizer)
        with grpc.insecure_channel(address) as ch:
            status = admin_pb2_grpc.AdminStub(ch).GetStatus(admin_pb2.StatusRequest(), timeout=30)
        decode = [w for w in status.workers if w.kind == "decode"]
        self._decode, self.decode_workers = decode[0], len(decode)
        self.block_size = cfg.pool.block_size
        host = address.rsplit(":", 1)[0]
        self.shared_cores = float(os.cpu_count() or 1) if host in ("127.0.0.1", "localhost", "[::1]") else 0.0
        self.metrics_url = f"http://{host}:{metrics_port}/metrics" if metrics_port else ""

    def hand_off(self) -> tuple[float, int]:
        """The gateway's hand-off histogram from its /metrics (0, 0 without a metrics port)."""
        if not self.metrics_url:
            return 0.0, 0
        with urllib.request.urlopen(self.metrics_url, timeout=10) as r:
            text = r.read().decode()
        total = count = 0.0
        for family in text_string_to_metric_families(text):
            if family.name == "vlkv_hand_off_seconds":
                for sample in family.samples:
                    total += sample.value if sample.name.endswith("_sum") else 0.0
                    count += sample.value if sample.name.endswith("_count") else 0.0
        return total, int(count)

    def decode_load(self) -> tuple[worker_pb2.WorkerLoad, str]:
        w = self._decode
        load = worker_pb2.WorkerLoad(
            total_blocks=w.total_blocks, block_bytes=w.block_bytes, block_size=self.block_size
        )
        return load, w.address

    def close(self) -> None:
        pass


def measure(
    model: str | None = None, quick: bool = False, address: str = "", metrics_port: int = 0,
    shared_cores: float | None = None, deployment_pid: int = 0,
) -> Profile:  # fmt: skip
    """Measure servers started here, or (``address``) a running deployment's gateway (its hand-offs
    through its ``metrics_port``); ``shared_cores``: override the cores the deployment shares;
    ``deployment_pid``: the deployment's process tree, so its threads do not count as other work."""
    cfg = ServerConfig(model=ModelConfig(path=model or str(DEFAULT_MODEL_DIR)))
    s = _Remote(address, cfg, metrics_port) if address else _Servers(cfg)
    if shared_cores is not None:
        s.shared_cores = shared_cores
    try:
        with BoxLoad(every_s=0.5) as box:
            return _measure(s, cfg, quick, box, {os.getpid(), deployment_pid} - {0})
    finally:
        s.close()


def _fit_nonneg(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with no negative coefficient: a column whose coefficient comes out negative is left
    out and the rest fitted again (a noisy measurement must not make a cost negative)."""
    keep = list(range(a.shape[1]))
    while True:
        coef = np.linalg.lstsq(a[:, keep], y, rcond=None)[0]
        if (coef >= 0).all() or len(keep) == 1:
            out = np.zeros(a.shape[1])
            out[keep] = np.maximum(coef, 0.0)
            return out
        keep.pop(int(np.argmin(coef)))


def _rpc_s(address: str, cfg: ServerConfig) -> float:
    """A ``GetLoad`` round trip to a decode worker, median; the profile's default where the worker wants an
    internal token this process does not hold (a deployment started elsewhere)."""
    with make_sync_channel(address, cfg.security) as ch:
        stub = worker_pb2_grpc.DecodeWorkerStub(ch)
        rtts = []
        try:
            for _ in range(21):
                t = time.perf_counter()
                stub.GetLoad(worker_pb2.LoadRequest(), timeout=10)
                rtts.append(time.perf_counter() - t)
        except grpc.RpcError:
            return Profile.rpc_s
    return statistics.median(rtts[1:])


def _prep_s(s, cfg: ServerConfig, reqs) -> float:
    """The gateway's validation of ``reqs`` here, median seconds."""
    times = []
    for req in reqs:
        t = time.perf_counter()
        prepare_request(req, s.processor, s.spec, cfg.limits, default_seed=0)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _measure(s, cfg: ServerConfig, quick: bool, box: BoxLoad, ours: set[int]) -> Profile:
    address = s.address
    n = 4 if quick else 8
    run_load(address, synthetic_workload(2, seed=99, max_new_tokens=1), concurrency=1, progress=False)  # warm
    rows, hits, hand, preps = [], [], [], []  # (text, vision, s), (text, vision, s), (bytes, s), (vision, s)
    cpu_s, served, ttfts = 0.0, 0, []  # CPU of the deployment and client; (mean ttft, others) per group
    idle0, t0 = tree_cpu_s(ours), time.perf_counter()
    time.sleep(3.0)
    idle = (tree_cpu_s(ours) - idle0) / (time.perf_counter() - t0)  # CPU/s with no request (Ray, reports)
    for images, filler in ((1, 0), (1, 60), (2, 0)):
        for seed, out in ((1, rows), (1, hits)):  # the same requests twice: misses, then image-cache hits
            reqs = synthetic_workload(
                n,
                seed=seed + images * 10 + filler,
                images_per_prompt=images,
                filler_words=filler,
                max_new_tokens=1,
            )
            before, since = s.hand_off(), time.time()
            cpu0 = tree_cpu_s(ours)
            res = run_load(address, reqs, concurrency=1, progress=False, label="profile")
            cpu_s += tree_cpu_s(ours) - cpu0 - idle * res.wall_s
            served += len(res.ok)
            after, others = s.hand_off(), box.mean(since)
            ok = res.ok
            ttft = statistics.median(r.ttft for r in ok)
            vision = statistics.median(r.vision_tokens for r in ok)
            text = statistics.median(r.prompt_tokens for r in ok) - vision
            hand_s = (after[0] - before[0]) / max(1, after[1] - before[1])
            prep = _prep_s(s, cfg, reqs)
            ttfts.append((statistics.mean(r.ttft for r in ok), others))
            # the prefill's part (time to first token less the hand-off and the validation), at the box's
            # load while it was measured; brought to one reference load below
            if out is rows:
                rows.append((text, vision, ttft - hand_s - prep, others))
                hand.append((statistics.mean(r.kv_bytes_kept for r in ok), hand_s, others))
                preps.append((vision, prep, others))
                keep = statistics.mean(r.compression_ratio for r in ok)
            else:
                hits.append((text, vision, ttft - hand_s - prep, others))
    background = statistics.mean(o for *_, o in rows + hits)
    cores = s.shared_cores

    def share(others: float) -> float:  # of a core, one job of ours beside ``others`` busy sessions (cpu.py)
        return cores / (cores + others) if cores >= 1 else 1.0

    def at_reference(y: float, others: float) -> float:  # measured beside ``others``, as if beside background
        return y * share(others) / share(background)

    rows = [(t, v, at_reference(y, o)) for t, v, y, o in rows]
    hits = [(t, v, at_reference(y, o)) for t, v, y, o in hits]
    a = np.array([[1.0, t, v] for t, v, _ in rows])
    base, per_text, per_vision = _fit_nonneg(a, np.array([y for *_, y in rows]))
    hit_share = statistics.median(
        max(0.0, (y - base - per_text * t) / (per_vision * v)) for t, v, y in hits if per_vision > 0 and v
    ) if per_vision > 0 else 1.0  # fmt: skip
    hand = [(b, at_reference(y, o)) for b, y, o in hand]
    hx = np.array([[1.0, b / 1e6] for b, _ in hand])
    h0, h1 = np.linalg.lstsq(hx, np.array([y for _, y in hand]), rcond=None)[0]
    preps = [(v, at_reference(y, o)) for v, y, o in preps]
    # a request's CPU off its critical path: all it cost, as time alone, less its time to first token
    overhead = cpu_s / max(served, 1) / share(background) - statistics.mean(at_reference(*x) for x in ttfts)
    px = np.array([[1.0, v] for v, _ in preps])
    p0, p1 = np.linalg.lstsq(px, np.array([y for _, y in preps]), rcond=None)[0]

    # decode steps: B streams spread over the decode workers (the router takes the one with most room),
    # which step at once: each step's time alone is the inter-token time times their shared speed
    batches = [1, 2, 4] if quick else [1, 2, 4, 8, 16]
    d = s.decode_workers
    together = min(1.0, cores / d) if cores else 1.0
    steps = {}
    for b in batches:
        reqs = synthetic_workload(2 * b * d, seed=500 + b, max_new_tokens=32)
        since = time.time()
        res = run_load(address, reqs, concurrency=b * d, progress=False, label="profile")
        itl = percentile([x for r in res.ok for x in r.itl], 50)
        steps[b] = at_reference(itl, box.mean(since)) * together
    # by cached tokens: prompts of 2 images and 60 words at the middle batch, against the fit above
    b = batches[len(batches) // 2]
    reqs = synthetic_workload(2 * b * d, seed=900, images_per_prompt=2, filler_words=60, max_new_tokens=32)
    res = run_load(address, reqs, concurrency=b * d, progress=False, label="profile")
    small = statistics.mean(kb for kb, _ in hand[:1]) * b / 1e6  # the batch's KV MB with 1-image prompts
    large = statistics.mean(r.kv_bytes_kept for r in res.ok) * b / 1e6
    long_step = percentile([x for r in res.ok for x in r.itl], 50)
    per_kv_mb = max(0.0, (long_step - steps[b]) / (large - small)) if large > small else 0.0

    load, decode_address = s.decode_load()
    rpc_s = _rpc_s(decode_address, cfg)
    spec = s.spec
    vision_per_image = int(rows[0][1])
    return Profile(
        machine=f"{platform.node()} {platform.processor() or platform.machine()}, {cfg.model.device}, "
        f"{cfg.model.torch_threads} torch thread(s) per worker, {time.strftime('%Y-%m-%d')}"
        + (
            f", measured through the deployment at {s.address}"
            if isinstance(s, _Remote)
            else ", in-process servers"
        ),
        prefill_base_s=max(float(base), 1e-4),
        prefill_per_token_s=max(float(per_text), 0.0),
        prefill_per_vision_token_s=max(float(per_vision), 0.0),
        hit_vision_share=min(1.0, float(hit_share)),
        vision_tokens_per_image=vision_per_image,
        step_batches=batches,
        step_s=[float(steps[b]) for b in batches],
        step_per_kv_mb_s=per_kv_mb,
        handoff_base_s=max(float(h0), 0.0),
        handoff_per_mb_s=max(float(h1), 0.0),
        layers=spec.num_layers,
        token_bytes_per_layer=int(load.block_bytes // max(load.block_size, 1)),
        kv_keep=float(keep),
        block_size=load.block_size,
        pool_blocks=load.total_blocks,
        max_batch=cfg.pool.max_batch,
        worker_start_s=s.start_s,
        rpc_s=rpc_s,
        prep_base_s=max(float(p0), 1e-4),
        prep_per_vision_token_s=max(float(p1), 0.0),
        shared_cores=s.shared_cores,
        background_threads=background,
        overhead_s=max(overhead, 0.0),
        notes="prefill: time to first token at concurrency 1 (max_new_tokens=1) less the hand-off and the "
        "gateway's validation (timed here on the same requests); decode steps: median inter-token time of "
        "B streams per decode worker; times brought to background_threads, the mean other busy sessions while "
        "the prefills were measured",
    )
