"""Fine-tuning from the default model, shared by the zoo members ``next_anyres`` and ``deep8``."""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Iterator

import torch
from vlkv.tools.progress import progress
from vlkv.tools.task.synthetic_task import Example

# --- fine-tuning ----------------------------------------------------------------------------------------


def answer_labels(ids: torch.Tensor, assistant_id: int, colon_id: int, eos_id: int) -> torch.Tensor:
    """``ids`` with -100 everywhere but the tokens after the last "ASSISTANT :" up to and including eos."""
    labels = torch.full_like(ids, -100)
    starts = [j for j in range(1, len(ids)) if ids[j] == colon_id and ids[j - 1] == assistant_id]
    for j in range(starts[-1] + 1, len(ids)):
        labels[j] = ids[j]
        if ids[j] == eos_id:
            break
    return labels


def collate(processor, examples: list[Example]) -> dict[str, torch.Tensor]:
    """Right-padded batch of one-turn chats (question, answer); labels only on the answer and its eos. Every
    tensor the processor returns besides the ids (``pixel_values``, LLaVA-NeXT's ``image_sizes``) is
    concatenated along the batch."""
    tok = processor.tokenizer
    a_id, c_id = tok.convert_tokens_to_ids("ASSISTANT"), tok.convert_tokens_to_ids(":")
    ids, labels, extra = [], [], {}
    for ex in examples:
        msgs = [*ex.messages, {"role": "assistant", "content": ex.answer}]
        enc = processor(images=ex.images, text=processor.apply_chat_template(msgs), return_tensors="pt")
        seq = enc["input_ids"][0]
        ids.append(seq)
        labels.append(answer_labels(seq, a_id, c_id, tok.eos_token_id))
        for k, v in enc.items():
            if k not in ("input_ids", "attention_mask"):
                extra.setdefault(k, []).append(v)
    width = max(len(s) for s in ids)
    batch = {
        "input_ids": torch.full((len(ids), width), tok.pad_token_id, dtype=torch.long),
        "attention_mask": torch.zeros((len(ids), width), dtype=torch.long),
        "labels": torch.full((len(ids), width), -100, dtype=torch.long),
    }
    for i, (s, lab) in enumerate(zip(ids, labels, strict=True)):
        batch["input_ids"][i, : len(s)] = s
        batch["attention_mask"][i, : len(s)] = 1
        batch["labels"][i, : len(s)] = lab
    return batch | {k: torch.cat(v, 0) for k, v in extra.items()}


def lr_at(step: int, steps: int, base: float, warmup: int) -> float:
    """Linear warm-up, then cosine to 5% of ``base``."""
    if step < warmup:
        return base * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return base * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * t)))


def set_determinism(seed: int, threads: int) -> None:
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    random.seed(seed)
    torch.use_deterministic_algorithms(True, warn_only=True)


def finetune(
    model,
    processor,
    stream: Iterator[list[Example]],
    steps: int,
    lr: float,
    warmup: int = 30,
    weight_decay: float = 0.01,
    log_every: int = 25,
    on_log: Callable[[int], None] | None = None,
) -> float:
    """Next-token loss on the answers (full attention, no eviction), AdamW, every parameter trained; returns
    the training seconds."""
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.98),
    )
    model.train()
    t0, ema = time.time(), None
    for step in progress(range(steps), desc="train", unit="step"):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, lr, warmup)
        loss = model(**collate(processor, next(stream))).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        ema = loss.item() if ema is None else 0.9 * ema + 0.1 * loss.item()
        if step % log_every == 0 or step == steps - 1:
            print(
                f"step {step:5d} loss {loss.item():.4f} ema {ema:.4f} elapsed {time.time() - t0:7.1f}s",
                flush=True,
            )
            if on_log is not None:
                on_log(step)
                model.train()
    model.eval()
    return time.time() - t0


def batches(make: Callable[[int], Example], batch_size: int) -> Iterator[list[Example]]:
    """Consecutive examples ``make(0), make(1), ...`` in batches."""
    i = 0
    while True:
        yield [make(i + j) for j in range(batch_size)]
        i += batch_size
