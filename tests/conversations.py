"""Conversations about one image for the prefix cache and continuation tests: the chat request of a conversation's
turns, its served tokens and ``model.generate()``'s, and the prefill engine and plain prompts the in-process
tests run them through."""

from __future__ import annotations

import io

import numpy as np
import torch
from inproc_cluster import InProcCluster
from PIL import Image
from vlkv.common.compression.registry import CompressionSettings
from vlkv.common.config import ModelConfig, PoolConfig, ServerConfig
from vlkv.deploy.inprocess import InProcessEngine
from vlkv.prefill_worker.engine import PrefillEngine
from vlkv.prefill_worker.prefix_cache import PrefixCache
from vlkv.v1 import generate_pb2

MAX_NEW = 8
FULL = CompressionSettings("full", 1.0, 0.01)
VLCACHE = CompressionSettings("vlcache", 0.1, 0.01)


def png(seed: int, size: int = 40) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def conversation(turns: int) -> list[dict]:
    """A chat about one image: ``turns`` user questions, each but the last answered."""
    questions = ["what shapes are in the picture ?", "which one is red ?", "how many circles ?"]
    messages = []
    for t in range(turns):
        content = ([{"type": "image"}] if t == 0 else []) + [{"type": "text", "text": questions[t]}]
        messages.append({"role": "user", "content": content})
        if t < turns - 1:
            messages.append({"role": "assistant", "content": [{"type": "text", "text": f"answer {t} ."}]})
    return messages


def chat_request(messages: list[dict], image: bytes, *, budget: float = 1.0, policy: str = "full"):
    msgs = []
    for m in messages:
        parts = [
            generate_pb2.ContentPart(image=generate_pb2.ImagePlaceholder())
            if p["type"] == "image"
            else generate_pb2.ContentPart(text=p["text"])
            for p in m["content"]
        ]
        msgs.append(generate_pb2.ChatMessage(role=m["role"], content=parts))
    return generate_pb2.GenerateRequest(
        images=[image],
        chat=generate_pb2.ChatPrompt(messages=msgs),
        sampling=generate_pb2.SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0),
        compression=generate_pb2.CompressionParams(policy=policy, budget=budget),
    )


def run(stub, req):
    tokens, usage = [], None
    for resp in stub.Generate(req, timeout=120):
        if resp.HasField("token"):
            tokens += list(resp.token.token_ids)
        else:
            usage = resp.finished.usage
    return tokens, usage


def reference(cluster, messages: list[dict], image: bytes) -> list[int]:
    proc = cluster.processor
    text = proc.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = proc(images=[Image.open(io.BytesIO(image)).convert("RGB")], text=text, return_tensors="pt")
    with torch.inference_mode():
        out = cluster.model.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False)
    ids = out[0, inputs["input_ids"].shape[1] :].tolist()
    eos = proc.tokenizer.eos_token_id
    return ids[: ids.index(eos)] if eos in ids else ids


def prefill(engine: InProcessEngine, mb: int = 64, block: int = 4, share: bool = False) -> PrefillEngine:
    return PrefillEngine(
        engine.model, engine.spec, None, prefix_cache=PrefixCache(mb << 20, block), share_prefixes=share
    )


def prompts(turns: int) -> str:
    text = "<s> USER : <image> what is in the picture ? ASSISTANT :"
    for t in range(1, turns):
        text += f" answer {t} . </s> USER : and the colour of shape {t} ? ASSISTANT :"
    return text


def conversation_cluster(model_dir: str) -> InProcCluster:
    """The in-process cluster (real gRPC) the conversation tests talk to: an 8 MiB decode pool."""
    return InProcCluster(ServerConfig(model=ModelConfig(path=model_dir), pool=PoolConfig(pool_bytes=8 << 20)))
