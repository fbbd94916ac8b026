"""With compression off, the disaggregated path's greedy tokens equal ``model.generate()`` on the same input.

Runs the gateway, a prefill worker and a decode worker in-process with real gRPC between them, on random
tiny LLaVA and LLaVA-NeXT checkpoints (GQA and MHA), with one and with two images.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image
from vlkv.common.config import ModelConfig, PoolConfig, ServerConfig
from vlkv.tools.client import build_request, generate

from tests.conftest import TINY_VARIANTS
from tests.inproc_cluster import InProcCluster

MAX_NEW = 8


def random_png(seed: int, size: int = 40) -> bytes:
    rng = np.random.default_rng(seed)
    img = Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def reference_tokens(cluster: InProcCluster, images: list[bytes], question: str) -> list[int]:
    proc = cluster.processor
    messages = [
        {"role": "user", "content": [{"type": "image"}] * len(images) + [{"type": "text", "text": question}]}
    ]
    text = proc.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
    inputs = proc(images=pil, text=text, return_tensors="pt")
    with torch.inference_mode():
        out = cluster.model.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False)
    ids = out[0, inputs["input_ids"].shape[1] :].tolist()
    eos = cluster.processor.tokenizer.eos_token_id
    return ids[: ids.index(eos)] if eos in ids else ids


@pytest.mark.parametrize("variant", list(TINY_VARIANTS))
def test_full_cache_tokens_equal_generate(tiny_model_dirs, variant):
    cfg = ServerConfig(model=ModelConfig(path=tiny_model_dirs(variant)), pool=PoolConfig(pool_bytes=8 << 20))
    cluster = InProcCluster(cfg)
    try:
        free_before = cluster.pool.num_free
        for n_images in (1, 2):
            images = [random_png(10 * n_images + i) for i in range(n_images)]
            question = "what colour is the square ?"
            req = build_request(images=images, question=question, max_new_tokens=MAX_NEW, policy="full")
            got = generate(cluster.stub, req, timeout=60)
            want = reference_tokens(cluster, images, question)
            assert got.token_ids == want, f"{variant} with {n_images} image(s)"
            usage = got.finished.usage
            assert usage.generated_tokens >= len(want)
            assert usage.kv_bytes_kept == usage.kv_bytes_full > 0
            assert usage.vision_tokens > 0 and usage.prompt_tokens > usage.vision_tokens
        assert cluster.pool.num_free == free_before
    finally:
        cluster.close()
