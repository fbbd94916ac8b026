"""Runs a gateway, a prefill worker and a decode worker in this process, on a background event loop.

Real gRPC over localhost between the three servers; tests talk to the gateway with a sync client.
(The Ray-placed deployment has its own tests in tests/integration/test_deploy_local.py.)
"""

from __future__ import annotations

import asyncio
import threading

import grpc
from vlkv.common.config import ServerConfig
from vlkv.common.model.loading import load_model, load_processor
from vlkv.deploy.servers import start_decode_worker, start_gateway, start_prefill_worker
from vlkv.v1 import generate_pb2_grpc


class InProcCluster:
    def __init__(self, cfg: ServerConfig, client: bool = True) -> None:
        self.cfg = cfg
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.model = load_model(cfg.model)
        self.processor = load_processor(cfg.model.path)
        self.prefill = self.run(start_prefill_worker(cfg, model=self.model, processor=self.processor))
        self.decode = self.run(start_decode_worker(cfg, model=self.model, tokenizer=self.processor.tokenizer))
        self.prefill.servicer.allow_decode(self.decode.address)  # as the deployment registers its workers
        self.gateway = self.run(
            start_gateway(cfg, [self.prefill.address], [self.decode.address], processor=self.processor)
        )
        self.channel = grpc.insecure_channel(self.gateway.address) if client else None
        self.stub = generate_pb2_grpc.GenerationStub(self.channel) if client else None

    def run(self, coro, timeout: float = 120):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    @property
    def pool(self):
        return self.decode.servicer.pool

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()
        for r in (self.gateway, self.prefill, self.decode):
            self.run(r.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def evaluation_cluster(model_dir: str, n: int, seed: int):
    """``(cluster, examples, prepared)``: a cluster on ``model_dir`` with no image cache, ``n`` held-out examples
    of the synthetic task and their in-process prefills (``evaluation.prepare``), for tests that check the
    evaluation harness against the served path.

    No image cache: a request about an image already seen would reuse its K/V (approximately, by design), while
    the evaluation always prefills. The images are resized to the model's own input size: the server decodes an
    image much larger than that a few times smaller first (``decode_images``' ``max_side``), the evaluation
    hands the processor the image as is."""
    from PIL import Image
    from vlkv.common.config import ModelConfig, PoolConfig
    from vlkv.common.model.inputs import input_side
    from vlkv.deploy.synthetic_task import make_examples
    from vlkv_lab.eval.evaluation import prepare

    cfg = ServerConfig(
        model=ModelConfig(path=model_dir), pool=PoolConfig(pool_bytes=4 << 20), image_cache_mb=0
    )
    cluster = InProcCluster(cfg)
    examples = make_examples(n, seed=seed, split="heldout")
    side = input_side(cluster.processor)
    for ex in examples:
        ex.images = [im.resize((side, side), Image.Resampling.BICUBIC) for im in ex.images]
    return cluster, examples, prepare(cluster.model, cluster.processor, examples, progress=False)
