"""``vlkv profile``: this machine's service times, measured on real servers, for ``vlkv simulate``.

Starts a prefill worker, a decode worker and a gateway in this process (real gRPC on localhost, the
deployment's default configuration) and drives them with the load generator's synthetic requests:

- prefill (and the gateway's share): time to first token of single requests with 1 and 2 images and
  with and without 60 words of text before them, less their hand-off, fitted as base + per text token +
  per vision token;
  each repeated once the image cache holds its images (the hit's share of the vision tokens' time);
- hand-off: the gateway's hand-off histogram per kind of request against the cache bytes kept;
- decode step time vs batch size: the median inter-token time of ``B`` concurrent streams;
- the pool (blocks, block size, bytes per token per layer), the share of tokens compression keeps, a
  ``GetLoad`` round trip, and how long a decode worker takes to start (model load included).
"""

from __future__ import annotations

import asyncio
import platform
import statistics
import threading
import time

import grpc
import numpy as np
from vlkv.common.config import DEFAULT_MODEL_DIR, ModelConfig, ServerConfig
from vlkv.common.model.loading import load_model, load_processor
from vlkv.deploy.servers import start_decode_worker, start_gateway, start_prefill_worker
from vlkv.tools.loadgen import percentile, run_load, synthetic_workload
from vlkv.tools.sim.profile import Profile
from vlkv.v1 import worker_pb2, worker_pb2_grpc


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

    def __init__(self, address: str, cfg: ServerConfig) -> None:
        from vlkv.common.model.spec import ModelSpec
        from vlkv.v1 import admin_pb2, admin_pb2_grpc

        self.address = address
        tokenizer = load_processor(cfg.model.path).tokenizer
        self.spec = ModelSpec.from_checkpoint(cfg.model.path, cfg.model.torch_dtype, tokenizer)
        with grpc.insecure_channel(address) as ch:
            status = admin_pb2_grpc.AdminStub(ch).GetStatus(admin_pb2.StatusRequest(), timeout=30)
        self._decode = next(w for w in status.workers if w.kind == "decode")
        self.block_size = cfg.pool.block_size

    def hand_off(self) -> tuple[float, int]:
        return 0.0, 0

    def decode_load(self) -> tuple[worker_pb2.WorkerLoad, str]:
        w = self._decode
        load = worker_pb2.WorkerLoad(
            total_blocks=w.total_blocks, block_bytes=w.block_bytes, block_size=self.block_size
        )
        return load, w.address

    def close(self) -> None:
        pass


def measure(model: str | None = None, quick: bool = False, address: str = "") -> Profile:
    """Measure servers started here, or (``address``) a running deployment's gateway."""
    cfg = ServerConfig(model=ModelConfig(path=model or str(DEFAULT_MODEL_DIR)))
    s = _Remote(address, cfg) if address else _Servers(cfg)
    try:
        return _measure(s, cfg, quick)
    finally:
        s.close()


def _measure(s, cfg: ServerConfig, quick: bool) -> Profile:
    address = s.address
    n = 3 if quick else 6
    run_load(address, synthetic_workload(2, seed=99, max_new_tokens=1), concurrency=1, progress=False)  # warm
    rows, hits, hand = [], [], []  # (text tokens, vision tokens, ttft), (vision, ttft), (bytes, s)
    for images, filler in ((1, 0), (1, 60), (2, 0)):
        for seed, out in ((1, rows), (1, hits)):  # the same requests twice: misses, then image-cache hits
            reqs = synthetic_workload(
                n,
                seed=seed + images * 10 + filler,
                images_per_prompt=images,
                filler_words=filler,
                max_new_tokens=1,
            )
            before = s.hand_off()
            res = run_load(address, reqs, concurrency=1, progress=False, label="profile")
            after = s.hand_off()
            ok = res.ok
            ttft = statistics.median(r.ttft for r in ok)
            vision = statistics.median(r.vision_tokens for r in ok)
            text = statistics.median(r.prompt_tokens for r in ok) - vision
            hand_s = (after[0] - before[0]) / max(1, after[1] - before[1])
            if out is rows:  # the prefill's part: time to first token less the hand-off
                rows.append((text, vision, ttft - hand_s))
                hand.append((statistics.mean(r.kv_bytes_kept for r in ok), hand_s))
                keep = statistics.mean(r.compression_ratio for r in ok)
            else:
                hits.append((text, vision, ttft - hand_s))
    a = np.array([[1.0, t, v] for t, v, _ in rows])
    base, per_text, per_vision = np.linalg.lstsq(a, np.array([y for *_, y in rows]), rcond=None)[0]
    hit_share = statistics.median(
        max(0.0, (y - base - per_text * t) / (per_vision * v)) for t, v, y in hits if per_vision > 0 and v
    ) if per_vision > 0 else 1.0  # fmt: skip
    hx = np.array([[1.0, b / 1e6] for b, _ in hand])
    h0, h1 = np.linalg.lstsq(hx, np.array([y for _, y in hand]), rcond=None)[0]

    batches = [1, 2, 4] if quick else [1, 2, 4, 8, 16]
    steps = []
    for b in batches:
        reqs = synthetic_workload(2 * b, seed=500 + b, max_new_tokens=32)
        res = run_load(address, reqs, concurrency=b, progress=False, label="profile")
        steps.append(percentile([x for r in res.ok for x in r.itl], 50))

    load, decode_address = s.decode_load()
    with grpc.insecure_channel(decode_address) as ch:
        stub = worker_pb2_grpc.DecodeWorkerStub(ch)
        stub.GetLoad(worker_pb2.LoadRequest(), timeout=10)
        rtts = []
        for _ in range(20):
            t = time.perf_counter()
            stub.GetLoad(worker_pb2.LoadRequest(), timeout=10)
            rtts.append(time.perf_counter() - t)
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
        step_s=[float(x) for x in steps],
        step_per_kv_mb_s=0.0,
        handoff_base_s=max(float(h0), 0.0),
        handoff_per_mb_s=max(float(h1), 0.0),
        layers=spec.num_layers,
        token_bytes_per_layer=int(load.block_bytes // max(load.block_size, 1)),
        kv_keep=float(keep),
        block_size=load.block_size,
        pool_blocks=load.total_blocks,
        max_batch=cfg.pool.max_batch,
        worker_start_s=s.start_s,
        rpc_s=statistics.median(rtts),
        notes="prefill times include the gateway's validation (time to first token at concurrency 1, "
        "max_new_tokens=1, less the hand-off); decode steps: median inter-token time of B streams",
    )
