"""``model.generate()``'s greedy tokens on a cluster's own model and processor: what the served tokens are compared
with when compression is off."""

from __future__ import annotations

import io

import torch
from PIL import Image

MAX_NEW = 8


def reference_tokens(cluster, images: list[bytes], question: str) -> list[int]:
    """Greedy tokens (``MAX_NEW`` at most, cut at EOS) of ``cluster.model`` for one user turn with ``images``."""
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
